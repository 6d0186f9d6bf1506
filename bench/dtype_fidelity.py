"""Does a faster dtype change MoI's answer? The same prompts scored in two (or more) dtypes,
side by side, and the MoI fits compared.

bfloat16 scored about 3x faster than float32 on the H100 (results/bench/scoring_cuda_*.json),
but the evaluation used float32 because bf16's effect on the fits was not measured. This
measures it: one backend per dtype over the same converted weights, every question's design
prompts scored by each (in rotating order, so load drift hits all), and per dtype against the
first: the largest and median per-prompt score difference (nats), the fit's Kendall tau with
the first dtype's ranking, how often the top passage and the whole placement are the same,
and the time.

Prompts: the default MoI design (``--design``, default ``pruned_random``) for the first
``--queries`` NQ-Open dev questions with ``--passages`` passages each.

Usage: python -m bench.dtype_fidelity [--dtypes float32,bfloat16] [--queries 8]
       [--passages 10] [--design pruned_random] [--baseline-seed 1000]
       [--out results/bench/dtype_fidelity.json]
``--baseline-seed`` adds the yardstick: the first dtype's fit on another draw of the design
(how much MoI's order moves with the design's seed alone).
Device and batch budget come from the environment (``RAG_REORDER_DEVICE``, ...).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
from scipy.stats import kendalltau

import solver
from bench import report
from bench.report import provenance
from service.backends.base import SpanLogprobs
from service.backends.engines.transformers_backend import DtypeName, TransformersBackend
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.model_assets import resolve_model
from service.prompting.prompts import build_prompts


def rank_tau(a: solver.Fit, b: solver.Fit) -> float:
    """Kendall tau between two fits' rankings, over passages: each passage's rank in ``a``
    against its rank in ``b`` (tau of the two index sequences themselves is another, wrong,
    number)."""
    return float(kendalltau(np.argsort(a.order), np.argsort(b.order)).statistic)


def agreement(fits: list[solver.Fit], reference: list[solver.Fit]) -> dict[str, float]:
    """How far two lists of fits (one per question) agree: Kendall tau over passage ranks
    (median, min), and the share of questions with the same top passage and the same order."""
    pairs = list(zip(fits, reference, strict=True))
    taus = [rank_tau(f, g) for f, g in pairs]
    return {
        "median_kendall_tau": statistics.median(taus),
        "min_kendall_tau": min(taus),
        "same_top_passage": sum(f.order[0] == g.order[0] for f, g in pairs) / len(pairs),
        "same_order": sum(list(f.order) == list(g.order) for f, g in pairs) / len(pairs),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    dtypes = [cast(DtypeName, d) for d in args.dtypes.split(",")]
    folder = resolve_model(settings)
    backends = {
        d: TransformersBackend.load(
            folder,
            model_id=settings.model,
            device=settings.device,
            dtype=d,
            batch_token_budget=settings.batch_token_budget,
        )
        for d in dtypes
    }
    first = backends[dtypes[0]]
    jobs = []
    examples = load_examples(Path(args.data), limit=args.queries)
    for k, ex in enumerate(examples):
        passages = ex.passages[: args.passages]
        perms = solver.plan(args.design, len(passages), seed=k)
        orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
        prompts = build_prompts(
            first.tokenizer, settings.chat_template, ex.question, passages, orders
        )
        jobs.append(
            (perms, len(passages), [p.span_request(f"q{k}-{i}") for i, p in enumerate(prompts)])
        )
    for b in backends.values():  # untimed warm-up (kernel selection, allocations)
        await b.score(jobs[0][2][:2])
    times: dict[str, float] = dict.fromkeys(dtypes, 0.0)
    scores: dict[str, list[np.ndarray]] = {d: [] for d in dtypes}
    for k, (_, _, requests) in enumerate(jobs):
        for d in dtypes[k % len(dtypes) :] + dtypes[: k % len(dtypes)]:
            t = time.perf_counter()
            got = await backends[d].score(requests)
            times[d] += time.perf_counter() - t
            if not all(isinstance(g, SpanLogprobs) for g in got):
                raise RuntimeError(f"{d}: a prompt failed to score")
            scores[d].append(np.asarray([sum(cast(SpanLogprobs, g).logprobs) for g in got]))
    fits = {
        d: [
            solver.fit(perms, s, n_passages=n, uncertainty=False)
            for (perms, n, _), s in zip(jobs, scores[d], strict=True)
        ]
        for d in dtypes
    }
    tokens = sum(len(r.token_ids) for _, _, reqs in jobs for r in reqs)
    rows = []
    if args.baseline_seed is not None:
        # The yardstick: the same dtype on another draw of the design (what MoI's answer
        # varies by anyway), against the first dtype on the first draw.
        other = []
        for k, (_, n, _) in enumerate(jobs):
            ex_passages = examples[k].passages[: args.passages]
            perms = solver.plan(args.design, n, seed=args.baseline_seed + k)
            orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
            prompts = build_prompts(
                first.tokenizer, settings.chat_template, examples[k].question, ex_passages, orders
            )
            got = await first.score([p.span_request(f"b{k}-{i}") for i, p in enumerate(prompts)])
            s_other = np.asarray([sum(cast(SpanLogprobs, g).logprobs) for g in got])
            other.append(solver.fit(perms, s_other, n_passages=n, uncertainty=False))
        baseline = {
            "what": f"{dtypes[0]}, design seed {args.baseline_seed}+k against seed k",
            **agreement(other, fits[dtypes[0]]),
        }
        print(
            f"baseline ({baseline['what']}): Kendall tau median "
            f"{baseline['median_kendall_tau']:.3f} min {baseline['min_kendall_tau']:.3f}, same "
            f"top {baseline['same_top_passage']:.2f}, same order {baseline['same_order']:.2f}"
        )
    for d in dtypes:
        diffs = np.concatenate(
            [np.abs(a - b) for a, b in zip(scores[d], scores[dtypes[0]], strict=True)]
        )
        row = {
            "dtype": d,
            "seconds": times[d],
            "tokens_per_s": tokens / times[d],
            "speed_vs_first": times[dtypes[0]] / times[d],
            "max_abs_score_diff": float(diffs.max()),
            "median_abs_score_diff": float(np.median(diffs)),
            **agreement(fits[d], fits[dtypes[0]]),
        }
        rows.append(row)
        print(
            f"{d:>9}: {row['tokens_per_s']:9.0f} prompt tokens/s ({row['speed_vs_first']:.2f}x), "
            f"score diff max {row['max_abs_score_diff']:.3g} median "
            f"{row['median_abs_score_diff']:.3g} nats, Kendall tau median "
            f"{row['median_kendall_tau']:.3f} min {row['min_kendall_tau']:.3f}, same top "
            f"{row['same_top_passage']:.2f}, same order {row['same_order']:.2f}"
        )
    return {
        **provenance(),
        "device": first.device,
        "model": first.model_id,
        "design": args.design,
        "questions": len(jobs),
        "prompts": sum(len(reqs) for _, _, reqs in jobs),
        "rows": rows,
        "seed_baseline": baseline if args.baseline_seed is not None else None,
    }


def main() -> int:
    ap = report.parser("dtype_fidelity", __doc__, data=True)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--design", default="pruned_random")
    ap.add_argument(
        "--baseline-seed",
        type=int,
        default=None,
        help="also fit the first dtype on the design drawn with this seed (+k), as a yardstick",
    )
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
