"""Peak memory of each phase of the evaluation's work on one model, the question a lent GPU's
pool left open (scripts/device/README.md: one Gemma-3-270m process held 41-65 GiB of an H100,
cause unknown, and later chunks died of CUDA out of memory).

Phases, each after the peak counter is reset:

- ``load``: the backend (weights, the head probe's forwards);
- ``score``: ``--questions`` MoI requests at once (the default design, ``--passages`` each),
  their prompts packed into shared forwards under the batch token budget, as the evaluation's
  scoring is;
- ``generate``: ``--orders`` generator prompts of one question with its gold answer
  teacher-forced after each (``Work.generate_and_score``), the evaluation's generator step.

On CUDA it reports ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` per phase
(the gap between them is the caching allocator's slack, what nvidia-smi adds up across
processes). Elsewhere it reports the process's peak RSS, which never goes down: each phase
shows the peak so far, so only increases are the phase's own.

Usage: python -m bench.memory_phases [--model google/gemma-3-270m] [--questions 4]
       [--orders 16] [--passages 10] [--max-new-tokens 32] [--out results/bench/memory_phases.json]
Other settings come from the environment (``RAG_REORDER_DEVICE``, ``RAG_REORDER_DTYPE``,
``RAG_REORDER_BATCH_TOKEN_BUDGET``, ...).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import resource
import time
from collections.abc import Awaitable, Callable
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
from service.strategies.request import ReorderRequest

GIB = float(1 << 30)


async def phase(name: str, cuda: bool, body: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """Runs ``body`` and returns its seconds and peak memory in GiB."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    await body()
    row: dict[str, Any] = {"phase": name, "seconds": round(time.perf_counter() - t, 2)}
    if cuda:
        torch.cuda.synchronize()
        row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        row["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    else:
        # ru_maxrss is in KiB on Linux.
        row["peak_rss_gib"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 3
        )
    print(row, flush=True)
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings(model=args.model)
    cuda = torch.cuda.is_available() and settings.device in ("auto", "cuda")
    examples = load_examples(Path(args.data), limit=args.questions)
    questions = [prepare(e, args.passages) for e in examples]
    holder: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []

    async def load() -> None:
        holder["backend"] = await asyncio.to_thread(TransformersBackend.from_settings, settings)

    rows.append(await phase("load", cuda, load))
    backend: TransformersBackend = holder["backend"]
    reorderer = Reorderer(backend, settings)

    async def score() -> None:
        reqs = [
            ReorderRequest(query=q.question, passages=q.passages, request_id=f"moi-{k}")
            for k, q in enumerate(questions)
        ]
        await asyncio.gather(*(reorderer.reorder(r) for r in reqs))

    rows.append(await phase("score", cuda, score))
    q = questions[0]
    rng = np.random.default_rng(0)
    orders = [[int(i) for i in rng.permutation(len(q.passages))] for _ in range(args.orders)]
    work = reorderer.work("generate")
    prompts = await work.generation_prompts(
        q.question, q.passages, orders, room=args.max_new_tokens
    )

    async def generate() -> None:
        await work.generate_and_score(prompts, q.answers[0], max_new_tokens=args.max_new_tokens)

    rows.append(await phase("generate", cuda, generate))
    await backend.aclose()
    return {
        **provenance(),
        "device": backend.device,
        "cuda": torch.cuda.get_device_name() if cuda else None,
        "dtype": settings.dtype,
        "model": backend.model_id,
        "head_mode": backend.head_mode,
        "batch_token_budget": backend.batch_token_budget,
        "questions": len(questions),
        "passages": args.passages,
        "orders": len(prompts),
        "generation_prompt_tokens": sum(len(p.token_ids) for p in prompts),
        "max_new_tokens": args.max_new_tokens,
        "phases": rows,
    }


def main() -> int:
    ap = report.parser("memory_phases", __doc__, data=True)
    ap.add_argument("--model", default=GEMMA_MODEL)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--orders", type=int, default=16)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
