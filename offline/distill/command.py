"""``rag-reorder distill``: the teacher's preference set, then the student's adapter."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

from offline.distill.preferences import Preference, PreferenceReport, build_preferences
from offline.distill.train import DistillConfig, distill
from service.batch.commandline import open_pipeline
from service.batch.dataset import Example
from service.config.settings import Settings
from service.errors import InvalidRequest
from service.model_assets import resolve_model
from service.model_assets.adapter import AdapterManifest
from service.pipeline import Reorderer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillJob:
    teacher: Settings
    """The teacher's (the generator's) settings; its template scores the preference set."""
    student: Settings
    """The student's settings; its template is the one the adapter is trained and served with."""
    out: Path
    """The adapter folder."""
    preferences: Path
    """The preference set (JSONL, resumable)."""
    data_name: str
    passages: int
    permutations: int
    held_back: int
    """Questions of the set kept out of training for the manifest's agreement."""
    seed: int = 0
    name: str | None = None
    progress: bool = True
    score_only: bool = False
    """Build (or complete) the preference set and stop before training."""
    concurrency: int = 1
    """Questions the teacher scores at once (``build_preferences``)."""


@dataclass(frozen=True)
class DistillOutcome:
    preferences: PreferenceReport
    manifest: AdapterManifest | None


async def run_distill(
    examples: Sequence[Example], job: DistillJob, config: DistillConfig
) -> DistillOutcome:
    """Build the preference set with the teacher, then train and write the adapter.

    Args:
        examples: training questions.
        job: what to run (``DistillJob``).
        config: the training hyperparameters.

    Returns:
        The preference set and the manifest written (``None`` with ``score_only``).

    Raises:
        InvalidRequest: bad sizes, a preference set built with other settings, or too few
            questions to hold some back and still train.
    """
    if job.held_back < 1:
        raise InvalidRequest("held-back questions must be at least 1", param="held_back")
    async with _teacher(job.teacher) as teacher:
        with _Bar(job.progress, "teacher", "questions") as step:
            report = await build_preferences(
                teacher,
                examples,
                job.preferences,
                passages=job.passages,
                permutations=job.permutations,
                seed=job.seed,
                data_name=job.data_name,
                concurrency=job.concurrency,
                progress=step,
            )
    log.info(
        "preference set: %d questions (%d scored now, %d skipped)",
        len(report.preferences),
        report.scored,
        report.skipped,
    )
    if job.score_only:
        return DistillOutcome(report, None)
    train, held = split(report.preferences, job.held_back, job.seed)
    student_dir = await anyio.to_thread.run_sync(lambda: resolve_model(job.student))
    with _Bar(job.progress, "student", "steps") as step:
        manifest = await anyio.to_thread.run_sync(
            lambda: distill(
                student_dir,
                student_id=job.student.model,
                student_template=job.student.chat_template,
                meta=report.meta,
                train=train,
                held_back=held,
                out=job.out,
                config=config,
                name=job.name,
                progress=step,
            )
        )
    return DistillOutcome(report, manifest)


def split(
    prefs: Sequence[Preference], held_back: int, seed: int
) -> tuple[list[Preference], list[Preference]]:
    """(train, held back): ``held_back`` questions drawn by ``seed``, the rest in set order.

    Raises:
        InvalidRequest: fewer than ``held_back + 1`` questions.
    """
    if len(prefs) <= held_back:
        raise InvalidRequest(
            f"{len(prefs)} question(s) in the preference set: too few to hold {held_back} back "
            "and train on the rest",
            param="limit",
        )
    pick = set(np.random.default_rng(seed).permutation(len(prefs))[:held_back].tolist())
    train = [p for i, p in enumerate(prefs) if i not in pick]
    held = [p for i, p in enumerate(prefs) if i in pick]
    return train, held


@asynccontextmanager
async def _teacher(settings: Settings) -> AsyncIterator[Reorderer]:
    """The teacher's serving pipeline, closed (its memory freed) before the student loads."""
    async with open_pipeline(settings) as reorderer:
        yield reorderer


class _Bar:
    """A tqdm bar as a ``(done, total)`` callback; nothing when ``enabled`` is false."""

    def __init__(self, enabled: bool, label: str, unit: str) -> None:
        self._enabled = enabled
        self._label = label
        self._unit = unit
        self._bar: tqdm | None = None

    def __enter__(self) -> Callable[[int, int], None]:
        def step(done: int, total: int) -> None:
            if not self._enabled:
                return
            if self._bar is None:
                self._bar = tqdm(total=total, desc=self._label, unit=f" {self._unit}")
            self._bar.n = done
            self._bar.refresh()

        return step

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
