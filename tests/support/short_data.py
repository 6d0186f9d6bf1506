"""The dev set's first questions with each passage cut short, for tests of a path, not a figure.

The dev set's passages are about 100 words: a prompt of a few of them is hundreds of tokens,
and on the CPU the real engines' scoring passes of such prompts were a large part of the
slowest tests (vLLM's CPU build scored 543 tokens in 17 s on this 2-core machine, busy). Cut
to their first words, the same commands plan the same prompts (the same passages, questions,
titles and gold positions) and score each through the same engine, at a fraction of the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

# ROOT/../shared/data, beside the checkout (tests/app/test_cli.py reads the same file).
DEV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "nq_open_dev.jsonl"


def short_dev_set(out: Path, questions: int, words: int = 12, source: Path = DEV) -> Path:
    """Write ``source``'s first ``questions`` lines to ``out``, each passage's text cut to its
    first ``words`` words; everything else of each line is kept as it is. Returns ``out``."""
    lines = source.read_text(encoding="utf-8").splitlines()[:questions]
    rows = [json.loads(line) for line in lines]
    for row in rows:
        for passage in row["passages"]:
            passage["text"] = " ".join(passage["text"].split()[:words])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return out
