"""Measured positional profiles (Cuconasu et al., section 4) on disk, one per (model, template,
slots).

``max_relevance`` and ``min_distraction`` place passages by them; ``rag-reorder
calibrate-positions`` (``offline.positions.calibrate_positions``) measures and stores
them. A profile is never hard-coded: a strategy without a stored one refuses the request.

One JSON document per key, ``<profiles root>/positional/<model>__<template>__L<slots>.json``
(beside ``ProfileStore``'s MoI bias profiles, which its non-recursive listing never mixes in),
written atomically (temporary file, fsync, rename). Every read validates the whole document;
a file that does not parse or breaks a rule raises ``CorruptPositionalProfile`` naming the
file and the rule, never a half-read profile.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest, ServerError
from service.state.files import write_atomic
from service.state.profile_store import ProfileStore

SCHEMA_VERSION = 1
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class CorruptPositionalProfile(ServerError):
    """A stored positional profile cannot be read; re-run ``calibrate-positions``."""

    code = "profile_corrupt"


@dataclass(frozen=True)
class SlotMeans:
    """One measured curve: the mean over questions per prompt slot, first slot first."""

    values: tuple[float, ...]
    stderr: tuple[float | None, ...]
    """Standard error of each mean (sample sd / sqrt(questions)); ``None`` below 2 questions."""
    questions: int
    """Questions averaged (those with every slot's prompt answered)."""


@dataclass(frozen=True)
class PositionalRecord:
    """The profiles of one (model, template, slots) and where they came from.

    ``accuracy`` and ``answer_logprob`` rotate the gold passage through every slot among
    ``slots - 1`` fixed weak distractors; ``distracting_effect`` rotates the hardest
    distractor among the same weak distractors (``offline.positions`` has the rules).
    """

    model: str
    template: str
    """The answering template the accuracy profile was generated with (the request key)."""
    slots: int
    accuracy: SlotMeans
    """NQ-style accuracy of the greedy answer, per gold slot, in [0, 1]."""
    answer_logprob: SlotMeans
    """Mean per-token log-likelihood of the first gold answer (teacher forced), per gold slot."""
    distracting_effect: SlotMeans
    """1 - P(NO-RESPONSE | question, all slots) per hard-distractor slot, in [0, 1]."""
    de_template: str
    """The abstain template the distracting effects were measured with."""
    source: str
    """The QA set the profiles were measured on (file name)."""
    questions: int
    """Questions used (a gold passage, answers and enough measured distractors)."""
    skipped: int
    """Questions of the set left out (and why, in ``warnings``)."""
    hard_distractors: int
    """Used questions whose hardest distractor had single-passage DE > 0.8 (004's "hard")."""
    weak_distractors: int
    """Used questions whose weak distractors all had single-passage DE < 0.2 (004's "weak")."""
    max_answer_tokens: int
    created_at: float
    """Unix time of the measurement."""
    created: str
    """The same instant, ISO 8601 UTC."""
    warnings: tuple[str, ...] = ()


def now_fields() -> tuple[float, str]:
    """``(created_at, created)`` for a record measured now."""
    t = time.time()
    return t, datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


class PositionalStore:
    """Positional profiles as ``<root>/<model>__<template>__L<slots>.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def beside(cls, profiles: ProfileStore) -> PositionalStore:
        """The store under ``<profiles.root>/positional`` (``<settings.profiles_path>`` for the
        service's own ``ProfileStore``)."""
        return cls(profiles.root / "positional")

    def path(self, model: str, template: str, slots: int) -> Path:
        name = f"{_SAFE.sub('_', model)}__{_SAFE.sub('_', template)}__L{slots}.json"
        return self.root / name

    def get(self, model: str, template: str, slots: int) -> PositionalRecord | None:
        """The record for this key, or ``None`` when none was measured.

        Raises:
            CorruptPositionalProfile: the file exists but is not a valid record for this key.
        """
        p = self.path(model, template, slots)
        if not p.is_file():
            return None
        rec = _load(p)
        if (rec.model, rec.template, rec.slots) != (model, template, slots):
            # Two keys that sanitise to one file name: the file is not this key's.
            raise CorruptPositionalProfile(
                f"positional profile {p.name} holds ({rec.model!r}, {rec.template!r}, "
                f"{rec.slots}), not ({model!r}, {template!r}, {slots})"
            )
        return rec

    def put(self, record: PositionalRecord) -> PositionalRecord:
        """Store a record, replacing the key's previous one atomically.

        Raises:
            InvalidRequest: the record breaks a rule of the format (see ``_check``).
        """
        problem = _check(record)
        if problem:
            raise InvalidRequest(f"not a valid positional profile: {problem}")
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(record.model, record.template, record.slots)
        write_atomic(target, json.dumps({"schema": SCHEMA_VERSION, **asdict(record)}, indent=1))
        return record

    def list(self) -> list[PositionalRecord]:
        """Every stored record, sorted by model, template and slot count.

        Raises:
            CorruptPositionalProfile: a stored file is not a valid record.
        """
        if not self.root.is_dir():
            return []
        out = [_load(p) for p in sorted(self.root.glob("*.json"))]
        return sorted(out, key=lambda r: (r.model, r.template, r.slots))


def _load(path: Path) -> PositionalRecord:
    def corrupt(why: str) -> CorruptPositionalProfile:
        return CorruptPositionalProfile(
            f"positional profile {path.name} is corrupt ({why}); delete it or re-run "
            "`rag-reorder calibrate-positions`"
        )

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(f"unreadable: {exc}") from None
    try:
        record = _parse(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise corrupt(f"bad field: {exc!r}") from None
    problem = _check(record)
    if problem:
        raise corrupt(problem)
    return record


def _parse(data: Any) -> PositionalRecord:
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
    expected = {f for f in PositionalRecord.__dataclass_fields__} | {"schema"}
    if set(data) != expected:
        raise KeyError(", ".join(sorted(set(data) ^ expected)))

    def means(raw: Any) -> SlotMeans:
        if not isinstance(raw, dict) or set(raw) != {"values", "stderr", "questions"}:
            raise TypeError("a slot profile needs exactly values, stderr, questions")
        return SlotMeans(
            values=tuple(_number(v) for v in raw["values"]),
            stderr=tuple(None if v is None else _number(v) for v in raw["stderr"]),
            questions=_integer(raw["questions"]),
        )

    return PositionalRecord(
        model=_string(data["model"]),
        template=_string(data["template"]),
        slots=_integer(data["slots"]),
        accuracy=means(data["accuracy"]),
        answer_logprob=means(data["answer_logprob"]),
        distracting_effect=means(data["distracting_effect"]),
        de_template=_string(data["de_template"]),
        source=_string(data["source"]),
        questions=_integer(data["questions"]),
        skipped=_integer(data["skipped"]),
        hard_distractors=_integer(data["hard_distractors"]),
        weak_distractors=_integer(data["weak_distractors"]),
        max_answer_tokens=_integer(data["max_answer_tokens"]),
        created_at=_number(data["created_at"]),
        created=_string(data["created"]),
        warnings=tuple(_string(w) for w in data["warnings"]),
    )


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def _integer(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v


def _check(r: PositionalRecord) -> str | None:
    """The first rule the record breaks, or ``None``."""
    if r.slots < 1:
        return f"slots is {r.slots}"
    if not r.model or not r.template:
        return "model and template must be named"
    if r.questions < 1:
        return "no question was used"
    for name in ("skipped", "hard_distractors", "weak_distractors"):
        if not 0 <= getattr(r, name) <= (r.questions if name != "skipped" else math.inf):
            return f"{name} is {getattr(r, name)} for {r.questions} questions"
    if r.max_answer_tokens < 1:
        return f"max_answer_tokens is {r.max_answer_tokens}"
    bounds: dict[str, tuple[float, float]] = {
        "accuracy": (0.0, 1.0),
        "answer_logprob": (-math.inf, 0.0),
        "distracting_effect": (0.0, 1.0),
    }
    for name, (lo, hi) in bounds.items():
        m: SlotMeans = getattr(r, name)
        if len(m.values) != r.slots or len(m.stderr) != r.slots:
            return (
                f"{name} has {len(m.values)} values and {len(m.stderr)} errors for {r.slots} slots"
            )
        if not 1 <= m.questions <= r.questions:
            return f"{name} averages {m.questions} questions of {r.questions}"
        if not all(math.isfinite(v) and lo <= v <= hi for v in m.values):
            return f"{name} values must be finite and in [{lo}, {hi}]"
        for e in m.stderr:
            if (e is None) != (m.questions < 2) or (
                e is not None and not (math.isfinite(e) and e >= 0)
            ):
                return f"{name} standard errors must be >= 0, and null only below 2 questions"
    if not math.isfinite(r.created_at):
        return "created_at is not finite"
    return None
