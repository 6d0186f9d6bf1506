"""What MoI's jackknife costs, and that the stacked refits land where one-at-a-time ones do.

The service's confidences come from a jackknife over the prompts by default
(``solver.fit(variance="jackknife")``, ``RAG_REORDER_CONFIDENCE_METHOD``). It used to refit
each left-out problem one after the other with Gauss-Newton Levenberg-Marquardt, which made
a fit at N = 50 take seconds and one at N = 100 ten or more. Now the refits run stacked in one
pass (``solver.lm.run_batch``), with the exact Hessian (the refits converge in a few
iterations instead of dozens), and at most ``_JACKKNIFE_GROUPS`` (20) groups of prompts are
left out. Measured side by side in one run, per design (synthetic scores: primacy bias,
30% noise) and on the committed SmolLM2 scores (results/bench/confidence_real_scores.json):

- ``delta``: the fit with the delta method, the floor;
- ``one_at_a_time``: delete-one refits one after the other (the previous implementation,
  kept below as the reference);
- ``stacked``: the same delete-one refits, stacked (groups = M);
- ``default``: stacked and at most 20 groups (what the service runs; equal to ``stacked``
  when M <= 20, as on the default design at N = 10);

and the largest relative difference between ``stacked``'s and ``one_at_a_time``'s standard
errors (the same estimate: the same problems solved to the same tolerance by different
iterations), how many refits of each stopped at the iteration limit (where they disagree,
that is why), and the mean absolute difference grouping makes to the adjacent-pair
confidences (``default`` against ``stacked``; bench/confidence.py checks that the grouped
confidences stay calibrated).

Usage: python -m bench.jackknife_cost [--repeats 5] [--out results/bench/jackknife_cost.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib
import json
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np

import solver
from bench import report
from bench.report import RESULTS, provenance, write
from solver import lm
from solver.design import Design
from solver.fit import Variance

# The module (the package exports its `fit` function under the same name); typed loosely
# because the bench swaps its private implementation.
F: Any = importlib.import_module("solver.fit")
DESIGNS = [
    ("pruned_random", 10),
    ("random", 10),
    ("pruned_random", 20),
    ("random", 20),
    ("pruned_random", 50),
    ("random", 50),
    ("pruned_random", 100),
    ("random", 100),
]
METHODS = ("delta", "one_at_a_time", "stacked", "default")


def one_at_a_time(
    prob: lm.Problem, best: lm.State, aff: lm.Affine, gauge: bool, ref_c: np.ndarray
) -> tuple[np.ndarray, int] | None:
    """The previous ``_jackknife_cov``: each delete-one refit alone, warm-started from the fit
    and its bounds, Gauss-Newton."""
    d = prob.design
    m, n = d.prompts, d.n_passages
    us = np.empty((m, n))
    keep = np.ones(m, dtype=bool)
    stuck = 0
    for i in range(m):
        keep[i] = False
        sub = Design(np.ascontiguousarray(d.perms[keep]), n)
        left = lm.Problem(sub, prob.s[keep], None if prob.groups is None else prob.groups[keep])
        keep[i] = True
        if not sub.shown.all():
            return None
        st = lm.State(best.u.copy(), best.a.copy(), best.b.copy(), best.cost)
        if gauge or st.a.shape[0] == 1:
            st = lm.run(left, st, aff)
        else:
            st = lm.run_nonneg(left, st, active=best.a <= 0.0)
        stuck += not st.converged
        u = F._report_scale(st.u, st.a, ref_c)[1] if gauge else st.u
        us[i] = u - u.mean()
    dev = us - us.mean(axis=0)
    return (m - 1) / m * (dev.T @ dev), stuck


@contextmanager
def method(name: str) -> Iterator[str]:
    """Swap the jackknife's implementation for one of ``METHODS`` (``delta`` changes nothing:
    its fits ask for the delta method)."""
    saved = F._jackknife_cov, F._JACKKNIFE_GROUPS
    if name == "one_at_a_time":
        F._jackknife_cov = one_at_a_time
    elif name == "stacked":
        F._JACKKNIFE_GROUPS = 1 << 30
    try:
        yield "delta" if name == "delta" else "jackknife"
    finally:
        F._jackknife_cov, F._JACKKNIFE_GROUPS = saved


def timed_fit(
    perms: np.ndarray, s: np.ndarray, variance: str, n: int | None = None
) -> tuple[float, Any]:
    t0 = time.perf_counter()
    f = solver.fit(perms, s, n_passages=n, variance=cast(Variance, variance))
    return time.perf_counter() - t0, f


def synthetic(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    perms = solver.plan(kind, n, seed=1)  # type: ignore[arg-type]
    rng = np.random.default_rng(n)
    a = 1.0 / np.arange(1, perms.shape[1] + 1)
    u_ext = np.append(rng.standard_normal(n), 0.0)
    s = (a / a.sum() * u_ext[perms]).sum(axis=1)
    return perms, s + 0.3 * s.std() * rng.standard_normal(s.shape[0])


def max_rel_diff(a: Any, b: Any) -> float:
    x, y = a.utility_stderr, b.utility_stderr
    return float(np.nanmax(np.abs(x - y) / y))


def stalled(f: Any) -> int:
    """Refits that stopped at the iteration limit, from the fit's warning."""
    for w in f.warnings:
        m = re.match(r"(\d+) of \d+ jackknife refits stopped", w)
        if m:
            return int(m.group(1))
    return 0


