"""Transformers backend on the embedded SmolLM2: conversion, reload, and one long prompt's score.

Prints (and optionally writes as JSON):

- conversion: GGUF -> safetensors folder, into a fresh temporary cache (the one-time start cost);
- reload: ``TransformersBackend.load`` of the converted folder (every later start);
- score: median wall time of one ~1,400-token prompt, once with the LM head on the scored rows
  only (``head_mode=mask``, the default) and once on every row (``head_mode=full``), for a short
  span (a 32-token query/answer at the end, the service's case) and for the whole prompt.

Usage: HF_HUB_OFFLINE=1 python -m bench.transformers_backend [--skip-convert] [--repeats 5]
       [--tokens 1400] [--out results/bench/transformers_backend.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from service.backends.base import ChatMessage, SpanRequest
from service.backends.engines.transformers_backend import TransformersBackend
from service.backends.scheduling.batching import HeadMode
from service.config.settings import EMBEDDED_MODEL, Settings
from service.model_assets import resolve_model


def long_prompt(backend: TransformersBackend, tokens: int) -> tuple[int, ...]:
    """A chat prompt of about ``tokens`` tokens: numbered passages, a question, an answer."""
    tok = backend.tokenizer
    passages: list[str] = []
    while True:
        i = len(passages)
        passages.append(
            f"[{i}] The river Aster{i} rises in the northern hills, runs {i * 7 % 90 + 10} km "
            f"past the town of Belmont{i} and joins the sea near the old harbour."
        )
        text = tok.render_chat(
            [
                ChatMessage("system", "Answer the question from the passages."),
                ChatMessage("user", "\n".join(passages) + "\nWhich river passes Belmont7?"),
            ],
            add_generation_prompt=True,
        )
        ids = tok.encode(text + "The river Aster7 passes Belmont7.<|im_end|>").ids
        if len(ids) >= tokens:
            return ids


def time_modes(
    backends: dict[HeadMode, TransformersBackend], req: SpanRequest, repeats: int
) -> dict[HeadMode, list[float]]:
    """Wall times per head mode, runs interleaved so load drift on a shared machine hits all."""
    times: dict[HeadMode, list[float]] = {mode: [] for mode in backends}
    for backend in backends.values():
        asyncio.run(backend.score([req]))  # warm-up
    for _ in range(repeats):
        for mode, backend in backends.items():
            started = time.perf_counter()
            asyncio.run(backend.score([req]))
            times[mode].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transformers_backend", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--skip-convert", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    args = parser.parse_args()
    report: dict[str, object] = {
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }

    if not args.skip_convert:
        with tempfile.TemporaryDirectory() as cache:
            started = time.perf_counter()
            resolve_model(Settings(cache_dir=Path(cache)))
            report["convert_s"] = round(time.perf_counter() - started, 2)
        print(f"conversion (GGUF -> safetensors, fresh cache): {report['convert_s']:.1f} s")

    folder = resolve_model(Settings())  # the shared cache, converted on first use
    started = time.perf_counter()
    first = TransformersBackend.load(folder, model_id=EMBEDDED_MODEL, device=args.device)
    report["reload_s"] = round(time.perf_counter() - started, 2)
    print(f"reload (TransformersBackend.load, {first.device}): {report['reload_s']:.2f} s")

    ids = long_prompt(first, args.tokens)
    n = len(ids)
    spans = {"last32": (n - 32, n), "whole": (1, n)}
    backends: dict[HeadMode, TransformersBackend] = {
        "mask": first,
        "full": TransformersBackend.load(folder, device=args.device, head_mode="full"),
    }
    timings: dict[str, dict[str, dict[str, float]]] = {}
    for span_name, (start, end) in spans.items():
        runs = time_modes(backends, SpanRequest("bench", ids, start, end), args.repeats)
        timings[span_name] = {
            mode: {"median_s": statistics.median(t), "min_s": min(t)} for mode, t in runs.items()
        }
        rows, full = timings[span_name]["mask"], timings[span_name]["full"]
        print(
            f"score {n} tokens, span {span_name} ({end - start} tokens), median (min) of "
            f"{args.repeats}: head on scored rows {rows['median_s'] * 1e3:.0f} "
            f"({rows['min_s'] * 1e3:.0f}) ms, on all rows {full['median_s'] * 1e3:.0f} "
            f"({full['min_s'] * 1e3:.0f}) ms, ratio {full['median_s'] / rows['median_s']:.2f}x"
        )
    report["prompt_tokens"] = n
    report["score_s"] = timings
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
