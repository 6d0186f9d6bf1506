"""Are the fit's adjacent-pair confidences calibrated? Synthetic designs with a known truth.

For each design (kind, N, M) and noise level: many fits of scores synthesised from random
utilities and a primacy bias (``s = sum_j a_j u[pi(j)] + noise``), every adjacent pair of each
fit's order scored by its ``confidence`` (P(this passage beats the next)) against whether the
truth agrees. Reported per setting: the residual degrees of freedom, the mean confidence
against the share of pairs in the right order (calibrated: equal), the same for the top 10%
most confident pairs, and what the normal CDF (the method notes' Phi(delta / SE), used before
Student's t) would have said for the same fits, and what the jackknife (``variance=
"jackknife"``, the service's default, built for real scores where the model is approximate)
says for them: the same fits, so the same pairs.

Usage: python -m bench.confidence [--trials 200] [--out results/bench/confidence.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from typing import Any

import numpy as np
from scipy.special import ndtr, stdtrit

import solver
from bench import report
from bench.report import provenance, write

SETTINGS = [  # kind, N, M (None: the default), noise
    ("pruned_random", 10, None, 0.1),
    ("pruned_random", 10, None, 0.3),
    ("pruned_random", 10, 40, 0.3),
    ("random", 10, None, 0.3),
    ("random", 20, None, 0.1),
    ("random", 20, None, 0.3),
    ("pruned_random", 50, None, 0.3),  # M = 100: the jackknife leaves out 20 groups of 5
]


def primacy(slots: int) -> np.ndarray:
    a = 1.0 / np.arange(1, slots + 1)
    return a / a.sum()


def one(kind: str, n: int, m: int | None, noise: float, trials: int) -> dict[str, Any]:
    conf: list[float] = []
    right: list[bool] = []
    jconf: list[float] = []
    dofs = set()
    for t in range(trials):
        rng = np.random.default_rng(t)
        perms = solver.plan(kind, n, num_prompts=m, seed=t)
        u = rng.standard_normal(n)
        a = primacy(perms.shape[1])
        s = (a[None, :] * u[perms]).sum(axis=1)
        s = s + noise * s.std() * rng.standard_normal(s.shape[0])
        f = solver.fit(perms, s)
        jack = solver.fit(perms, s, variance="jackknife")
        if f.confidence is None or jack.confidence is None:
            continue
        dofs.add(f.residual_dof)
        for k, c in enumerate(f.confidence):
            if np.isfinite(c):
                conf.append(float(c))
                right.append(bool(u[f.order[k]] > u[f.order[k + 1]]))
        # Same order (the point fit does not depend on the variance estimate).
        jconf.extend(float(c) for c in jack.confidence if np.isfinite(c))
    (dof,) = dofs
    c = np.asarray(conf)
    r = np.asarray(right, dtype=float)
    normal = ndtr(stdtrit(dof, c))  # the same delta / SE under the normal CDF
    top = c >= np.quantile(c, 0.9)
    return {
        "design": kind,
        "n_passages": n,
        "num_prompts": int(perms.shape[0]),
        "noise": noise,
        "residual_dof": dof,
        "pairs": int(c.size),
        "mean_confidence": float(c.mean()),
        "share_right": float(r.mean()),
        "normal_cdf_mean_confidence": float(normal.mean()),
        "top10_mean_confidence": float(c[top].mean()),
        "top10_share_right": float(r[top].mean()),
        "top10_normal_cdf_mean_confidence": float(normal[top].mean()),
        "jackknife_mean_confidence": float(np.mean(jconf)),
    }


def main() -> int:
    ap = report.parser("confidence", __doc__)
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for kind, n, m, noise in SETTINGS:
        row = one(kind, n, m, noise, args.trials)
        rows.append(row)
        print(
            f"{kind:>13} N={n:<3} M={row['num_prompts']:<3} noise {noise}: dof "
            f"{row['residual_dof']:>3}, confidence {row['mean_confidence']:.3f} for "
            f"{row['share_right']:.3f} right (normal CDF {row['normal_cdf_mean_confidence']:.3f}); "
            f"top 10%: {row['top10_mean_confidence']:.3f} for {row['top10_share_right']:.3f} "
            f"(normal {row['top10_normal_cdf_mean_confidence']:.3f}); jackknife "
            f"{row['jackknife_mean_confidence']:.3f}"
        )
    write({**provenance(), "trials": args.trials, "bias": "primacy 1/j", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
