"""The output folder of a resumable offline run (``profile-generator``, ``eval
--generator-url``): its settings file, which refuses a folder holding another run, and its
append-only JSONL records, read back with a torn last line skipped (that record is made again).

A run can be killed at any byte. The settings file is replaced in one step (``write_atomic``),
so it is the old one or the new one; one torn by an older version, or edited by hand, is
replaced by this run's settings with a warning rather than failing every rerun. A record is
appended as one write; when the last one was torn (no newline at the end), ``append`` first
ends that line, so the torn fragment stays a line of its own that ``records`` skips and the
new record is not glued to it (and lost, and paid for again on the next rerun).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest
from service.state.files import write_atomic

log = logging.getLogger(__name__)


def claim(out: Path, run_file: str, settings: Mapping[str, Any], holds: str) -> None:
    """Make ``out`` this run's: refuse it when its ``run_file`` names other ``settings``,
    else create it and write them.

    A setting the file does not name (a folder written before that setting was checked) is
    taken as this run's; a file that is not a JSON object is replaced, with a warning.

    Raises:
        InvalidRequest: ``"<out> holds <holds> (it differs in ...)"``.
    """
    path = out / run_file
    if path.is_file():
        theirs = _settings_in(path)
        differ = [k for k in settings if k in theirs and theirs[k] != settings[k]]
        if differ:
            raise InvalidRequest(
                f"{out} holds {holds} (it differs in {', '.join(differ)}): choose another --out",
                param="out",
            )
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(dict(settings), indent=1) + "\n")


def _settings_in(path: Path) -> dict[str, Any]:
    try:
        theirs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        theirs = None
    if not isinstance(theirs, dict):
        # Killed mid-write before writes were atomic, or edited: refusing would fail every
        # rerun, and its records carry their own keys; the settings are rewritten below.
        log.warning("%s is not a settings file (torn?): replaced by this run's settings", path)
        return {}
    return theirs


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


def append(path: Path, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one JSON line, after ending a torn last line (module docstring)."""
    line = (json.dumps(record) + "\n").encode("utf-8")
    with path.open("a+b") as fh:
        if fh.seek(0, 2) > 0:
            fh.seek(-1, 2)
            if fh.read(1) != b"\n":
                line = b"\n" + line
        fh.write(line)
        fh.flush()
