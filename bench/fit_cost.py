"""MoI's fit's CPU per request, one checkout's solver against another's, side by side.

The fit (with its jackknife) was 60% of a 10-passage MoI request's CPU at GPU speed
(``bench/cpu_stages.py``). This times ``solver.fit`` in each arm's checkout (``--arms
name=path,...``: the code before and after a change), each in its own process, the arms
alternating round by round so the machine's noise hits both; per fit the process's CPU time
(not wall time: this machine is shared), the best round's mean over the fits. Two sets of
fits, 10 passages, the service's default design (pruned random, 20 prompts):

- ``smollm2``: the 48 committed SmolLM2 fits (``results/bench/confidence_real_scores.json``:
  8 NQ-Open questions, 6 designs each);
- ``structureless``: 24 fits of scores with no structure, each prompt's score a sum of 12
  values uniform in [-4, -0.05] (what the paced engine returns: ``bench/load.py`` and
  ``bench/cpu_stages.py`` measure the service on it).

For each, ``delta`` and ``jackknife`` (the service's default), and per arm the fits' main
solver steps and the adjacent-pair confidences' mean distance from the first arm's.

Usage: python -m bench.fit_cost --arms before=/tmp/before,after=. [--rounds 5]
           [--out results/bench/fit_cost.json]
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import RESULTS, ROOT, parser, provenance, write

SCORES = RESULTS / "confidence_real_scores.json"
VARIANCES = ("delta", "jackknife")


def cases() -> dict[str, list[tuple[Any, Any, int]]]:
    """The two sets of fits (imports numpy and ``solver`` from the arm's ``sys.path``)."""
    import numpy as np

    import solver

    raw = json.loads(SCORES.read_text())
    real = [
        (np.asarray(d["perms"]), np.asarray(d["scores"]), int(q["n_passages"]))
        for q in raw["questions"]
        for d in q["designs"]
    ]
    rng = np.random.default_rng(0)
    flat = []
    for seed in range(24):
        perms = solver.plan("pruned_random", 10, seed=seed)
        flat.append((perms, -rng.uniform(0.05, 4.0, size=(perms.shape[0], 12)).sum(axis=1), 10))
    return {"smollm2": real, "structureless": flat}


def child(root: str) -> None:
    """One round in ``root``'s checkout: per set and variance, CPU ms per fit, steps and
    confidences, as one JSON line on stdout."""
    sys.path.insert(0, root)
    import solver

    out: dict[str, Any] = {}
    for name, fits in cases().items():
        for variance in VARIANCES:
            solver.fit(*fits[0][:2], n_passages=fits[0][2], variance=variance)  # warm caches
            t0 = time.process_time()
            done = [solver.fit(p, s, n_passages=n, variance=variance) for p, s, n in fits]
            ms = (time.process_time() - t0) / len(fits) * 1e3
            out[f"{name}/{variance}"] = {
                "cpu_ms_per_fit": ms,
                "iterations": sum(f.iterations for f in done),
                "confidence": [[float(c) for c in f.confidence] for f in done],
                "orders": [list(map(int, f.order)) for f in done],
            }
    print(json.dumps(out))


def main() -> int:
    ap = parser("fit_cost", __doc__)
    ap.add_argument("--arms", required=True, help="name=path,... (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    arms = dict(a.split("=", 1) for a in args.arms.split(","))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    rounds: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm, path in arms.items():
            root = str(Path(path).resolve())
            proc = subprocess.run(
                # This checkout's bench (-m from its root); the child puts the arm's root first
                # for `solver` itself.
                [sys.executable, "-m", "bench.fit_cost", "--arms", args.arms, "--child", root],
                capture_output=True, text=True, env=env, check=True, cwd=ROOT,
            )  # fmt: skip
            rounds[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: " + ", ".join(
                f"{k} {v['cpu_ms_per_fit']:.2f} ms" for k, v in rounds[arm][-1].items()
            ), flush=True)  # fmt: skip
    first = next(iter(arms))
    table: list[dict[str, Any]] = []
    for key in rounds[first][0]:
        ref = rounds[first][0][key]
        for arm in arms:
            ms = [r[key]["cpu_ms_per_fit"] for r in rounds[arm]]
            now = rounds[arm][0][key]
            moved = [
                abs(a - b)
                for x, y in zip(ref["confidence"], now["confidence"], strict=True)
                for a, b in zip(x, y, strict=True)
            ]
            table.append({
                "fits": key.split("/")[0], "variance": key.split("/")[1], "arm": arm,
                "cpu_ms_per_fit_best": min(ms), "cpu_ms_per_fit_median": statistics.median(ms),
                "ratio_to_first": min(ms) / min(r[key]["cpu_ms_per_fit"] for r in rounds[first]),
                "solver_steps": now["iterations"],
                "confidence_mean_moved": statistics.mean(moved) if moved else 0.0,
                "orders_same": sum(map(operator.eq, ref["orders"], now["orders"])),
                "fits_total": len(ref["orders"]),
            })  # fmt: skip
    for row in table:
        print(
            f"{row['fits']:>13} {row['variance']:>9} {row['arm']:>8}: "
            f"{row['cpu_ms_per_fit_best']:6.2f} ms/fit (x{row['ratio_to_first']:.2f}), "
            f"{row['solver_steps']} steps, confidences moved {row['confidence_mean_moved']:.4f}, "
            f"orders same {row['orders_same']}/{row['fits_total']}"
        )
    write({**provenance(), "arms": arms, "rounds": args.rounds, "table": table}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
