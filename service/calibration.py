"""Calibrate a position-bias profile for the serving model from a set of queries.

Each query's passages are scored under a random (or pruned-random) design; the runs are fitted
with one shared bias (``solver.calibrate``) and the profile is stored per (model, template,
slot count), where cyclic designs of that slot count will find it (METHOD.md 3.3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread
import numpy as np

import solver
from service.dataset import Example
from service.errors import InvalidRequest
from service.pipeline import Reorderer
from service.profile_store import StoredProfile
from service.strategies.moi import score_design

log = logging.getLogger(__name__)

CalibrationDesign = Literal["random", "pruned_random"]


@dataclass(frozen=True)
class CalibrationReport:
    profile: StoredProfile
    queries: int
    prompts: int
    prompts_failed: int
    warnings: tuple[str, ...]


async def calibrate_profile(
    reorderer: Reorderer,
    examples: Sequence[Example],
    *,
    max_passages: int,
    design: CalibrationDesign = "random",
    prompt_passages: int | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
    template: str | None = None,
    source: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> CalibrationReport:
    """Score every example under ``design`` and store the shared bias profile.

    Args:
        reorderer: the serving pipeline (its backend and profile store are used).
        examples: queries with at least ``max_passages`` passages; the first ``max_passages``
            of each are used, so every run has the same slot count.
        max_passages: N, passages per query.
        design: ``random`` gives a profile for N slots (cyclic serving at N);
            ``pruned_random`` one for L slots (pruned cyclic serving at L).
        prompt_passages: L for pruned runs (default ceil(N/2)).
        num_prompts: prompts per query (default: the design's).
        seed: base seed; query k uses ``seed + k``.
        template: prompt template (default: the configured one).
        source: provenance recorded with the profile.
        progress: called with (done, total) after each query.

    Raises:
        InvalidRequest: no usable examples.
        UnidentifiableDesign: a run cannot identify the bias (too few prompts).
    """
    template = template or reorderer.settings.chat_template
    usable = [e for e in examples if len(e.passages) >= max_passages]
    if not usable:
        raise InvalidRequest(f"no example has {max_passages} passages", param="max_passages")
    warnings: list[str] = []
    if len(usable) < len(examples):
        warnings.append(f"{len(examples) - len(usable)} example(s) with fewer passages skipped")
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    prompts = failed = 0
    for k, ex in enumerate(usable):
        perms = solver.plan(
            design,
            max_passages,
            num_prompts=num_prompts,
            prompt_passages=prompt_passages,
            seed=seed + k,
        )
        work = reorderer.work(f"calibrate-{k}", template)
        scores = await score_design(work, ex.question, ex.passages[:max_passages], perms)
        runs.append((perms, scores))
        usage = work.usage()
        prompts += usage.prompts
        failed += usage.prompts_failed
        if progress is not None:
            progress(k + 1, len(usable))
    prof = await anyio.to_thread.run_sync(lambda: solver.calibrate(runs))
    warnings.extend(prof.warnings)
    stored = reorderer.profiles.put(
        model=reorderer.backend.model_id,
        template=template,
        coefficients=[float(c) for c in prof.coefficients],
        identification=prof.identification,
        runs=prof.runs,
        prompts=prof.prompts,
        r2=prof.r2,
        source=source or f"{len(usable)} queries, {design} design",
    )
    log.info("stored bias profile for %s / %s / L=%d", stored.model, template, stored.slots)
    return CalibrationReport(stored, len(usable), prompts, failed, tuple(warnings))
