"""Solver benchmark: our fit against SLSQP on the paper's formulation, side by side in one run.

For N in 5, 10, 20, 50, 100 and each design it prints the median solve time of ``solver.fit``
(without and with the uncertainty diagnostics) and of scipy SLSQP on the MoI paper's program

    minimise sum_i (sum_j a_j u[pi_i(j)] - s_i)^2   s.t.  sum_j a_j = 1,  0 <= a_j <= 1

(analytic gradient, neutral start: a seeded random point of the simplex, u = the mean score of
the prompts showing each passage), with both objectives (RSS on the raw scores) and both
Kendall taus against the synthetic truth (primacy bias, 1% noise). Cyclic designs are solved
by us with the exact profile, as a calibrated deployment would; SLSQP gets the same program as
everywhere else, which a cyclic design cannot pin down (its tau shows it).

Usage: python -m bench.fit_vs_slsqp [--quick] [--out results/bench/fit_vs_slsqp.json]
"""

from __future__ import annotations

import os

# Small dense problems: one BLAS thread is faster (docs/method.md) and the timing is stable.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy
from scipy.optimize import minimize
from scipy.stats import kendalltau

import solver
from bench import report

DESIGNS = ["random", "pruned_random", "variable_pruned", "hybrid", "cyclic", "pruned_cyclic"]


def synth(perms: np.ndarray, u: np.ndarray, a: np.ndarray, noise: float, rng: Any) -> np.ndarray:
    n = u.shape[0]
    u_ext = np.append(u, 0.0)
    sig = u_ext[np.where(perms >= 0, perms, n)] @ a[: perms.shape[1]]
    return -30.0 + sig + noise * sig.std() * rng.standard_normal(sig.shape[0])


def slsqp(perms: np.ndarray, s: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, float, bool]:
    m, L = perms.shape
    ext = np.where(perms >= 0, perms, n)
    rows = np.repeat(np.arange(m), L)

    def unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x[:L], np.append(x[L:], 0.0)

    def f(x: np.ndarray) -> tuple[float, np.ndarray]:
        a, ue = unpack(x)
        shown = ue[ext]
        r = shown @ a - s
        ga = 2.0 * shown.T @ r
        gu_ext = np.zeros(n + 1)
        np.add.at(gu_ext, ext.ravel(), 2.0 * (r[:, None] * a[None, :]).ravel())
        return float(r @ r), np.concatenate([ga, gu_ext[:n]])

    rng = np.random.default_rng(seed)
    a0 = rng.dirichlet(np.ones(L))
    sums = np.zeros(n + 1)
    counts = np.zeros(n + 1)
    np.add.at(sums, ext.ravel(), np.repeat(s, L))
    np.add.at(counts, ext.ravel(), 1.0)
    u0 = sums[:n] / np.maximum(counts[:n], 1.0)
    del rows
    res = minimize(
        f,
        np.concatenate([a0, u0]),
        jac=True,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * L + [(None, None)] * n,
        constraints=[
            {
                "type": "eq",
                "fun": lambda x: x[:L].sum() - 1.0,
                "jac": lambda x: np.concatenate([np.ones(L), np.zeros(n)]),
            }
        ],
        options={"maxiter": 2000, "ftol": 1e-12},
    )
    return res.x[L:], float(res.fun), bool(res.success)


