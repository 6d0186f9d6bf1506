"""What every benchmark shares: its command line, the development questions it reads by
default, and what it writes beside its figures (the command that measured them and where)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root: the benchmarks run from it as ``python -m bench.<name>``."""
RESULTS = ROOT / "results" / "bench"
"""Where a benchmark's ``--out`` goes by default: ``results/bench/<name>.json``."""
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "nq_open_dev.jsonl"
"""The NQ-Open development questions (``../shared/data`` beside the checkout)."""

Result = dict[str, Any]


def parser(name: str, doc: str | None, *, data: bool = False) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the options every benchmark has.

    Args:
        name: the script's name; ``--out`` defaults to ``results/bench/<name>.json``.
        doc: the script's module docstring; its first paragraph is the ``--help`` description.
        data: add ``--data`` (a JSONL of questions, default ``DATA``).
    """
    first_paragraph = " ".join((doc or name).strip().split("\n\n")[0].split())
    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=first_paragraph)
    if data:
        ap.add_argument("--data", default=str(DATA), help="JSONL of questions with passages")
    ap.add_argument("--out", default=str(RESULTS / f"{name}.json"), help="result JSON")
    return ap


def main(
    ap: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], Result | Coroutine[Any, Any, Result]],
) -> int:
    """Parse the command line, run the benchmark (awaited if it is a coroutine) and write
    its result to ``--out``; the exit code for ``raise SystemExit(...)``."""
    args = ap.parse_args()
    result = run(args)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    assert isinstance(result, dict)
    write(result, args.out)
    return 0


def provenance() -> dict[str, Any]:
    """The exact command (this script and its arguments) and the machine it ran on."""
    script = Path(sys.argv[0]).resolve()
    try:
        # Run as ``python -m bench.<name>`` from the checkout's root (docs/benchmarks.md).
        shown = ["-m", ".".join(script.relative_to(ROOT).with_suffix("").parts)]
    except ValueError:
        shown = [str(script)]
    return {
        "command": shlex.join(["python", *shown, *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }


def write(result: dict[str, Any], path: str | Path) -> None:
    """Write ``result`` as JSON (creating the folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows a resumable benchmark appended so far (``append``); a line torn by an
    interruption is skipped, so the run redoes that row."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # torn by an interruption
    return out


def append(path: Path, row: dict[str, Any]) -> None:
    """Add one row to a resumable benchmark's JSONL (``read_jsonl``)."""
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
