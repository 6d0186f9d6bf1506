"""The teacher's preference set: K random permutations per question, scored by the teacher.

Each question's passages are cut as the evaluation cuts them (``prepare``: N passages, gold
kept), so the student learns on the inputs it is judged on. The teacher scores the permutations
through the serving pipeline (``Work.scoring_prompts`` and ``Work.score_prompts``): the score of
a permutation is the query's log-likelihood after the passages in that order (docs/method.md section
2), exactly what the service would read from the same model.

The set is a JSONL file: a first line ``{"meta": ...}`` (teacher, template, N, K, seed, data)
and one line per scored question, appended and flushed as each is done. A run on an existing
file keeps its questions and scores only the missing ones; a file written with other settings
is refused rather than mixed.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import numpy as np

from offline.evaluation.runner import prepare
from service.batch.dataset import Example
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage
from service.pipeline import Reorderer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferenceMeta:
    """What a preference set was built with; a resumed run must match it."""

    teacher: str
    template: str
    data: str
    passages: int
    """N: passages per question."""
    permutations: int
    """K: permutations scored per question."""
    seed: int


@dataclass(frozen=True)
class Preference:
    """One question's permutations and the teacher's score of each."""

    id: str
    question: str
    passages: tuple[Passage, ...]
    orders: tuple[tuple[int, ...], ...]
    scores: tuple[float, ...]
    """Query log-likelihood (nats, higher is better) of each order, as the service reads it."""
    prompt_tokens: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "question": self.question,
            "passages": [{"title": p.title, "text": p.text} for p in self.passages],
            "orders": [list(o) for o in self.orders],
            "scores": list(self.scores),
            "prompt_tokens": self.prompt_tokens,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, rec: dict[str, object]) -> Preference:
        passages = rec["passages"]
        orders = rec["orders"]
        scores = rec["scores"]
        if not (isinstance(passages, list) and isinstance(orders, list)):
            raise ValueError("passages and orders must be lists")
        if not isinstance(scores, list):
            raise ValueError("scores must be a list")
        return cls(
            id=str(rec["id"]),
            question=str(rec["question"]),
            passages=tuple(Passage(text=p["text"], title=p.get("title")) for p in passages),
            orders=tuple(tuple(int(i) for i in o) for o in orders),
            scores=tuple(float(s) for s in scores),
            prompt_tokens=int(str(rec.get("prompt_tokens", 0))),
            seconds=float(str(rec.get("seconds", 0.0))),
        )


@dataclass(frozen=True)
class PreferenceReport:
    meta: PreferenceMeta
    preferences: list[Preference]
    """Every question of the set, the resumed ones first."""
    scored: int
    """Questions scored by this run (the others came from the file)."""
    skipped: int
    """Questions left out: a prompt failed or was longer than the teacher's context."""


def sample_orders(n: int, k: int, key: str, seed: int) -> list[tuple[int, ...]]:
    """``k`` distinct random permutations of ``range(n)`` (all of them when ``n! <= k``).

    Seeded by ``seed`` and the question's id, so a question gets the same orders in every run
    whatever else the set holds (resuming, a different ``--limit``).
    """
    rng = np.random.default_rng([seed, zlib.crc32(key.encode("utf-8"))])
    if math.factorial(n) <= k:
        every = list(itertools.permutations(range(n)))
        return [every[i] for i in rng.permutation(len(every))]
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, ...]] = []
    while len(out) < k:
        order = tuple(int(i) for i in rng.permutation(n))
        if order not in seen:
            seen.add(order)
            out.append(order)
    return out


def read_preferences(path: Path) -> tuple[PreferenceMeta, list[Preference]]:
    """The meta line and the questions of a preference set.

    Raises:
        InvalidRequest: the file is not a preference set (names the line).
    """
    meta: PreferenceMeta | None = None
    prefs: list[Preference] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if meta is None:
                    meta = PreferenceMeta(**rec["meta"])
                else:
                    prefs.append(Preference.from_json(rec))
            except (KeyError, TypeError, ValueError) as exc:
                # A line cut by an interrupted run is the last one; resuming rewrites it.
                raise InvalidRequest(
                    f"{path.name}:{lineno}: not a preference record ({exc})", param="preferences"
                ) from None
    if meta is None:
        raise InvalidRequest(f"{path.name}: empty preference set", param="preferences")
    return meta, prefs