def median_ms(fn: Any, reps: int) -> float:
    fn()  # warm caches (bases, imports)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def case(n: int, design: str, seed: int, reps: int, slsqp_reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + n)
    u = rng.standard_normal(n)
    kw: dict[str, Any] = {}
    kind = design
    retr = None
    if design == "variable_pruned":
        kind = "pruned_random"
        retr = u + rng.standard_normal(n)  # a retriever that is right on average
        kw["retriever_scores"] = retr
    perms = solver.plan(kind, n, seed=seed, **kw)  # type: ignore[arg-type]
    L = perms.shape[1]
    a = solver.primacy_profile(L)
    s = synth(perms, u, a, 0.01, rng)
    ref = a if design in ("cyclic", "pruned_cyclic") else None
    call = {"reference_bias": ref, "retriever_scores": retr, "n_passages": n}
    fast = solver.fit(perms, s, uncertainty=False, **call)
    full = solver.fit(perms, s, uncertainty=True, **call)
    t_fast = median_ms(lambda: solver.fit(perms, s, uncertainty=False, **call), reps)
    t_full = median_ms(lambda: solver.fit(perms, s, uncertainty=True, **call), reps)
    u_sl, obj_sl, ok_sl = slsqp(perms, s, n, seed)
    t_sl = median_ms(lambda: slsqp(perms, s, n, seed), slsqp_reps)
    return {
        "n": n,
        "design": design,
        "prompts": int(perms.shape[0]),
        "slots": int(L),
        "identification": fast.identification,
        "ours_ms": round(t_fast, 4),
        "ours_full_ms": round(t_full, 4),
        "slsqp_ms": round(t_sl, 3),
        "speedup": round(t_sl / t_fast, 1),
        "objective_ours": fast.objective,
        "objective_slsqp": obj_sl,
        "tau_ours": float(kendalltau(fast.utilities, u)[0]),
        "tau_slsqp": float(kendalltau(u_sl, u)[0]),
        "converged_ours": fast.converged,
        "converged_slsqp": ok_sl,
        "iterations_ours": fast.iterations,
        "orientation": full.orientation,
        "orientation_strength": full.orientation_strength,
    }


def main() -> int:
    ap = report.parser("fit_vs_slsqp", __doc__)
    ap.add_argument("--quick", action="store_true", help="N in 5, 10, 20 only, fewer repeats")
    args = ap.parse_args()
    ns = [5, 10, 20] if args.quick else [5, 10, 20, 50, 100]
    rows = []
    hdr = (
        f"{'N':>4} {'design':<16} {'M':>4} {'L':>3} {'ident':<11} {'ours ms':>8} "
        f"{'+diag ms':>8} {'SLSQP ms':>9} {'x':>6} {'obj ours':>10} {'obj SLSQP':>10} "
        f"{'tau ours':>8} {'tau SLSQP':>9}"
    )
    print(hdr)
    for n in ns:
        reps = 200 if n <= 20 else (40 if n == 50 else 10)
        sl_reps = 5 if n <= 20 else (3 if n == 50 else 1)
        if args.quick:
            reps, sl_reps = max(20, reps // 5), 1
        for design in DESIGNS:
            r = case(n, design, seed=n, reps=reps, slsqp_reps=sl_reps)
            rows.append(r)
            print(
                f"{n:>4} {design:<16} {r['prompts']:>4} {r['slots']:>3} "
                f"{r['identification']:<11} {r['ours_ms']:>8.3f} {r['ours_full_ms']:>8.3f} "
                f"{r['slsqp_ms']:>9.1f} {r['speedup']:>6.0f} {r['objective_ours']:>10.3e} "
                f"{r['objective_slsqp']:>10.3e} {r['tau_ours']:>8.3f} {r['tau_slsqp']:>9.3f}",
                flush=True,
            )
    checks = []
    by = {(r["n"], r["design"]): r for r in rows}
    for d in ("random", "pruned_random"):
        r = by[(20, d)]
        checks.append((f"N=20 {d}: joint fit <= 2 ms median", r["ours_ms"] <= 2.0, r["ours_ms"]))
        checks.append(
            (f"N=20 {d}: with everything <= 6 ms", r["ours_full_ms"] <= 6.0, r["ours_full_ms"])
        )
    checks.append(
        (
            "N=20 cyclic: <= 0.5 ms",
            by[(20, "cyclic")]["ours_ms"] <= 0.5,
            by[(20, "cyclic")]["ours_ms"],
        )
    )
    for r in rows:
        if r["design"] in ("random", "pruned_random", "hybrid"):
            better = r["objective_ours"] <= r["objective_slsqp"] * (1 + 1e-6) + 1e-9
            checks.append(
                (
                    f"N={r['n']} {r['design']}: >= 10x SLSQP at <= its objective",
                    r["speedup"] >= 10 and better,
                    f"{r['speedup']}x, obj ok={better}",
                )
            )
    print()
    for name, ok, val in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({val})")
    out = {
        "command": "python -m bench.fit_vs_slsqp" + (" --quick" if args.quick else ""),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "blas_threads": os.environ["OPENBLAS_NUM_THREADS"],
        },
        "rows": rows,
        "checks": [{"check": c, "pass": bool(ok), "value": str(v)} for c, ok, v in checks],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