def confidence_diff(a: Any, b: Any) -> float:
    return float(np.nanmean(np.abs(a.confidence - b.confidence)))


def designs(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for kind, n in DESIGNS:
        perms, s = synthetic(kind, n)
        times: dict[str, list[float]] = {k: [] for k in METHODS}
        fits: dict[str, Any] = {}
        # The slow reference takes tens of seconds at N = 100: fewer repeats there.
        for _ in range(repeats if n <= 20 else 1):
            for name in METHODS:
                with method(name) as variance:
                    dt, fits[name] = timed_fit(perms, s, variance)
                times[name].append(dt)
        ms = {k: round(1000 * statistics.median(v), 1) for k, v in times.items()}
        row = {
            "design": kind,
            "n_passages": n,
            "prompts": int(perms.shape[0]),
            "groups": min(int(perms.shape[0]), F._JACKKNIFE_GROUPS),
            **{f"{k}_ms": v for k, v in ms.items()},
            "speedup_stacked": round(ms["one_at_a_time"] / ms["stacked"], 1),
            "speedup_default": round(ms["one_at_a_time"] / ms["default"], 1),
            "default_over_delta": round(ms["default"] / ms["delta"], 1),
            "stacked_vs_one_at_a_time_max_rel_stderr_diff": max_rel_diff(
                fits["stacked"], fits["one_at_a_time"]
            ),
            "stalled_refits_one_at_a_time": stalled(fits["one_at_a_time"]),
            "stalled_refits_stacked": stalled(fits["stacked"]),
            "default_vs_stacked_mean_abs_confidence_diff": confidence_diff(
                fits["default"], fits["stacked"]
            ),
        }
        rows.append(row)
        print(
            f"{kind:>13} N={n:<3} M={row['prompts']:<3} delta {ms['delta']:7.1f} ms | jackknife: "
            f"one at a time {ms['one_at_a_time']:8.1f} ms, stacked {ms['stacked']:7.1f} ms "
            f"({row['speedup_stacked']}x), default {ms['default']:7.1f} ms "
            f"({row['speedup_default']}x; {row['default_over_delta']}x delta) | stacked stderr vs "
            f"one at a time {row['stacked_vs_one_at_a_time_max_rel_stderr_diff']:.1e} (refits "
            f"stalled: {row['stalled_refits_one_at_a_time']} vs {row['stalled_refits_stacked']}); "
            f"grouping moves confidences by "
            f"{row['default_vs_stacked_mean_abs_confidence_diff']:.3f}",
            flush=True,
        )
    return rows


def real(path: Path) -> dict[str, Any]:
    """The 48 default fits of SmolLM2's scores (M = 20: ``default`` is ``stacked``)."""
    raw = json.loads(path.read_text())
    cases = [
        (np.asarray(d["perms"]), np.asarray(d["scores"]), int(q["n_passages"]))
        for q in raw["questions"]
        for d in q["designs"]
    ]
    total = dict.fromkeys(METHODS, 0.0)
    diffs = []
    stuck = dict.fromkeys(METHODS, 0)
    for perms, s, n in cases:
        got = {}
        for name in METHODS:
            with method(name) as variance:
                dt, got[name] = timed_fit(perms, s, variance, n)
            total[name] += dt
            stuck[name] += stalled(got[name])
        diffs.append(max_rel_diff(got["default"], got["one_at_a_time"]))
    out: dict[str, Any] = {
        "fits": len(cases),
        **{f"{k}_ms_per_fit": round(1000 * v / len(cases), 1) for k, v in total.items()},
        "speedup_default": round(total["one_at_a_time"] / total["default"], 1),
        "stalled_refits_one_at_a_time": stuck["one_at_a_time"],
        "stalled_refits_default": stuck["default"],
        "max_rel_stderr_diff_quantiles": {
            q: float(np.quantile(diffs, q)) for q in (0.5, 0.9, 0.95, 1.0)
        },
    }
    print(
        f"SmolLM2 scores, {len(cases)} default fits: delta {out['delta_ms_per_fit']} ms, jackknife "
        f"one at a time {out['one_at_a_time_ms_per_fit']} ms, default "
        f"{out['default_ms_per_fit']} ms a fit ({out['speedup_default']}x); stderr difference "
        f"median {out['max_rel_stderr_diff_quantiles'][0.5]:.1e}, 95th percentile "
        f"{out['max_rel_stderr_diff_quantiles'][0.95]:.1e}, max "
        f"{out['max_rel_stderr_diff_quantiles'][1.0]:.1e} (refits stalled: "
        f"{out['stalled_refits_one_at_a_time']} vs {out['stalled_refits_default']})",
        flush=True,
    )
    return out


def main() -> int:
    ap = report.parser("jackknife_cost", __doc__)
    ap.add_argument("--repeats", type=int, default=5, help="timed fits per method, N <= 20")
    ap.add_argument("--raw", default=str(RESULTS / "confidence_real_scores.json"))
    args = ap.parse_args()
    result = {**provenance(), "real": real(Path(args.raw)), "designs": designs(args.repeats)}
    write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
