"""Greedy generation: one lockstep batch, with and without pruning its finished rows,
against the same requests one at a time.

LoRE, self-consistency, the positional calibration and the evaluation harness generate many
short answers per request. The transformers backend decodes them in lockstep batches (one
prefill, one forward per token for the whole batch), and a row that has finished leaves the
batch (``TransformersBackend.prune_finished``). This benchmark measures the three sides on the
same requests, rotating which goes first, and checks that they give the same tokens (greedy
decoding must not depend on batching beyond float noise: the count of answers differing from
the one-by-one side is printed).

Prompts: the generator's prompt (the configured template, ``RAG_REORDER_CHAT_TEMPLATE``) for the
first ``--queries`` NQ-Open dev questions with their first ``--passages`` passages, answered
with ``--max-new-tokens``; a completion template stops at the first line break, as the
service's answers do.

Usage: python -m bench.generation [--queries 8] [--passages 10] [--max-new-tokens 32]
       [--repeats 3] [--out results/bench/generation.json]
Settings come from the environment (``RAG_REORDER_DEVICE``, ``RAG_REORDER_DTYPE``, ...).
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
from service.backends.base import Generation, GenerationRequest
from service.backends.factory import create_backend, resolve_backend
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.prompting.prompts import build_generation_prompt
from service.prompting.templates import get_template


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    backend = await asyncio.to_thread(create_backend, settings)
    examples = load_examples(Path(args.data), limit=args.queries)
    completion = get_template(settings.chat_template).completion
    stop = backend.tokenizer.line_break_ids if completion else frozenset[int]()
    requests = []
    for k, ex in enumerate(examples):
        passages = ex.passages[: args.passages]
        prompt = build_generation_prompt(
            backend.tokenizer,
            settings.chat_template,
            ex.question,
            passages,
            list(range(len(passages))),
            max_tokens=backend.max_model_len - args.max_new_tokens,
        )
        requests.append(
            GenerationRequest(
                f"gen-{k}", prompt.token_ids, args.max_new_tokens, stop_token_ids=stop
            )
        )
    # Untimed warm-up of both paths (first-call allocations, kernel selection).
    await backend.generate(requests[:2])
    await backend.generate(requests[:1])
    sides = ("batched", "batched_unpruned", "one_by_one")
    times: dict[str, list[float]] = {side: [] for side in sides}
    outputs: dict[str, list[Any]] = {}
    for r in range(args.repeats):
        for side in sides[r % 3 :] + sides[: r % 3]:
            backend.prune_finished = side != "batched_unpruned"
            t = time.perf_counter()
            if side == "one_by_one":
                got = [(await backend.generate([req]))[0] for req in requests]
            else:
                got = await backend.generate(requests)
            times[side].append(time.perf_counter() - t)
            outputs[side] = got
    await backend.aclose()
    tokens = [len(g.token_ids) if isinstance(g, Generation) else 0 for g in outputs["batched"]]

    def differ(side: str) -> int:
        return sum(
            1
            for a, b in zip(outputs[side], outputs["one_by_one"], strict=True)
            if not (isinstance(a, Generation) and isinstance(b, Generation))
            or a.token_ids != b.token_ids
        )

    median = {side: statistics.median(times[side]) for side in sides}
    batched, unpruned, alone = median["batched"], median["batched_unpruned"], median["one_by_one"]
    summary = {
        "requests": len(requests),
        "prompt_tokens": sum(len(r.token_ids) for r in requests),
        "generated_tokens": sum(tokens),
        "longest_answer_tokens": max(tokens),
        "batched_s": batched,
        "batched_unpruned_s": unpruned,
        "one_by_one_s": alone,
        "speedup": alone / batched,
        "pruning_speedup": unpruned / batched,
        "answers_per_s_batched": len(requests) / batched,
        "answers_per_s_one_by_one": len(requests) / alone,
        "answers_differing": differ("batched"),
        "answers_differing_unpruned": differ("batched_unpruned"),
    }
    print(
        f"{len(requests)} answers, {summary['prompt_tokens']} prompt tokens, "
        f"{sum(tokens)} generated (longest {max(tokens)}): batched {batched:.2f}s, "
        f"without pruning {unpruned:.2f}s, one by one {alone:.2f}s; pruning "
        f"{summary['pruning_speedup']:.2f}x, batching {summary['speedup']:.2f}x; answers "
        f"differing from one by one: {summary['answers_differing']} "
        f"(unpruned {summary['answers_differing_unpruned']})"
    )
    return {
        **provenance(),
        "backend": resolve_backend(settings),
        "device": getattr(backend, "device", None),
        "dtype": settings.dtype,
        "model": backend.model_id,
        "summary": summary,
        "times_s": times,
    }


def main() -> int:
    ap = report.parser("generation", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
