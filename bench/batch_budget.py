"""Forward-batch size on the transformers backend: the same prompts scored under several
``batch_token_budget`` values, side by side on one loaded model.

A budget is the most padded tokens per forward batch (``plan_batches`` sorts by length and
fills each batch up to it). On a GPU large batches are what keeps it busy; on a CPU they only
add padding and working-set size. This measures it: one backend object per budget over the
same weights, every budget run once per round in rotating order (load drift on a shared
machine hits all), prompt tokens per second and the largest log-prob difference against the
first budget.

Prompts: the scoring prompts of one MoI request per question, ``--design`` (default
``pruned_random``: 2N prompts of ceil(N/2) passages), for the first ``--queries`` NQ-Open dev
questions with ``--passages`` passages.

Usage: python -m bench.batch_budget [--budgets 16384,4096,2048,1024] [--queries 2]
       [--passages 10] [--design pruned_random] [--rounds 2] [--out results/bench/...json]
Settings (device, dtype) come from the environment (``RAG_REORDER_DEVICE``, ...).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import solver
from bench import report
from bench.report import provenance
from service.backends.base import ScoreResult, SpanRequest
from service.backends.engines.transformers_backend import TransformersBackend
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.model_assets import resolve_model
from service.prompting.prompts import build_prompts


def logprobs(results: list[ScoreResult]) -> np.ndarray:
    out = []
    for r in results:
        if not hasattr(r, "logprobs"):
            raise RuntimeError(f"a prompt failed: {r}")
        out.extend(r.logprobs)
    return np.asarray(out, dtype=np.float64)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    budgets = [int(b) for b in args.budgets.split(",")]
    base = TransformersBackend.load(
        resolve_model(settings),
        model_id=settings.model,
        device=settings.device,
        dtype=settings.dtype,
        batch_token_budget=budgets[0],
    )
    backends = {b: base.with_batch_token_budget(b) for b in budgets}
    requests: list[SpanRequest] = []
    for k, ex in enumerate(load_examples(Path(args.data), limit=args.queries)):
        passages = ex.passages[: args.passages]
        perms = solver.plan(args.design, len(passages), seed=k)
        orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
        prompts = build_prompts(
            base.tokenizer, settings.chat_template, ex.question, passages, orders
        )
        requests.extend(p.span_request(f"q{k}-{i}") for i, p in enumerate(prompts))
    tokens = sum(len(r.token_ids) for r in requests)
    await base.score(requests[:2])  # untimed warm-up
    times: dict[int, list[float]] = {b: [] for b in budgets}
    values: dict[int, np.ndarray] = {}
    for r in range(args.rounds):
        rotated = budgets[r % len(budgets) :] + budgets[: r % len(budgets)]
        for b in rotated:
            t = time.perf_counter()
            got = await backends[b].score(requests)
            times[b].append(time.perf_counter() - t)
            values[b] = logprobs(got)
    ref = values[budgets[0]]
    rows = []
    for b in budgets:
        median = statistics.median(times[b])
        rows.append(
            {
                "budget": b,
                "median_s": median,
                "tokens_per_s": tokens / median,
                "vs_first": statistics.median(times[budgets[0]]) / median,
                "max_abs_logprob_diff": float(np.max(np.abs(values[b] - ref))),
            }
        )
        print(
            f"budget {b:>6}: {median:7.2f} s, {tokens / median:8.0f} prompt tokens/s, "
            f"{rows[-1]['vs_first']:.2f}x the first budget, max |dlogprob| "
            f"{rows[-1]['max_abs_logprob_diff']:.1e}"
        )
    return {
        **provenance(),
        "device": str(base.device),
        "dtype": settings.dtype,
        "model": base.model_id,
        "prompts": len(requests),
        "prompt_tokens": tokens,
        "rows": rows,
        "times_s": {str(b): t for b, t in times.items()},
    }


def main() -> int:
    ap = report.parser("batch_budget", __doc__, data=True)
    ap.add_argument("--budgets", default="16384,4096,2048,1024")
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--design", default="pruned_random")
    ap.add_argument("--rounds", type=int, default=2)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
