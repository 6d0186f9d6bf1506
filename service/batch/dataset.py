"""QA sets as JSONL: one question per line, with its retrieved passages and gold answers.

The schema (docs/evaluation.md, "Your own questions") is the development sets' own
(``shared/data/README.md``), with the fields a user's export may lack made optional::

    {"id": "q1", "question": "...", "answers": ["..."],
     "passages": [{"text": "...", "title": "...", "id": "...", "score": 12.3, "is_gold": true}]}

``id`` (default: ``line-<n>``), ``title``, passage ``id``, ``score`` (the retriever's; when every
passage has one, "the retriever's order" is descending score) and the gold labels (``is_gold`` on
passages, or ``gold_position``: an index or a list of them) may be left out. Every record is
checked before anything is computed, so a bad file fails with the line and the field at once
rather than after an hour of paid calls. Gold labels stay on the ``Example`` for scoring; the
passages handed to the service never carry them.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from service.errors import InvalidRequest
from service.passage import Passage


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    gold: tuple[int, ...]  # indices of gold passages (labels only)
    line: int = 0
    """The record's line in its file (1-based; 0: not read from a file)."""


def load_examples(path: Path, *, limit: int | None = None) -> list[Example]:
    """Read a JSONL file (``.gz`` too), at most ``limit`` questions.

    Raises:
        InvalidRequest: naming the file, the line and the field of the first malformed record,
            or a question id used twice.
    """
    out: list[Example] = []
    seen: dict[str, int] = {}
    for ex in _iter(path, limit):
        if ex.id in seen:
            raise InvalidRequest(
                f"{path.name}:{ex.line}: id: {ex.id!r} is already the id of line {seen[ex.id]}",
                param="data",
            )
        seen[ex.id] = ex.line
        out.append(ex)
    return out


def open_text(path: Path) -> IO[str]:
    """A text file, gunzipped when its name ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _iter(path: Path, limit: int | None) -> Iterator[Example]:
    with open_text(path) as fh:
        count = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            yield parse_record(line, lineno, path.name)
            count += 1


class _Bad(Exception):
    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")


def parse_record(line: str, lineno: int, source: str) -> Example:
    """One line of the schema (module docstring) as an ``Example``.

    Raises:
        InvalidRequest: ``<source>:<line>: <field>: <what is wrong>``.
    """
    try:
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise _Bad("(line)", f"not JSON ({exc})") from None
        if not isinstance(rec, dict):
            raise _Bad("(line)", f"expected a JSON object, got {type(rec).__name__}")
        question = _text(rec.get("question"), "question")
        rid = rec.get("id", f"line-{lineno}")
        if not isinstance(rid, str | int) or isinstance(rid, bool) or str(rid) == "":
            raise _Bad("id", f"expected a non-empty string or an integer, got {rid!r}")
        answers = rec.get("answers", [])
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise _Bad("answers", f"expected a list of strings, got {_short(answers)}")
        raw = rec.get("passages")
        if not isinstance(raw, list) or not raw:
            raise _Bad("passages", f"expected a non-empty list, got {_short(raw)}")
        passages = tuple(_passage(p, f"passages[{i}]") for i, p in enumerate(raw))
        gold = _gold(rec, raw)
        return Example(str(rid), question, tuple(answers), passages, gold, lineno)
    except _Bad as bad:
        raise InvalidRequest(f"{source}:{lineno}: {bad}", param="data") from None


def _passage(p: Any, where: str) -> Passage:
    if isinstance(p, str):
        return Passage(text=_text(p, where))
    if not isinstance(p, dict):
        raise _Bad(where, f"expected an object or a string, got {_short(p)}")
    title = p.get("title")
    if title is not None and not isinstance(title, str):
        raise _Bad(f"{where}.title", f"expected a string, got {_short(title)}")
    pid = p.get("id")
    if pid is not None and not isinstance(pid, str | int):
        raise _Bad(f"{where}.id", f"expected a string, got {_short(pid)}")
    score = p.get("score")
    if score is not None and (
        isinstance(score, bool)
        or not isinstance(score, int | float)
        or not math.isfinite(float(score))
    ):
        raise _Bad(f"{where}.score", f"expected a finite number, got {_short(score)}")
    if "is_gold" in p and not isinstance(p["is_gold"], bool):
        raise _Bad(f"{where}.is_gold", f"expected true or false, got {_short(p['is_gold'])}")
    return Passage(
        text=_text(p.get("text"), f"{where}.text"),
        title=title,
        id=None if pid is None else str(pid),
        score=None if score is None else float(score),
    )


def _gold(rec: dict[str, Any], raw: list[Any]) -> tuple[int, ...]:
    flags = tuple(i for i, p in enumerate(raw) if isinstance(p, dict) and p.get("is_gold"))
    if flags or "gold_position" not in rec:
        return flags
    pos = rec["gold_position"]
    listed = pos if isinstance(pos, list) else [pos]
    for g in listed:
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(raw):
            raise _Bad(
                "gold_position", f"expected indices in [0, {len(raw) - 1}], got {_short(pos)}"
            )
    return tuple(sorted(set(listed)))


def _text(v: Any, field: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _Bad(field, f"expected a non-empty string, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    text = json.dumps(v) if v is not None else "nothing"
    return text if len(text) <= 60 else text[:57] + "..."
