"""The evaluation's records: one per (question, variant) and per positional run, their JSON
form, and the resumable cache they are appended to.

Their own module because the runner writes them and the report and the plots read them: each
imports this, and none of the three imports another's internals.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, cast

from service.strategies.request import Usage

log = logging.getLogger(__name__)

CACHE_FILE = "cache.jsonl"
POSITIONAL = "positional"

Status = Literal["ok", "error", "skipped"]

GENERATION_FAILED = "generation failed"
GOLD_SCORING_FAILED = "gold answer scoring failed"
RETRYABLE_GENERATOR_ERRORS = frozenset({GENERATION_FAILED, GOLD_SCORING_FAILED})
"""A generator forward that failed on its own (out of memory under a crowded GPU, a kernel
error) after the backend's one-by-one retry: the record is incomplete and another run may
succeed, so it is never cached and a cached one is recomputed (a pool on one H100 cached 1,201
such records as finished, 2026-11-25)."""


@dataclass(frozen=True)
class Cost:
    """Model work of one strategy run (or one generator evaluation)."""

    prompts: int
    prompts_scored: int
    prompt_tokens: int
    scored_tokens: int
    generations: int
    generated_tokens: int
    wall_s: float

    @classmethod
    def of(cls, usage: Usage, wall_s: float) -> Cost:
        return cls(
            prompts=usage.prompts,
            prompts_scored=usage.prompts_scored,
            prompt_tokens=usage.prompt_tokens,
            scored_tokens=usage.scored_tokens,
            generations=usage.generations,
            generated_tokens=usage.generated_tokens,
            wall_s=wall_s,
        )


@dataclass(frozen=True)
class RunKey:
    """What a cached record depends on (the brief's key plus the generator's settings)."""

    question_id: str
    variant: str
    scorer: str
    generator: str
    max_passages: int | None
    template: str
    max_answer_tokens: int
    seed: int
    generator_template: str | None = None
    """Set only when the generator's template differs from the scorer's (a base generator):
    records from before it existed keep their keys."""

    @classmethod
    def for_run(
        cls,
        question_id: str,
        variant: str,
        *,
        scorer: str,
        generator: str,
        max_passages: int | None,
        template: str,
        max_answer_tokens: int,
        seed: int,
        generator_template: str | None,
    ) -> RunKey:
        """A run's key, ``generator_template`` kept only when it differs from ``template``:
        the one rule the runner and the report's rebuild both key records by."""
        return cls(
            question_id=question_id,
            variant=variant,
            scorer=scorer,
            generator=generator,
            max_passages=max_passages,
            template=template,
            max_answer_tokens=max_answer_tokens,
            seed=seed,
            generator_template=None if generator_template == template else generator_template,
        )


RUN_SETTINGS = (
    "scorer",
    "generator",
    "template",
    "generator_template",
    "max_passages",
    "max_answer_tokens",
    "seed",
)
"""The fields of a ``RunKey`` that one run shares across its questions and variants."""


def run_settings(key: RunKey) -> tuple[object, ...]:
    """``key``'s ``RUN_SETTINGS``, in that order."""
    return tuple(getattr(key, name) for name in RUN_SETTINGS)


@dataclass(frozen=True)
class Record:
    """One (question, variant): the order, the generator's answer and its scores, the cost.

    Metric fields are ``None`` where they could not be measured (an error, a failed
    generation, a question without answers)."""

    key: RunKey
    strategy: str
    design: str | None
    placement: str | None
    status: Status
    n_passages: int
    gold: tuple[int, ...]
    error: str | None = None
    error_code: str | None = None
    order: tuple[int, ...] | None = None
    gold_rank_best: int | None = None
    gold_rank_mean: float | None = None
    answer: str | None = None
    accuracy: float | None = None
    em: float | None = None
    f1: float | None = None
    rouge_l: float | None = None
    gold_logprob: float | None = None
    gold_tokens: int | None = None
    gold_logprob_per_token: float | None = None
    strategy_answer: str | None = None
    strategy_answer_accuracy: float | None = None
    strategy_answer_em: float | None = None
    strategy_answer_f1: float | None = None
    strategy_answer_rouge_l: float | None = None
    cost: Cost | None = None
    generator_cost: Cost | None = None
    generator_error: str | None = None
    position_bias: tuple[float, ...] | None = None
    warnings: tuple[str, ...] = ()
    ranking: tuple[int, ...] | None = None
    """The strategy's judgement, best first (records written before 2026-11-28 have none)."""
    adaptive: dict[str, Any] | None = None
    """MoI's adaptive design: how it ran (``AdaptiveReport`` as a dict)."""

    @property
    def variant(self) -> str:
        return self.key.variant

    @property
    def retryable(self) -> bool:
        """Its generator failed in a way another run may not (``RETRYABLE_GENERATOR_ERRORS``)."""
        return self.generator_error in RETRYABLE_GENERATOR_ERRORS

    @property
    def question_id(self) -> str:
        return self.key.question_id

    def value(self, metric: str) -> float | None:
        """A numeric field by name (``None`` when missing or not finite)."""
        v = getattr(self, metric)
        if v is None:
            return None
        f = float(v)
        return f if math.isfinite(f) else None


@dataclass(frozen=True)
class SlotResult:
    """The positional run of one question with its gold passage in ``slot`` (1-based)."""

    slot: int
    answer: str | None
    accuracy: float | None
    em: float | None
    f1: float | None
    rouge_l: float | None
    gold_logprob_per_token: float | None
    question_logprob_per_token: float | None

    def value(self, metric: str) -> float | None:
        v = getattr(self, metric)
        return None if v is None or not math.isfinite(float(v)) else float(v)


