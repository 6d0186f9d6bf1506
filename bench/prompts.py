"""Prompt building: one batched tokenizer call for a request's prompts against one per prompt.

Every MoI request renders and tokenises one prompt per permutation before any scoring, and on a
GPU that work is a visible share of the request (``bench/scoring.py`` on the H100: 0.38 s of
tokenising in 1.53 s). ``build_prompts`` renders all prompts, then encodes them in one
``encode_batch`` call, which a fast (Rust) tokenizer runs on every core. This benchmark builds
the same prompts both ways, alternating which goes first, and checks the outputs are equal.

Prompts: the scoring prompts of the ``--design`` design (default ``random``, 3N prompts of N
passages) for the first ``--queries`` NQ-Open dev questions with ``--passages`` passages each,
with the embedded SmolLM2 tokenizer (no model is loaded).

Usage: python -m bench.prompts [--queries 8] [--passages 10] [--design random] [--repeats 5]
       [--out results/bench/prompts.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import solver
from bench import report
from bench.report import provenance, write
from service.backends.base import Encoding, PromptTokenizer
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.model_assets import resolve_model
from service.prompting.prompts import BuiltPrompt, build_prompts


class OneByOne:
    """The same tokenizer with ``encode_batch`` as one ``encode`` call per text (the old path)."""

    def __init__(self, inner: HFPromptTokenizer) -> None:
        self._inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self.render_chat = inner.render_chat
        self.encode = inner.encode
        self.decode = inner.decode

    def encode_batch(self, texts: list[str]) -> list[Encoding]:
        return [self._inner.encode(t) for t in texts]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    settings = Settings()
    folder = resolve_model(settings)
    batched = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    sides: dict[str, PromptTokenizer] = {"batched": batched, "one_by_one": OneByOne(batched)}
    examples = load_examples(Path(args.data), limit=args.queries)
    jobs = []
    for k, ex in enumerate(examples):
        passages = ex.passages[: args.passages]
        perms = solver.plan(args.design, len(passages), seed=k)
        orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
        jobs.append((ex.question, passages, orders))

    def build(tok: PromptTokenizer) -> list[list[BuiltPrompt]]:
        return [build_prompts(tok, settings.chat_template, q, p, o) for q, p, o in jobs]

    for tok in sides.values():  # untimed warm-up (template compilation, allocator)
        build(tok)
    times: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[list[BuiltPrompt]]] = {}
    for r in range(args.repeats):
        for name in sides if r % 2 == 0 else reversed(list(sides)):
            t = time.perf_counter()
            outputs[name] = build(sides[name])
            times[name].append(time.perf_counter() - t)
    equal = outputs["batched"] == outputs["one_by_one"]
    prompts = sum(len(o) for _, _, o in jobs)
    tokens = sum(len(p.token_ids) for req in outputs["batched"] for p in req)
    fast, slow = statistics.median(times["batched"]), statistics.median(times["one_by_one"])
    summary = {
        "requests": len(jobs),
        "prompts": prompts,
        "tokens": tokens,
        "batched_s": fast,
        "one_by_one_s": slow,
        "speedup": slow / fast,
        "tokens_per_s_batched": tokens / fast,
        "tokens_per_s_one_by_one": tokens / slow,
        "identical": equal,
    }
    print(
        f"{len(jobs)} requests, {prompts} prompts, {tokens} tokens: batched {fast:.3f}s, one by "
        f"one {slow:.3f}s, speedup {slow / fast:.2f}x; identical prompts: {equal}"
    )
    return {
        **provenance(),
        "tokenizer": str(settings.model),
        "summary": summary,
        "times_s": times,
    }


def main() -> int:
    ap = report.parser("prompts", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--design", default="random")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = run(args)
    write(out, args.out)
    return 0 if out["summary"]["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
