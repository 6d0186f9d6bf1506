"""``rag-reorder convert-data``: QA sets in other common formats as the JSONL ``eval`` takes.

``litm``: the "lost in the middle" multi-document QA files (Liu et al., 2023: ``question``,
``answers``, ``ctxs`` of ``title``/``text``/``score``/``isgold``), which are also the DPR and
FiD retrieval outputs' shape (a JSON array of the same records; their ``score`` is the
retriever's, often a string). ``isgold`` marks the gold passage; ``hasanswer`` does not (a
passage that merely contains an answer string is not the annotated evidence) and is dropped. A
record's ``id`` is its own, else ``<file stem>-<n>``.

Every converted record is checked against the schema (``service.batch.dataset.parse_record``) before
the output is replaced, so a conversion either writes a file ``eval`` accepts or nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.batch.dataset import open_text, parse_record
from service.errors import InvalidRequest
from service.state.files import write_atomic


def convert_litm(source: Path, target: Path) -> int:
    """Convert ``source`` (JSONL, a JSON array, either gzipped) into ``target``; returns the
    number of questions.

    Raises:
        InvalidRequest: naming the record and the field that cannot be converted.
    """
    stem = source.name.split(".")[0]
    lines: list[str] = []
    for n, rec in _records(source):
        where = f"{source.name}:{n}"
        if not isinstance(rec, dict):
            raise InvalidRequest(f"{where}: expected a JSON object", param="input")
        ctxs = rec.get("ctxs")
        if not isinstance(ctxs, list) or not ctxs:
            raise InvalidRequest(f"{where}: ctxs: expected a non-empty list", param="input")
        passages = [_passage(c, f"{where}: ctxs[{i}]") for i, c in enumerate(ctxs)]
        answers = rec.get("answers")
        out = {
            "id": str(rec.get("id") or f"{stem}-{n}"),
            "question": rec.get("question"),
            "answers": answers if isinstance(answers, list) else [answers],
            "passages": passages,
        }
        line = json.dumps(out, ensure_ascii=False)
        parse_record(line, n, f"{source.name} (converted)")
        lines.append(line)
    write_atomic(target, "".join(line + "\n" for line in lines))
    return len(lines)


def _passage(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict):
        raise InvalidRequest(f"{where}: expected an object", param="input")
    p: dict[str, Any] = {"text": c.get("text")}
    if c.get("title"):
        p["title"] = c["title"]
    if c.get("id") is not None:
        p["id"] = str(c["id"])
    if c.get("score") is not None:
        try:
            p["score"] = float(c["score"])
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"{where}.score: expected a number, got {c['score']!r}", param="input"
            ) from None
    if c.get("isgold"):
        p["is_gold"] = True
    return p


def _records(source: Path) -> Iterator[tuple[int, Any]]:
    try:
        with open_text(source) as fh:
            text = fh.read()
    except OSError as exc:
        raise InvalidRequest(f"cannot read {source}: {exc}", param="input") from None
    if text.lstrip().startswith("["):
        try:
            yield from enumerate(json.loads(text), 1)
        except ValueError as exc:
            raise InvalidRequest(f"{source.name}: not JSON ({exc})", param="input") from None
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as exc:
                why = f"{source.name}:{n}: not JSON ({exc})"
                raise InvalidRequest(why, param="input") from None
