"""The evaluations committed under results/eval, as the checks of their records read them:
each keeps its records packed (``cache.jsonl.gz``, ``rag-reorder eval-report --pack``)."""

from __future__ import annotations

import gzip
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "eval"
COMMITTED = sorted(p.parent.name for p in RESULTS.glob("*/cache.jsonl.gz"))
"""The committed evaluation folders (tests/repository checks that the list is not empty, so a
test parametrised by it cannot skip silently)."""


def committed_lines(folder: str) -> list[str]:
    """The record lines of a committed evaluation folder."""
    with gzip.open(RESULTS / folder / "cache.jsonl.gz", "rt") as fh:
        return fh.read().splitlines()
