"""The uplift's verdicts under the null, simulated: in streams where placing makes no
difference, how often does the always-valid interval ever say "helps" (or "hurts") while it is
read after every outcome (issue 92, docs/outcomes.md "The null")?

Each stream: ``--outcomes`` outcomes of one key, the arm of each drawn as the server draws it
(holdout with probability ``--holdout-rate``, else placed), both arms' outcomes Bernoulli with
the same mean (``--base``: 0.5 has the largest variance, 0.3 is SmolLM2's exact match); the
stream goes through ``solver.confseq`` exactly as ``service.learning.outcomes`` does (inverse-
probability weighted, the betting sequence at ``--alpha``, the verdict at ``--margin``), and
the verdict is read after every outcome. A stream counts as a false "helps" if any of its
verdicts is "helps". Also run: the same streams with a real uplift (``--effect``), for the
outcomes needed to reach "helps", and a flat generator's streams for when "no difference" is
reached. Streams are written as they finish (resumable: ``<out>.jsonl``).

Usage: python bench/outcomes_null.py [--streams 1000] [--outcomes 2000] [--holdout-rate 0.1]
           [--out results/bench/outcomes_null.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from service.learning.outcomes import verdict_of
from solver.confseq import GRID, excluded, ipw_stream


def verdicts(
    rng: np.random.Generator, args: argparse.Namespace, effect: float, base: float
) -> list[str]:
    """One stream's verdict after every outcome."""
    n, h = args.outcomes, args.holdout_rate
    arm = (rng.random(n) < h).astype(int)
    y = np.where(arm == 0, rng.random(n) < base + effect, rng.random(n) < base).astype(float)
    z, lo, hi = ipw_stream(y, arm, np.full(n, 1 - h), np.full(n, h))
    out = excluded(z, lo, hi, args.alpha)
    kept = ~out
    any_kept = kept.any(axis=1)
    first = np.where(any_kept, kept.argmax(axis=1), 0)
    last = np.where(any_kept, GRID.size - 1 - kept[:, ::-1].argmax(axis=1), GRID.size - 1)
    step = float(GRID[1] - GRID[0])
    lower = np.where(any_kept, np.maximum(-1.0, GRID[first] - step), -1.0)
    upper = np.where(any_kept, np.minimum(1.0, GRID[last] + step), 1.0)
    return [verdict_of(float(a), float(b), args.margin) for a, b in zip(lower, upper, strict=True)]


def first_at(vs: list[str], verdict: str) -> int | None:
    for i, v in enumerate(vs):
        if v == verdict:
            return i + 1
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    rows_path = out.with_suffix(".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = report.read_jsonl(rows_path)
    done = {(r["kind"], r["stream"]) for r in rows}
    started = time.time()
    plan = [("null", s) for s in range(args.streams)]
    plan += [("effect", s) for s in range(args.effect_streams)]
    for kind, s in plan:
        if (kind, s) in done:
            continue
        rng = np.random.default_rng([args.seed, 0 if kind == "null" else 1, s])
        effect = 0.0 if kind == "null" else args.effect
        vs = verdicts(rng, args, effect, args.base)
        row = {
            "kind": kind,
            "stream": s,
            "ever_helps": first_at(vs, "helps") is not None,
            "ever_hurts": first_at(vs, "hurts") is not None,
            "first_helps": first_at(vs, "helps"),
            "first_no_difference": first_at(vs, "no_difference"),
            "final": vs[-1],
        }
        report.append(rows_path, row)
        rows.append(row)
    null = [r for r in rows if r["kind"] == "null"]
    eff = [r for r in rows if r["kind"] == "effect"]

    def median(xs: list[int | None]) -> float | None:
        got = [x for x in xs if x is not None]
        return float(np.median(got)) if got else None

    return {
        **report.provenance(),
        "settings": {
            k: getattr(args, k)
            for k in ("streams", "outcomes", "holdout_rate", "alpha", "margin", "base", "effect")
        },
        "null": {
            "streams": len(null),
            "false_helps_rate": sum(r["ever_helps"] for r in null) / max(1, len(null)),
            "false_hurts_rate": sum(r["ever_hurts"] for r in null) / max(1, len(null)),
            "reached_no_difference": sum(r["first_no_difference"] is not None for r in null),
            "median_outcomes_to_no_difference": median([r["first_no_difference"] for r in null]),
            "final_verdicts": {
                v: sum(r["final"] == v for r in null)
                for v in ("helps", "hurts", "no_difference", "not_enough")
            },
        },
        "effect": {
            "streams": len(eff),
            "reached_helps": sum(r["first_helps"] is not None for r in eff),
            "median_outcomes_to_helps": median([r["first_helps"] for r in eff]),
            "false_hurts_rate": sum(r["ever_hurts"] for r in eff) / max(1, len(eff)),
        },
        "wall_s": round(time.time() - started, 1),
    }


def main() -> int:
    ap = report.parser("outcomes_null", __doc__)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--effect-streams", type=int, default=200)
    ap.add_argument("--outcomes", type=int, default=2000)
    ap.add_argument("--holdout-rate", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--base", type=float, default=0.5)
    ap.add_argument("--effect", type=float, default=0.225)
    ap.add_argument("--seed", type=int, default=92)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