@dataclass(frozen=True)
class PositionalRecord:
    key: RunKey
    status: Status
    n_passages: int
    gold_passage: int | None
    slots: tuple[SlotResult, ...] = ()
    error: str | None = None

    @property
    def question_id(self) -> str:
        return self.key.question_id


AnyRecord = Record | PositionalRecord


class RecordCache:
    """Finished records, one JSON object a line in ``cache.jsonl``, appended as they finish.

    A line that does not parse (the run died while writing it) is ignored and recomputed; the
    next record starts on a new line. A packed cache (``cache.jsonl.gz``, what the repository
    keeps: ``pack``) is read first, transparently; new records still go to ``cache.jsonl``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.packed = path.with_name(path.name + ".gz")
        self._records: dict[RunKey, AnyRecord] = {}
        self._all: dict[RunKey, AnyRecord] = {}
        """Every record read, those a resume recomputes (failed generations) included: what
        the report of the run that wrote them held, and what ``pack`` keeps."""
        self._torn = False
        retry = 0
        if self.packed.is_file():
            with gzip.open(self.packed, "rt", encoding="utf-8") as fh:
                retry += self._read(fh, self.packed)
        if path.is_file():
            data = path.read_bytes()
            self._torn = bool(data) and not data.endswith(b"\n")
            with path.open(encoding="utf-8") as fh:
                retry += self._read(fh, path)
        if retry:
            log.warning("%d records in %s had a failed generation: recomputed", retry, path)

    def _read(self, lines: Iterable[str], source: Path) -> int:
        retry = 0
        for line in lines:
            try:
                rec = record_from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring an unreadable line in %s", source)
                continue
            self._all[rec.key] = rec
            if isinstance(rec, Record) and rec.retryable:
                retry += 1
                self._records.pop(rec.key, None)
                continue
            self._records[rec.key] = rec
        return retry

    def get(self, key: RunKey) -> AnyRecord | None:
        """The record to resume with (a failed generation is not: it is recomputed)."""
        return self._records.get(key)

    def get_written(self, key: RunKey) -> AnyRecord | None:
        """The record as the run wrote it, a failed generation included (for its report)."""
        return self._all.get(key)

    def __len__(self) -> int:
        return len(self._all)

    def written(self) -> list[AnyRecord]:
        """Every record as written (the latest of each key), in the order first written."""
        return list(self._all.values())

    def run_settings(self) -> set[tuple[object, ...]]:
        """The settings (``RUN_SETTINGS``) of the runs whose records this cache holds."""
        return {run_settings(key) for key in self._all}

    def add(self, record: AnyRecord) -> None:
        self._records[record.key] = record
        self._all[record.key] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            if self._torn:  # end the torn line first, or this record would join it
                fh.write("\n")
                self._torn = False
            fh.write(json.dumps(record_to_json(record), allow_nan=False) + "\n")
            fh.flush()

    def pack(self) -> Path:
        """Fold everything into ``cache.jsonl.gz`` (one line a record, the latest of each key,
        unreadable lines dropped) and remove ``cache.jsonl``. Deterministic bytes: no time
        stamp or file name in the gzip header, so an unchanged cache packs to the same file."""
        tmp = self.packed.with_name(self.packed.name + ".tmp")
        with (
            tmp.open("wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
        ):
            for record in self._all.values():
                line = json.dumps(record_to_json(record), allow_nan=False) + "\n"
                gz.write(line.encode("utf-8"))
        tmp.replace(self.packed)
        self.path.unlink(missing_ok=True)
        self._torn = False
        return self.packed

    def set_aside(self) -> list[Path]:
        """Move the cache's files aside (``cache.replaced-<UTC time>.jsonl[.gz]``, nothing
        deleted) and start empty; returns where they went."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        moved = []
        for current in (self.packed, self.path):
            if current.is_file():
                target = current.with_name(
                    current.name.replace("cache.", f"cache.replaced-{stamp}.", 1)
                )
                current.rename(target)
                moved.append(target)
        self._records.clear()
        self._all.clear()
        self._torn = False
        return moved


def record_to_json(record: AnyRecord) -> dict[str, Any]:
    """A record as a JSON object (non-finite floats as ``null``)."""
    data = cast(dict[str, Any], json_safe(asdict(record)))
    data["kind"] = POSITIONAL if isinstance(record, PositionalRecord) else "strategy"
    return data


def record_from_json(data: dict[str, Any]) -> AnyRecord:
    """The inverse of ``record_to_json``.

    Raises:
        KeyError, TypeError, ValueError: not a record.
    """
    data = dict(data)
    kind = data.pop("kind")
    key = RunKey(**data.pop("key"))
    if kind == POSITIONAL:
        slots = tuple(SlotResult(**s) for s in data.pop("slots"))
        return PositionalRecord(key=key, slots=slots, **data)
    if kind != "strategy":
        raise ValueError(f"unknown record kind {kind!r}")
    for name in ("cost", "generator_cost"):
        if data.get(name) is not None:
            data[name] = Cost(**data[name])
    for name in ("gold", "order", "position_bias", "warnings", "ranking"):
        if data.get(name) is not None:
            data[name] = tuple(data[name])
    known = {f.name for f in fields(Record)}
    return Record(key=key, **{k: v for k, v in data.items() if k in known})


def json_safe(obj: object) -> object:
    """``obj`` with every non-finite float replaced by ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
