"""Are MoI's adjacent-pair confidences calibrated on a real model's scores?

bench/confidence.py checks them on synthetic scores, where the model is exact. On SmolLM2's
scores bench/seed_stability.py found two designs disagreeing on the top passage while each
claimed about 0.99 for it. This measures it directly: per question, ``--seeds`` independent
default designs (pruned_random, ``--num-prompts`` prompts each) are scored once; each design's
fit is judged against a reference fitted on the OTHER designs' prompts pooled (five times the
prompts, and independent of the fit judged). Every adjacent pair of the judged fit's order is
one prediction: its ``confidence`` against whether the reference orders the pair the same way.

Reported for both covariance estimates (``solver.fit(variance=...)``: ``delta``, the
delta method, and ``jackknife``, the service's default): mean confidence against the share of
pairs the reference confirms (calibrated: equal, up to the reference's own noise, which
lowers the share a little), the Brier score, the same for the pairs claimed at >= 0.95 and for
the top pair. Then the cost: the solver's median time with each estimate on synthetic scores
of the default designs, measured side by side, and their ratio.

The scores are written to ``--raw`` (numbers only) and reused when that file exists, so the
analysis can be rerun without the model (``--raw`` alone, about a second).

Usage: python -m bench.confidence_real [--queries 8] [--seeds 6] [--num-prompts 20]
       [--raw results/bench/confidence_real_scores.json] [--out results/bench/confidence_real.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

import solver
from bench import report
from bench.report import RESULTS, provenance, write
from solver.fit import Variance

BINS = [(0.5, 0.6), (0.6, 0.75), (0.75, 0.9), (0.9, 0.97), (0.97, 1.01)]


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Score ``--seeds`` default designs per question with the embedded model."""
    from offline.evaluation.runner import prepare
    from service.backends.base import SpanLogprobs
    from service.backends.engines.transformers_backend import TransformersBackend
    from service.batch.dataset import load_examples
    from service.config.settings import Settings
    from service.prompting.prompts import build_prompts

    settings = Settings()
    backend = TransformersBackend.from_settings(settings)
    questions = []
    t0 = time.perf_counter()
    tokens = 0
    for k, ex in enumerate(load_examples(Path(args.data), limit=args.queries)):
        q = prepare(ex, args.passages)  # as `rag-reorder eval` cuts them: the gold kept
        n = len(q.passages)
        designs = []
        for s in range(args.seeds):
            perms = solver.plan("pruned_random", n, num_prompts=args.num_prompts, seed=1000 * s + k)
            orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
            prompts = build_prompts(
                backend.tokenizer, settings.chat_template, ex.question, q.passages, orders
            )
            requests = [p.span_request(f"q{k}-s{s}-{i}") for i, p in enumerate(prompts)]
            tokens += sum(len(r.token_ids) for r in requests)
            got = await backend.score(requests)
            if not all(isinstance(g, SpanLogprobs) for g in got):
                raise RuntimeError(f"question {k}: a prompt failed to score")
            scores = [sum(cast(SpanLogprobs, g).logprobs) for g in got]
            designs.append({"seed": 1000 * s + k, "perms": perms.tolist(), "scores": scores})
        questions.append({"id": ex.id, "n_passages": n, "gold": list(q.gold), "designs": designs})
        print(f"question {k + 1}/{args.queries} scored", file=sys.stderr, flush=True)
    return {
        **provenance(),
        "device": backend.device,
        "model": backend.model_id,
        "design": "pruned_random",
        "num_prompts": args.num_prompts,
        "prompt_tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "questions": questions,
    }


def references(raw: dict[str, Any]) -> list[list[Any]]:
    """Per question and design, the fit of the other designs' prompts pooled (the judge)."""
    out = []
    for q in raw["questions"]:
        n = int(q["n_passages"])
        designs = [(np.asarray(d["perms"]), np.asarray(d["scores"])) for d in q["designs"]]
        out.append(
            [
                solver.fit(
                    np.concatenate([p for j, (p, _) in enumerate(designs) if j != i]),
                    np.concatenate([s for j, (_, s) in enumerate(designs) if j != i]),
                    n_passages=n,
                    uncertainty=False,
                )
                for i in range(len(designs))
            ]
        )
    return out


