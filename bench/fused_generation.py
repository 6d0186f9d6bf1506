"""The evaluation's generator step: an answer and the gold answer's log-probs per passage order,
from two forwards of the prompt (``Work.generate`` + ``Work.continuation_logprobs``) against one
(``Work.generate_and_score``, the gold answer teacher-forced after the prefill that starts the
answer).

The offline evaluation asks the generator, for every order of every question, for both; its
CPU time is dominated by those prompt forwards. This measures the two paths side by side on the
same prompts, alternating which goes first (load drift on a shared machine hits both), and
checks they agree: the same answers, and the gold log-probs within float noise (the largest
difference is printed).

Prompts: the generator's prompt (its model's template) for ``--orders`` seeded random orders of
NQ-Open dev question ``--question``'s passages, cut to ``--passages`` the way the evaluation
cuts them (gold passages kept); the continuation is that question's first answer.

Usage: python -m bench.fused_generation [--model google/gemma-3-270m] [--orders 8]
       [--passages 10] [--max-new-tokens 16] [--repeats 2] [--threads 1]
       [--out results/bench/fused_generation.json]
Other settings come from the environment (``RAG_REORDER_DEVICE``, ``RAG_REORDER_DTYPE``, ...).
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

import numpy as np
import torch

from bench import report
from bench.report import provenance
from offline.evaluation.runner import prepare
from service.backends.engines.transformers_backend import TransformersBackend
from service.batch.dataset import load_examples
from service.config.settings import GEMMA_MODEL, Settings
from service.pipeline import Reorderer
from service.prompting.prompts import BuiltPrompt
from service.strategies.request import Answer

Rows = list[tuple[Answer | None, tuple[float, ...] | None]]


async def separate(
    reorderer: Reorderer, prompts: list[BuiltPrompt], gold: str, max_new: int
) -> Rows:
    work = reorderer.work("separate")
    answers = await work.generate(prompts, max_new_tokens=max_new)
    rows = await work.continuation_logprobs(prompts, gold)
    return list(zip(answers, rows, strict=True))


async def fused(reorderer: Reorderer, prompts: list[BuiltPrompt], gold: str, max_new: int) -> Rows:
    return await reorderer.work("fused").generate_and_score(prompts, gold, max_new_tokens=max_new)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    settings = Settings(model=args.model)
    backend = await asyncio.to_thread(TransformersBackend.from_settings, settings)
    reorderer = Reorderer(backend, settings)
    [example] = load_examples(Path(args.data), limit=args.question + 1)[args.question :]
    q = prepare(example, args.passages)
    rng = np.random.default_rng(args.seed)
    orders = [[int(i) for i in rng.permutation(len(q.passages))] for _ in range(args.orders)]
    prompts = await reorderer.work("prompts").generation_prompts(
        q.question, q.passages, orders, room=args.max_new_tokens
    )
    gold = q.answers[0]
    # Untimed warm-up of both paths on one short prompt (first-call allocations).
    short = await reorderer.work("warm").generation_prompts(q.question, q.passages[:1], [[0]])
    await separate(reorderer, short, gold, 2)
    await fused(reorderer, short, gold, 2)
    sides = {"separate": separate, "fused": fused}
    times: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, Rows] = {}
    for r in range(args.repeats):
        for name in ("separate", "fused") if r % 2 == 0 else ("fused", "separate"):
            t = time.perf_counter()
            outputs[name] = await sides[name](reorderer, prompts, gold, args.max_new_tokens)
            times[name].append(time.perf_counter() - t)
            print(f"round {r + 1} {name}: {times[name][-1]:.1f}s", flush=True)
    await backend.aclose()
    answers_differing = 0
    worst = 0.0
    for (a, row_a), (b, row_b) in zip(outputs["separate"], outputs["fused"], strict=True):
        if a is None or b is None or a.token_ids != b.token_ids:
            answers_differing += 1
        if row_a is None or row_b is None:
            raise RuntimeError("a gold answer failed to score")
        worst = max(worst, *(abs(x - y) for x, y in zip(row_a, row_b, strict=True)))
    sep, fus = statistics.median(times["separate"]), statistics.median(times["fused"])
    prompt_tokens = [len(p.token_ids) for p in prompts]
    summary = {
        "orders": len(prompts),
        "prompt_tokens": prompt_tokens,
        "gold_tokens": len(backend.tokenizer.encode(gold).ids),
        "generated_tokens": sum(len(a.token_ids) for a, _ in outputs["fused"] if a is not None),
        "separate_s": sep,
        "fused_s": fus,
        "speedup": sep / fus,
        "answers_differing": answers_differing,
        "max_gold_logprob_diff": worst,
    }
    print(
        f"{len(prompts)} orders, {sum(prompt_tokens)} prompt tokens: separate "
        f"{sep:.1f}s, fused {fus:.1f}s, speedup {summary['speedup']:.2f}x; answers differing: "
        f"{answers_differing}; largest gold log-prob difference {worst:.2e} nats"
    )
    return {
        **provenance(),
        "backend": "transformers",
        "device": backend.device,
        "dtype": settings.dtype,
        "torch_threads": args.threads,
        "model": backend.model_id,
        "batch_token_budget": backend.batch_token_budget,
        "question": example.id,
        "max_new_tokens": args.max_new_tokens,
        "summary": summary,
        "times_s": times,
    }


def main() -> int:
    ap = report.parser("fused_generation", __doc__, data=True)
    ap.add_argument("--model", default=GEMMA_MODEL)
    ap.add_argument("--question", type=int, default=0)
    ap.add_argument("--orders", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
