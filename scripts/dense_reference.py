"""Write ``tests/data/dense_sample.jsonl``: NQ-Open dev questions with their first 10 passages
and the ``dense`` strategy's cosine scores for them, as the encoder of the checkout it runs in
computes them one request at a time (``cosine_scores``).

The committed file was written at commit 60708b4, before the encoder batched across requests;
``tests/service/test_embedding.py`` checks the batched encoder against it.

Usage: python scripts/dense_reference.py [--questions 24] [--out tests/data/dense_sample.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.passage import Passage  # noqa: E402
from service.strategies.retrieval import cosine_scores, passage_text  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "nq_open_dev.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "dense_sample.jsonl"))
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    with Path(args.out).open("w") as fh:
        for row in rows[: args.questions]:
            passages = [{"title": p["title"], "text": p["text"]} for p in row["passages"][:10]]
            docs = [passage_text(Passage(**p)) for p in passages]
            scores = cosine_scores(row["question"], docs)
            out = {"question": row["question"], "passages": passages, "cosine": scores.tolist()}
            fh.write(json.dumps(out) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
