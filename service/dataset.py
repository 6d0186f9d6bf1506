"""QA sets in the development-data schema (``shared/data/README.md``): one JSON object per line.

Gold labels (``is_gold``, ``gold_position``) stay on the ``Example`` for scoring; the passages
handed to the service never carry them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from service.errors import InvalidRequest
from service.passage import Passage


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    gold: tuple[int, ...]  # indices of gold passages (labels only)


def load_examples(path: Path, *, limit: int | None = None) -> list[Example]:
    """Read a JSONL file. Raises ``InvalidRequest`` naming the line of a malformed record."""
    return list(_iter(path, limit))


def _iter(path: Path, limit: int | None) -> Iterator[Example]:
    with path.open(encoding="utf-8") as fh:
        count = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                rec = json.loads(line)
                passages = tuple(
                    Passage(text=p["text"], title=p.get("title"), id=p.get("id"))
                    for p in rec["passages"]
                )
                gold = tuple(i for i, p in enumerate(rec["passages"]) if p.get("is_gold"))
                yield Example(
                    id=str(rec["id"]),
                    question=rec["question"],
                    answers=tuple(rec.get("answers", ())),
                    passages=passages,
                    gold=gold,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidRequest(f"{path.name}:{lineno}: not a QA record ({exc})") from None
            count += 1
