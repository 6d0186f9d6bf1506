"""Peak memory and time of one label-free refit (``solver.blind_profile.fit_blind_profile``) on
a large pool: the online sampler refits its whole pool of up to ``generator_max_answers``
(2,000) answers, and ``--slots`` passages a prompt (issue 90, item 5: +1.5 GB at 2,000 x 100).

Synthetic answers from a generator with a mild recency preference (seeded): each answer from
one slot, one in ten split over two. Peak allocation is read with ``tracemalloc`` (numpy
reports its buffers to it), the process's peak RSS with ``resource.getrusage``.

    PYTHONPATH=. .venv/bin/python -m bench.blind_profile_memory --answers 2000 --slots 100 \\
        --out results/bench/blind_profile_memory/memory_2000x100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from solver.blind_profile import fit_blind_profile
from solver.trust import TrustRules


def answers(n: int, slots: int, seed: int = 0) -> np.ndarray:
    """``n`` answers x ``slots``: slot k drawn with weight 1 + k / slots; 1 in 10 split."""
    rng = np.random.default_rng(seed)
    p = 1.0 + np.arange(slots) / slots
    p /= p.sum()
    w = np.zeros((n, slots))
    first = rng.choice(slots, size=n, p=p)
    split = rng.random(n) < 0.1
    second = rng.choice(slots, size=n, p=p)
    for i in range(n):
        if split[i] and second[i] != first[i]:
            w[i, first[i]] = w[i, second[i]] = 0.5
        else:
            w[i, first[i]] = 1.0
    return w


def measure(n: int, slots: int) -> dict[str, Any]:
    w = answers(n, slots)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    fit = fit_blind_profile(w, rules=TrustRules(), seed=0)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return {
        "answers": n,
        "slots": slots,
        "seconds": round(seconds, 2),
        "peak_alloc_mib": round(peak / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "verdict": fit.verdict,
        "flat_p": fit.flat_p,
        "stability": fit.stability,
        "share_max": max(fit.share),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.blind_profile_memory", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--answers", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = measure(args.answers, args.slots)
    result["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result["python"] = platform.python_version()
    result["numpy"] = np.__version__
    result["cpus"] = "shared 2-core CPU (loaded by other work)"
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
