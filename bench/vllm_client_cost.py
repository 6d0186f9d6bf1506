"""The CPU that the vLLM backends spend *outside* vLLM's engine on each prompt they score:
in process, what one engine process in front of several workers (``RAG_REORDER_WORKERS``
with ``RAG_REORDER_BACKEND=vllm``) does serially for all of them; remote, what the service's
own client of a vLLM server spends, to set beside it.

``in_process``: with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default on a GPU)
``AsyncLLM`` runs the engine core (scheduler and model) in a child process; the calling
process keeps the client: sending each prompt's request over ZMQ, the output handler that
turns the core's outputs into ``RequestOutput`` objects (the prompt log-prob rows included),
and this backend's reading of the span's log-probs. ``remote``: ``RemoteBackend`` against
vLLM's OpenAI server (``bench/remote.py``'s, on the same model, eager) in another process:
building the JSON bodies, HTTP, decoding the answers' prompt log-probs. Either way this
process's own CPU seconds (every thread's, from ``/proc/self/task/*/schedstat``) over a
``score`` call do not depend on the forward's speed; fitted over calls of two prompt lengths
as a cost per prompt plus one per token, they give the CPU of a 10-passage MoI request (20
prompts, about 15,000 tokens) and its inverse, the requests/s one such process can take in,
the figure to set against an engine's ceiling (about 20 requests/s, 300,000 prompt tokens/s,
for SmolLM2 on an H100, docs/benchmarks.md). The socket hop's pickling (requests and results,
as ``service.backends.engines.engine_socket`` sends them) is timed beside it.

    .venv-vllm/bin/python -m bench.vllm_client_cost --out results/bench/vllm_client_cost.json
        # ~12 min on 2 cores: the forwards run on the CPU at about 350 prompt tokens/s here
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The engine core in a process of its own, as on a GPU: this process's CPU is the client's.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

import argparse
import asyncio
import json
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import report
from bench.remote import load_in_process_vllm, start_vllm_server
from bench.server_process import free_port, thread_cpu_s
from service.backends.base import SpanLogprobs, SpanRequest
from service.config.settings import Settings
from service.model_assets import resolve_model


def _calls(prompts: int, length: int, repeats: int, vocab: int) -> list[list[SpanRequest]]:
    calls = []
    for rep in range(repeats):
        # Distinct prompts each call: a prefix-cache hit would skip the work this counts.
        base = 100 + 7919 * rep
        calls.append(
            [
                SpanRequest(
                    request_id=f"c{rep}-{length}-{i}",
                    token_ids=tuple(
                        (base + i * 131 + j * 17) % (vocab - 10) + 10 for j in range(length)
                    ),
                    span_start=length - 16,
                    span_end=length,
                )
                for i in range(prompts)
            ]
        )
    return calls


async def _remote(port: int) -> Any:
    from service.backends.engines.remote_backend import RemoteBackend

    remote = RemoteBackend.from_settings(
        Settings(
            backend="remote",
            engine_url=f"http://127.0.0.1:{port}",
            engine_max_concurrency=64,
            engine_timeout_s=900,  # a 15,000-token call here takes about 45 s
        )
    )
    await remote.connect()
    return remote


async def _measure(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    vocab = len(backend.tokenizer.hf_tokenizer)
    me = psutil.Process()
    rows: list[dict[str, Any]] = []
    await backend.score(_calls(2, 32, 1, vocab)[0])  # warm
    for length in [int(x) for x in args.tokens.split(",")]:
        for call in _calls(args.prompts, length, args.repeats, vocab):
            before = thread_cpu_s([me])
            t = time.perf_counter()
            results = await backend.score(call)
            wall = time.perf_counter() - t
            used = thread_cpu_s([me]) - before
            assert all(isinstance(r, SpanLogprobs) for r in results), results
            t = time.perf_counter()
            for _ in range(5):
                pickle.loads(pickle.dumps((1, "score", (call, False)), pickle.HIGHEST_PROTOCOL))
                pickle.loads(pickle.dumps((1, True, results), pickle.HIGHEST_PROTOCOL))
            hop = (time.perf_counter() - t) / 5
            tokens = length * len(call)
            rows.append(
                {
                    "prompts": len(call),
                    "prompt_tokens": tokens,
                    "client_cpu_s": used,
                    "client_cpu_us_per_token": 1e6 * used / tokens,
                    "socket_pickle_us_per_token": 1e6 * hop / tokens,
                    "wall_s": wall,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    # CPU = per_prompt * prompts + per_token * tokens, by least squares over the calls (every
    # call has the same prompts, so the lengths separate the two).
    design = np.array([[r["prompts"], r["prompt_tokens"]] for r in rows], dtype=float)
    cpu = np.array([r["client_cpu_s"] for r in rows])
    (per_prompt, per_token), *_ = np.linalg.lstsq(design, cpu, rcond=None)
    hop = sum(r["socket_pickle_us_per_token"] for r in rows) / len(rows)
    # A 10-passage MoI request: 20 prompts, about 15,000 prompt tokens (bench/load.py's).
    moi_ms = 1e3 * (20 * per_prompt + 15_000 * per_token) + 15_000 * hop / 1e3
    return {
        "rows": rows,
        "summary": {
            "client_cpu_ms_per_prompt": 1e3 * per_prompt,
            "client_cpu_us_per_token": 1e6 * per_token,
            "socket_pickle_us_per_token": hop,
            "moi_request_client_cpu_ms": moi_ms,
            # One process busy only on this serves at most this many such requests/s.
            "one_process_max_moi_requests_per_s": 1e3 / moi_ms,
        },
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {**report.provenance(), "args": vars(args)}
    for engine in args.engines.split(","):
        server = None
        if engine == "in_process":
            backend = await asyncio.to_thread(
                load_in_process_vllm, resolve_model(Settings()), 1 << 30
            )
        elif engine == "remote":
            port = free_port()
            log = Path(tempfile.mkdtemp()) / "vllm-serve.log"
            server = start_vllm_server(resolve_model(Settings()), port, log, kv_bytes=1 << 30)
            backend = await _remote(port)
        else:
            raise SystemExit(f"--engines: unknown {engine!r} (in_process, remote)")
        try:
            out[engine] = await _measure(backend, args)
        finally:
            await backend.aclose()
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
        print(engine, json.dumps(out[engine]["summary"]), flush=True)
    return out


def main() -> int:
    ap = report.parser("vllm_client_cost", __doc__)
    ap.add_argument("--prompts", type=int, default=20, help="prompts per call (one MoI request's)")
    ap.add_argument("--tokens", default="128,750", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="calls per length")
    ap.add_argument(
        "--engines", default="in_process,remote", help="in_process, remote, comma-separated"
    )
    return report.main(ap, _run)


if __name__ == "__main__":
    raise SystemExit(main())
