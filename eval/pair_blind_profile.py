"""`dense` placed by the label-free profile on NQ-Open dev, paired against the same questions
placed by the gold-based answer profile and against a shuffle (committed records); Markdown.

    python eval/pair_blind_profile.py --eval results/eval/blind_profile/nq_open_dev_smollm2 \\
        --gold results/eval/answer_profile/nq_open_dev --committed results/eval/nq_open_dev
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from compare_answer_profile import METRICS, NEW, records

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.stats import paired_comparison


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", type=Path, required=True, help="dense placed by the label-free one")
    ap.add_argument("--gold", type=Path, required=True, help="dense placed by the gold-based one")
    ap.add_argument("--committed", type=Path, required=True, help="holds the shuffle variant")
    args = ap.parse_args()
    new = records(args.eval)
    ids = sorted({q for q, v in new if v == NEW})
    sources = [
        (records(args.gold), NEW, "`dense` placed by the gold-based answer profile"),
        (records(args.committed), "shuffle", "shuffle (committed)"),
    ]
    print(f"`dense` placed by the label-free profile, {len(ids)} NQ-Open dev questions\n")
    print("| against | metric | n | mean difference [95% CI] | Wilcoxon p | wins / losses |")
    print("|---|---|---:|---|---:|---:|")
    for base, variant, label in sources:
        for metric, mlabel in METRICS:
            pairs = []
            for q in ids:
                a, b = new.get((q, NEW)), base.get((q, variant))
                va = a.value(metric) if a else None
                vb = b.value(metric) if b else None
                if va is not None and vb is not None:
                    pairs.append((va, vb))
            c = paired_comparison(mlabel, NEW, variant, pairs)
            print(
                f"| {label} | {mlabel} | {c.n} | {c.mean_diff:+.3f} [{c.ci_low:+.3f}, "
                f"{c.ci_high:+.3f}] | {c.p_value:.2g} | {c.wins} / {c.losses} |"
            )
    print("\nAccuracy over the same questions:\n")
    for base, variant, label in [(new, NEW, "label-free profile"), *sources]:
        acc = [r.value("accuracy") for q in ids if (r := base.get((q, variant))) is not None]
        found = [a for a in acc if a is not None]
        print(f"- {label}: {np.mean(found):.3f} ({len(found)} questions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