async def build_preferences(
    teacher: Reorderer,
    examples: Sequence[Example],
    out: Path,
    *,
    passages: int,
    permutations: int,
    seed: int = 0,
    template: str | None = None,
    data_name: str = "",
    concurrency: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> PreferenceReport:
    """Score ``permutations`` orders of each question with the teacher, appending to ``out``.

    Args:
        teacher: the serving pipeline on the teacher model.
        examples: training questions (labels are not used, except to keep the gold passage
            among the N as the evaluation does).
        out: the JSONL set; created, or resumed when it exists.
        passages: N, passages per question.
        permutations: K, orders scored per question (at least 2: a softmax over one is 1).
        seed: permutation seed.
        template: the teacher's scoring template (default: the configured one).
        data_name: provenance recorded in the meta line.
        concurrency: questions scored at once. Their prompts share the teacher's forwards
            (the backend's scheduler packs concurrent calls), which keeps a GPU busy; one
            question's K prompts alone fill a CPU's forwards.
        progress: called with (done, total) after each question.

    Returns:
        The whole set, in ``examples``' order (questions of the file that are not among
        ``examples`` last), so the held-back split does not depend on the completion order.

    Raises:
        InvalidRequest: bad N or K, or ``out`` was built with other settings.
    """
    if passages < 2:
        raise InvalidRequest("passages must be at least 2", param="passages")
    if permutations < 2:
        raise InvalidRequest("permutations must be at least 2", param="permutations")
    meta = PreferenceMeta(
        teacher=teacher.backend.model_id,
        template=template or teacher.settings.chat_template,
        data=data_name,
        passages=passages,
        permutations=permutations,
        seed=seed,
    )
    done: list[Preference] = []
    if out.exists() and out.stat().st_size > 0:
        old_meta, done = _resume(out)
        if old_meta != meta:
            raise InvalidRequest(
                f"{out.name} was built with {asdict(old_meta)}, not {asdict(meta)}; "
                "use another --out",
                param="out",
            )
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": asdict(meta)}) + "\n", encoding="utf-8")
    have = {p.id for p in done}
    todo = [ex for ex in examples if ex.id not in have]
    if concurrency < 1:
        raise InvalidRequest("concurrency must be at least 1", param="concurrency")
    scored = skipped = finished = 0
    gate = anyio.Semaphore(concurrency)
    with out.open("a", encoding="utf-8") as fh:

        async def one(ex: Example) -> None:
            nonlocal scored, skipped, finished
            async with gate:
                pref = await _score_question(teacher, meta, ex)
            # One event loop: the appends of concurrent questions never interleave.
            if pref is None:
                skipped += 1
            else:
                fh.write(json.dumps(pref.to_json()) + "\n")
                fh.flush()
                done.append(pref)
                scored += 1
            finished += 1
            if progress is not None:
                progress(finished, len(todo))

        async with anyio.create_task_group() as tg:
            for ex in todo:
                tg.start_soon(one, ex)
    rank = {ex.id: i for i, ex in enumerate(examples)}
    done.sort(key=lambda p: rank.get(p.id, len(rank)))
    return PreferenceReport(meta, done, scored, skipped)


def _resume(out: Path) -> tuple[PreferenceMeta, list[Preference]]:
    """Read ``out``, dropping a last line cut by an interrupted run (rewriting the file)."""
    lines = out.read_text(encoding="utf-8").splitlines()
    while lines:
        try:
            json.loads(lines[-1])
            break
        except json.JSONDecodeError:
            log.warning("dropping a cut last line of %s", out.name)
            lines.pop()
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return read_preferences(out)


async def _score_question(
    teacher: Reorderer, meta: PreferenceMeta, ex: Example
) -> Preference | None:
    question = prepare(ex, meta.passages)
    if len(question.passages) < 2:
        log.warning("question %s has fewer than 2 passages; skipped", ex.id)
        return None
    orders = sample_orders(len(question.passages), meta.permutations, ex.id, meta.seed)
    work = teacher.work(f"distill-{ex.id}", meta.template)
    t0 = time.perf_counter()
    try:
        prompts = await work.scoring_prompts(question.question, question.passages, orders)
        rows = await work.score_prompts(prompts)
    except LimitExceeded:
        log.warning("question %s: a prompt is longer than the teacher's context; skipped", ex.id)
        return None
    seconds = time.perf_counter() - t0
    if any(r is None for r in rows):
        log.warning("question %s: a prompt failed; skipped", ex.id)
        return None
    return Preference(
        id=ex.id,
        question=question.question,
        passages=question.passages,
        orders=tuple(orders),
        scores=tuple(float(r.query.sum()) for r in rows if r is not None),
        prompt_tokens=work.usage().prompt_tokens,
        seconds=seconds,
    )
