"""The output folder of a resumable offline run (``profile-generator``, ``eval
--generator-url``): its settings file, which refuses a folder holding another run, and its
append-only JSONL records, read back with a torn last line skipped (that record is made again).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest


def claim(out: Path, run_file: str, settings: Mapping[str, Any], holds: str) -> None:
    """Make ``out`` this run's: refuse it when its ``run_file`` names other ``settings``,
    else create it and write them.

    Raises:
        InvalidRequest: ``"<out> holds <holds> (it differs in ...)"``.
    """
    path = out / run_file
    if path.is_file():
        theirs = json.loads(path.read_text())
        differ = [k for k in settings if theirs.get(k) != settings[k]]
        if differ:
            raise InvalidRequest(
                f"{out} holds {holds} (it differs in {', '.join(differ)}): choose another --out",
                param="out",
            )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(settings), indent=1) + "\n")


def records(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of an append-only JSONL file, none when it does not exist; a line that
    is not one (a torn last line, killed mid-write) is skipped."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec
