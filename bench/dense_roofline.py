"""How far the ``dense`` encoder (all-MiniLM-L6-v2, eager PyTorch, one thread) is from this
CPU's arithmetic limit: the floor under its CPU time per 10-passage request for any runtime
that computes the same function in float32.

The arithmetic of a request is counted from the batches the encoder really runs (its query
and 10 passages, tokenised as the service does, rows sorted by length, 8 a forward, each
padded to its longest; ``bench/dense_runtimes.py``'s ``chunked``): per token of a forward,
two FLOPs per weight of the six layers' linear maps (query, key, value, output, the two
feed-forward ones), plus attention's two n x n x d products per layer and head set. Without
the padding the same sums give what the function itself needs. The CPU time per request is
eager PyTorch's (``time.thread_time``, ``torch.set_num_threads(1)``), and the core's float32
peak is what ``torch.mm`` reaches on one thread on a large square product and on the
encoder's own largest shape (its feed-forward, a 8 x 150-token batch against 384 x 1536):
GFLOP/s achieved against peak say how much any faster float32 runtime could still gain.

Usage: python -m bench.dense_roofline [--questions 16] [--rounds 3]
           [--out results/bench/dense_roofline.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import report
from bench.dense_runtimes import CHUNK, _Pooled, chunked
from service.backends.encoders.embedding import MAX_TOKENS, EncoderConfig, MiniLMEncoder, model_dir


def forward_flops(lengths: list[int], *, padded: bool, hidden: int, ff: int, layers: int) -> float:
    """FLOPs of the encoder's forwards over rows of these token counts."""
    linear_per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * ff)
    order = sorted(lengths)
    total = 0.0
    for start in range(0, len(order), CHUNK):
        rows = order[start : start + CHUNK]
        widths = [max(rows)] * len(rows) if padded else rows
        for n in widths:
            total += linear_per_token * n + layers * 4 * n * n * hidden
    return total


def mm_gflops(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """What ``torch.mm`` reaches on one thread for an (m x k) @ (k x n) float32 product."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    calls, c0 = 0, time.thread_time()
    while time.thread_time() - c0 < seconds:
        torch.mm(a, b)
        calls += 1
    return 2 * m * k * n * calls / (time.thread_time() - c0) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.questions]]
    enc = MiniLMEncoder(model_dir(), EncoderConfig(device="cpu", cache_entries=0))
    requests = [
        enc._tok(
            [r["question"], *[f"{p['title']}: {p['text']}" for p in r["passages"][:10]]],
            truncation=True,
            max_length=MAX_TOKENS,
        )["input_ids"]
        for r in rows
    ]
    config = enc._model.config
    shape = {"hidden": config.hidden_size, "ff": config.intermediate_size,
             "layers": config.num_hidden_layers}  # fmt: skip
    lengths = [[len(ids) for ids in req] for req in requests]
    padded = float(np.mean([forward_flops(ls, padded=True, **shape) for ls in lengths]))
    needed = float(np.mean([forward_flops(ls, padded=False, **shape) for ls in lengths]))
    module = _Pooled(enc._model).eval()

    def eager(i: np.ndarray, a: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return np.asarray(module(torch.from_numpy(i), torch.from_numpy(a)).numpy())

    batch = [ids for req in requests for ids in req]  # the requests' texts as one batch
    chunked(batch, eager)  # warm
    cpu_ms: list[float] = []
    peaks: dict[str, list[float]] = {"square_1024": [], "ffn_1200x384x1536": []}
    for _ in range(args.rounds):
        c0 = time.thread_time()
        for req in requests:  # one request at a time, as the encoder batches one alone
            chunked(req, eager)
        cpu_ms.append(1000 * (time.thread_time() - c0) / len(requests))
        peaks["square_1024"].append(mm_gflops(1024, 1024, 1024))
        peaks["ffn_1200x384x1536"].append(mm_gflops(1200, 384, 1536))
        print(f"eager {cpu_ms[-1]:.0f} CPU ms a request; mm peaks "
              f"{peaks['square_1024'][-1]:.0f} / {peaks['ffn_1200x384x1536'][-1]:.0f} GFLOP/s",
              flush=True)  # fmt: skip
    best_ms = min(cpu_ms)
    peak = max(max(v) for v in peaks.values())
    return {
        **report.provenance(),
        "questions": args.questions,
        "torch": torch.__version__,
        "tokens_per_request": float(np.mean([sum(ls) for ls in lengths])),
        "gflop_per_request_as_run": padded / 1e9,
        "gflop_per_request_unpadded": needed / 1e9,
        "eager_cpu_ms_per_request": cpu_ms,
        "mm_peak_gflops": peaks,
        "eager_gflops": padded / 1e6 / best_ms,
        "eager_share_of_peak": padded / 1e6 / best_ms / peak,
        # No float32 runtime computing the same function on this core goes under these.
        "floor_cpu_ms_per_request_as_run": padded / 1e6 / peak,
        "floor_cpu_ms_per_request_unpadded": needed / 1e6 / peak,
        "load_average": os.getloadavg(),
    }


def main() -> int:
    ap = report.parser("dense_roofline", __doc__, data=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
