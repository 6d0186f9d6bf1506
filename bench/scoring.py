"""Scoring benchmark: the MoI pipeline end to end against the backend scoring the same prompts.

For each query (NQ-Open dev, first N passages) it runs, interleaved A/B in one process so both
see the same machine state:

- pipeline: ``Reorderer.reorder`` (plan, tokenise, dedupe, score, fit, place);
- direct: ``backend.score`` on the identical span requests, tokenised beforehand (the floor).

It prints the ratio direct / pipeline (target >= 0.95: the pipeline adds at most 5%), tokens
per second, and the pipeline's time split (tokenise, score, solve), and writes JSON.

``--warm-each`` scores each query's prompts once, untimed, before its timed pair: on a GPU the
first call of each new batch shape pays for kernel selection, which would land on whichever
side goes first (2026-11-27, transformers on an H200: per-query ratios from 0.04 to 16.7).

Usage: python -m bench.scoring [--queries 6] [--passages 10] [--warm-each]
           [--out results/bench/scoring.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.report import provenance
from service.backends.factory import create_backend, resolve_backend
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.prompting.prompts import build_prompts


def cuda_peak_bytes() -> int | None:
    """Peak CUDA memory allocated in this process: the transformers backend's whole use. vLLM's
    engine core runs in a process of its own (scripts/device/gpu-engines.sh samples nvidia-smi
    for it, where the KV cache's reserved share dominates by design)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.max_memory_allocated())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    t0 = time.perf_counter()
    backend = await asyncio.to_thread(create_backend, settings)
    load_s = time.perf_counter() - t0
    reorderer = Reorderer(backend, settings)
    examples = load_examples(Path(args.data), limit=args.queries + 1)
    rows = []
    # One untimed warm-up query: first-call allocations are not what we measure.
    warm = examples[0]
    await reorderer.reorder(ReorderRequest(warm.question, warm.passages[: args.passages]))
    for k, ex in enumerate(examples[1:]):
        passages = ex.passages[: args.passages]
        # pruned_random: planned up front (the adaptive default plans round by round).
        req = ReorderRequest(
            ex.question, passages, request_id=f"bench-{k}", design=DesignSpec(kind="pruned_random")
        )
        kind, perms = reorderer.plan(req.design, passages)
        orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
        prompts = build_prompts(
            backend.tokenizer, settings.chat_template, ex.question, passages, orders
        )
        spans = [p.span_request(f"direct-{k}-{i}") for i, p in enumerate(prompts)]
        if args.warm_each:
            await backend.score([p.span_request(f"warm-{k}-{i}") for i, p in enumerate(prompts)])
        pair: dict[str, float] = {}
        # Alternate which side goes first so drift on a shared machine cancels out.
        for side in ("direct", "pipeline") if k % 2 == 0 else ("pipeline", "direct"):
            t = time.perf_counter()
            if side == "direct":
                await backend.score(spans)
            else:
                result = await reorderer.reorder(req)
            pair[side] = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for s in spans)
        rows.append(
            {
                "query": ex.id,
                "design": kind,
                "prompts": len(spans),
                "prompt_tokens": tokens,
                "direct_s": pair["direct"],
                "pipeline_s": pair["pipeline"],
                "ratio": pair["direct"] / pair["pipeline"],
                "tokenize_s": result.timing.tokenize_s,
                "scoring_s": result.timing.scoring_s,
                "solver_s": result.timing.solver_s,
                "tokens_per_s": tokens / pair["pipeline"],
            }
        )
        r = rows[-1]
        print(
            f"{ex.id:<24} M={r['prompts']:<3} tokens={tokens:<6} direct={r['direct_s']:.2f}s "
            f"pipeline={r['pipeline_s']:.2f}s ratio={r['ratio']:.3f} "
            f"(tokenise {r['tokenize_s']:.3f}s, score {r['scoring_s']:.2f}s, "
            f"solve {1e3 * r['solver_s']:.1f}ms)",
            flush=True,
        )
    await backend.aclose()
    direct = sum(r["direct_s"] for r in rows)
    pipe = sum(r["pipeline_s"] for r in rows)
    summary = {
        "ratio_total": direct / pipe,
        "ratio_median": statistics.median(r["ratio"] for r in rows),
        "tokens_per_s": sum(r["prompt_tokens"] for r in rows) / pipe,
        "split_s": {k: sum(r[k] for r in rows) for k in ("tokenize_s", "scoring_s", "solver_s")},
        "pipeline_s": pipe,
        "direct_s": direct,
        "model_load_s": load_s,
        "cuda_peak_allocated_bytes": cuda_peak_bytes(),
    }
    print(
        f"\nratio direct/pipeline: total {summary['ratio_total']:.3f}, median "
        f"{summary['ratio_median']:.3f} (target >= 0.95: "
        f"{'PASS' if summary['ratio_total'] >= 0.95 else 'FAIL'}); "
        f"{summary['tokens_per_s']:.0f} prompt tokens/s; split "
        + ", ".join(f"{k} {v:.2f}s" for k, v in summary["split_s"].items())
    )
    return {
        **provenance(),
        "backend": resolve_backend(settings),
        "device": getattr(backend, "device", None),
        "dtype": settings.dtype,
        "model": backend.model_id,
        "passages": args.passages,
        "warm_each": args.warm_each,
        "summary": summary,
        "rows": rows,
    }


def main() -> int:
    ap = report.parser("scoring", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=6)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument(
        "--warm-each", action="store_true", help="score each query's prompts once, untimed, first"
    )
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
