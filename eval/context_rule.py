"""How the distractor rule behaves where the truth is known (issue 93, item 2).

Synthetic requests through the service's own numerics (``solver.plan``, ``solver.fit``,
``solver.selection``): N = 10 passages, one gold (u = 2), three hard distractors (u = 0.5),
six weak ones (u = -0.5); a primacy bias; MoI's default ``pruned_random`` design (M = 20
prompts of L = 5); Gaussian noise on each prompt's score at the given share of the scores'
spread. Per rule and noise: how often the gold passage is dropped, the share of weak and hard
distractors dropped, and the passages kept, over 300 requests each.

    python eval/context_rule.py --out results/eval/context/rule.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import solver
from solver.selection import distractor_verdicts

TRUTH = np.array([2.0, 0.5, 0.5, 0.5] + [-0.5] * 6)
RULES = ("not_credibly_below", "credibly_above")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--trials", type=int, default=300)
    args = p.parse_args()
    n = len(TRUTH)
    rows = []
    for noise in (0.05, 0.2, 0.5, 1.0):
        counts = {r: {"gold": 0, "hard": 0.0, "weak": 0.0, "kept": 0.0} for r in RULES}
        for t in range(args.trials):
            rng = np.random.default_rng(t)
            perm = rng.permutation(n)  # the passages' input order, so index 0 is not special
            u = TRUTH[perm]
            design = solver.plan("pruned_random", n, seed=t)
            L = design.shape[1]
            a = solver.primacy_profile(L)
            clean = np.array(
                [sum(a[j] * u[row[j]] for j in range(L) if row[j] >= 0) for row in design]
            )
            s = clean + noise * clean.std() * rng.standard_normal(len(clean))
            f = solver.fit(design, s)
            ranking = list(np.argsort(-np.nan_to_num(f.utilities, nan=-1e9), kind="stable"))
            for rule in RULES:
                v = distractor_verdicts(
                    ranking,
                    f.utilities,
                    f.utility_stderr,
                    f.utility_cov,
                    fraction=1.0,
                    confidence=0.9,
                    rule=rule,
                )
                kept = {x.index for x in v if x.keep}
                gold = int(np.where(perm == 0)[0][0])
                hard = [int(np.where(perm == k)[0][0]) for k in (1, 2, 3)]
                weak = [i for i in range(n) if i != gold and i not in hard]
                c = counts[rule]
                c["gold"] += gold not in kept
                c["hard"] += sum(i not in kept for i in hard) / 3
                c["weak"] += sum(i not in kept for i in weak) / 6
                c["kept"] += len(kept)
        for rule in RULES:
            c = counts[rule]
            rows.append(
                {
                    "noise": noise,
                    "rule": rule,
                    "gold_dropped": c["gold"] / args.trials,
                    "hard_dropped": c["hard"] / args.trials,
                    "weak_dropped": c["weak"] / args.trials,
                    "kept": c["kept"] / args.trials,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"trials": args.trials, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
