"""How many MoI runs before ``auto`` may trust a learned profile, on a real model's runs.

``results/bench/auto_trust_runs_smollm2.jsonl`` holds the scores of SmolLM2-135M on MoI's
default design (pruned_random, 20 prompts of 5 passages, seed 0, as ``auto`` learns) for NQ-Open
*training* questions, 10 passages each (numbers only). For each run count k, ``--splits``
random splits take k runs to assess (``solver.trust.assess``, the service's rules) and pool the
other runs as a reference: how often k runs are trusted, and how often a trusted verdict puts
the same two strongest slots first as the reference does (what the placement depends on).
Then the cost, side by side on the same runs: the pooled fit by variable projection against
``solver.calibrate`` (the same objective), and one whole assessment.

Usage: python -m bench.auto_trust [--runs results/bench/auto_trust_runs_smollm2.jsonl]
       [--splits 20] [--out results/bench/auto_trust.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import solver
from bench import report
from solver import trust

N = 10


def load(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        (np.asarray(r["perms"], dtype=np.int64), np.asarray(r["scores"], dtype=np.float64))
        for r in rows
    ]


def timed(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs = load(Path(args.runs))
    rules = trust.TrustRules(min_runs=3)  # report every k; the service's minimum is 5
    rng = np.random.default_rng(args.seed)
    by_k: dict[str, Any] = {}
    for k in args.k:
        trusted = agree = 0
        for _ in range(args.splits):
            idx = rng.permutation(len(runs))
            mine = [runs[i] for i in idx[:k]]
            rest = [runs[i] for i in idx[k:]]
            t = trust.assess(mine, placement_slots=N, rules=rules)
            ref = trust.assess(rest, placement_slots=N, rules=trust.TrustRules(resamples=20))
            if t.trusted:
                trusted += 1
                agree += t.top_slots == ref.top_slots
        by_k[str(k)] = {
            "splits": args.splits,
            "trusted": trusted,
            "trusted_and_same_top_slots_as_the_rest": agree,
        }
        print(f"k={k}: trusted {trusted}/{args.splits}, same top slots {agree}/{trusted}")
    whole = trust.assess(runs, placement_slots=N)
    fast = trust.pooled_fit(runs)
    slow = solver.calibrate(runs).coefficients
    t_fast = timed(lambda: trust.pooled_fit(runs))
    t_slow = timed(lambda: solver.calibrate(runs))
    t_assess = timed(lambda: trust.assess(runs, placement_slots=N), repeat=1)
    return {
        **report.provenance(),
        "runs_file": args.runs,
        "runs": len(runs),
        "by_runs": by_k,
        "all_runs": {
            "verdict": whole.verdict,
            "coefficients": [round(float(c), 4) for c in whole.coefficients],
            "flat_p": whole.flat_p,
            "spread": whole.spread,
            "spread_upper": whole.spread_upper,
            "stability": whole.stability,
            "top_slots": list(whole.top_slots),
        },
        "pooled_fit_vs_calibrate": {
            "max_abs_difference": float(np.abs(fast - slow).max()),
            "pooled_fit_s": t_fast,
            "calibrate_s": t_slow,
            "speedup": t_slow / t_fast,
            "assess_s": t_assess,
        },
    }


def main() -> None:
    ap = report.parser("auto_trust", __doc__)
    ap.add_argument("--runs", default=str(report.RESULTS / "auto_trust_runs_smollm2.jsonl"))
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 8])
    ap.add_argument("--seed", type=int, default=1)
    raise SystemExit(report.main(ap, run))


if __name__ == "__main__":
    main()