def judge(raw: dict[str, Any], refs: list[list[Any]], variance: Variance) -> dict[str, Any]:
    """Each design's adjacent-pair confidences against the other designs' pooled fit."""
    conf: list[float] = []
    right: list[bool] = []
    top: list[tuple[float, bool]] = []
    dofs: list[int] = []
    for q, q_refs in zip(raw["questions"], refs, strict=True):
        n = int(q["n_passages"])
        designs = [(np.asarray(d["perms"]), np.asarray(d["scores"])) for d in q["designs"]]
        for (perms, scores), ref in zip(designs, q_refs, strict=True):
            f = solver.fit(perms, scores, n_passages=n, variance=variance)
            dofs.append(f.residual_dof)
            if f.confidence is None:
                continue
            for k, c in enumerate(f.confidence):
                if not np.isfinite(c):
                    continue
                a, b = f.order[k], f.order[k + 1]
                ok = bool(ref.utilities[a] > ref.utilities[b])
                conf.append(float(c))
                right.append(ok)
                if k == 0:
                    top.append((float(c), ok))
    c = np.asarray(conf)
    r = np.asarray(right, dtype=np.float64)
    sure = c >= 0.95
    surest = c >= 0.99
    return {
        "variance": variance,
        "fits": len(dofs),
        "residual_dof_median": statistics.median(dofs),
        "pairs": int(c.size),
        "mean_confidence": float(c.mean()),
        "share_confirmed": float(r.mean()),
        "brier": float(((c - r) ** 2).mean()),
        "pairs_claimed_095": int(sure.sum()),
        "share_confirmed_of_claimed_095": float(r[sure].mean()) if sure.any() else None,
        "pairs_claimed_099": int(surest.sum()),
        "share_confirmed_of_claimed_099": float(r[surest].mean()) if surest.any() else None,
        "bins": [
            {
                "claimed": [lo, hi],
                "pairs": int(m.sum()),
                "mean_confidence": float(c[m].mean()) if m.any() else None,
                "share_confirmed": float(r[m].mean()) if m.any() else None,
            }
            for lo, hi in BINS
            for m in [(c >= lo) & (c < hi)]
        ],
        "top_pair_mean_confidence": statistics.mean(t[0] for t in top),
        "top_pair_share_confirmed": statistics.mean(float(t[1]) for t in top),
    }


COST_DESIGNS = [("pruned_random", 10), ("random", 10), ("pruned_random", 20), ("random", 20)]


def cost(repeats: int) -> list[dict[str, Any]]:
    """Median solver time per fit, delta against jackknife, alternating so noise hits both."""
    rows = []
    for kind, n in COST_DESIGNS:
        perms = solver.plan(kind, n, seed=1)
        rng = np.random.default_rng(0)
        a = 1.0 / np.arange(1, perms.shape[1] + 1)
        s = (a / a.sum() * rng.standard_normal(n)[perms]).sum(axis=1)
        s = s + 0.3 * s.std() * rng.standard_normal(s.shape[0])
        times: dict[str, list[float]] = {"delta": [], "jackknife": []}
        for _ in range(repeats):
            for v in ("delta", "jackknife"):
                t0 = time.perf_counter()
                solver.fit(perms, s, variance=cast(Variance, v))
                times[v].append(time.perf_counter() - t0)
        d, j = statistics.median(times["delta"]), statistics.median(times["jackknife"])
        rows.append(
            {
                "design": kind,
                "n_passages": n,
                "prompts": int(perms.shape[0]),
                "delta_ms": round(1000 * d, 2),
                "jackknife_ms": round(1000 * j, 2),
                "ratio": round(j / d, 1),
            }
        )
        print(
            f"{kind:>13} N={n:<3} M={perms.shape[0]:<3} delta {1000 * d:7.2f} ms, jackknife "
            f"{1000 * j:7.2f} ms: {j / d:.1f}x"
        )
    return rows


def main() -> int:
    ap = report.parser("confidence_real", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15, help="timed fits per design and estimate")
    ap.add_argument("--raw", default=str(RESULTS / "confidence_real_scores.json"))
    args = ap.parse_args()
    raw_path = Path(args.raw)
    if raw_path.is_file():
        raw = json.loads(raw_path.read_text())
    else:
        raw = asyncio.run(collect(args))
        write(raw, raw_path)
    refs = references(raw)  # the same judges for both estimates
    rows = [judge(raw, refs, "delta"), judge(raw, refs, "jackknife")]
    for row in rows:
        print(
            f"{row['variance']:>9}: confidence {row['mean_confidence']:.3f} for "
            f"{row['share_confirmed']:.3f} confirmed (Brier {row['brier']:.4f}); claimed >= 0.95: "
            f"{row['pairs_claimed_095']} pairs, {row['share_confirmed_of_claimed_095']} confirmed;"
            f" top pair {row['top_pair_mean_confidence']:.3f} for "
            f"{row['top_pair_share_confirmed']:.3f}"
        )
        for b in row["bins"]:
            if b["pairs"]:
                print(
                    f"{'':>11}claimed in [{b['claimed'][0]}, {b['claimed'][1]}): {b['pairs']:>3} "
                    f"pairs, {b['mean_confidence']:.3f} claimed, "
                    f"{b['share_confirmed']:.3f} confirmed"
                )
    write(
        {
            **provenance(),
            "scores_from": {k: raw[k] for k in ("command", "device", "model", "seconds")},
            "questions": len(raw["questions"]),
            "designs_per_question": len(raw["questions"][0]["designs"]),
            "num_prompts": raw["num_prompts"],
            "rows": rows,
            "cost": cost(args.repeats),
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
