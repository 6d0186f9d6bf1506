"""Service benchmark: the HTTP server against the same work called in-process, in one run.

1. Ratio, same engine: one backend (SmolLM2 on CPU by default) is loaded in this process;
   the full app (``create_app``: middleware, admission, deadline, JSON) serves it under
   uvicorn on a loopback socket, and the same ``/v1/reorder`` request (4 passages,
   pruned_random, 8 prompts) is run alternately through ``Reorderer.reorder`` and over HTTP,
   so drift in machine load hits both sides alike. Headline: the median over pairs of
   ``in-process / HTTP`` (target >= 0.95); the ratios of the medians and of the minimums
   too. One engine for both sides, because two copies of the model in two processes do not
   run at the same speed on a shared machine, which would be measured instead of the
   service layer.
2. The deployed shape: ``python -m entrypoints serve`` in its own process. At each concurrency
   level, ``--per-level`` requests from that many concurrent clients: p50/p90/p99 latency,
   throughput, errors; at concurrency 1 also client latency minus the server-reported
   pipeline time (HTTP, JSON, routing). The transformers backend runs one forward at a time,
   so latency grows with concurrency while throughput stays flat. Then SIGTERM, exit code.

Usage: python -m bench.http_overhead [--pairs 12] [--levels 1,2,4] [--per-level 8]
                               [--out results/bench/http_overhead.json]
"""

from __future__ import annotations

import os

# The rag-reorder CLI runs the solver with one BLAS thread; match it here (torch keeps its
# default intra-op threads on both sides).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import json
import platform
import shlex
import signal
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]

from app.main import create_app
from bench.server_process import free_port, percentile, start_server
from service.backends.factory import create_backend
from service.config.settings import Settings
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest

QUERY = "What is the capital of France?"
PASSAGES = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and largest city of France.",
    "The Loire is the longest river in France.",
    "Madrid is the capital of Spain.",
]
DESIGN = {"kind": "pruned_random", "num_prompts": 8, "seed": 1}


async def load_level(
    send: Callable[[], Awaitable[float]], concurrency: int, requests: int
) -> dict[str, Any]:
    """``requests`` calls of ``send`` from ``concurrency`` concurrent clients."""
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def client() -> None:
        nonlocal errors, remaining
        while remaining > 0:
            remaining -= 1
            try:
                latencies.append(await send())
            except httpx.HTTPError:
                errors += 1

    t = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t
    return {
        "concurrency": concurrency,
        "requests": requests,
        "errors": errors,
        "p50_s": percentile(latencies, 50),
        "p90_s": percentile(latencies, 90),
        "p99_s": percentile(latencies, 99),
        "throughput_rps": len(latencies) / wall,
    }


class Client:
    """POSTs the benchmark request; records client latency and the server's pipeline time."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.server_total_s: list[float] = []
        self.overhead_s: list[float] = []
        """Per request: client latency minus the server's pipeline time (HTTP, JSON, routing)."""

    async def once(self) -> float:
        body = {"query": QUERY, "passages": PASSAGES, "design": DESIGN}
        t = time.perf_counter()
        r = await self.client.post("/v1/reorder", json=body)
        r.raise_for_status()
        elapsed = time.perf_counter() - t
        server_s = r.json()["timing"]["total_s"]
        self.server_total_s.append(server_s)
        self.overhead_s.append(elapsed - server_s)
        return elapsed


async def ratio_same_engine(settings: Settings, pairs: int) -> dict[str, Any]:
    """In-process ``Reorderer`` vs the full app over loopback HTTP, one engine, alternated.

    The app (middleware, admission, deadline, JSON) runs under uvicorn in this process on the
    very backend the in-process calls use, so the only difference is the HTTP service layer.
    """
    backend = await asyncio.to_thread(create_backend, settings)
    reorderer = Reorderer(backend, settings)
    request = ReorderRequest(
        QUERY,
        [Passage(text=p) for p in PASSAGES],
        design=DesignSpec(kind="pruned_random", num_prompts=8, seed=1),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, backend=backend), log_level="warning")
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as hc:
            while True:
                try:
                    if (await hc.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            client = Client(hc)

            async def local_once() -> float:
                t = time.perf_counter()
                await reorderer.reorder(request)
                return time.perf_counter() - t

            await client.once()
            await local_once()
            client.server_total_s.clear()
            local, over_http = [], []
            for i in range(pairs):
                # Alternate which goes first, so neither side always follows the other.
                if i % 2 == 0:
                    local.append(await local_once())
                    over_http.append(await client.once())
                else:
                    over_http.append(await client.once())
                    local.append(await local_once())
    finally:
        server.should_exit = True
        await serving  # the app's lifespan closes the backend
    med_local, med_http = statistics.median(local), statistics.median(over_http)
    return {
        "pairs": pairs,
        "in_process_median_s": med_local,
        "http_median_s": med_http,
        # Headline: the median of each pair's ratio. Adjacent runs share the machine's state,
        # so a burst of load from elsewhere cancels out instead of landing on one side.
        "ratio_in_process_over_http": statistics.median(
            a / b for a, b in zip(local, over_http, strict=True)
        ),
        "ratio_of_medians": med_local / med_http,
        "ratio_of_minimums": min(local) / min(over_http),
        "http_overhead_ms": (med_http - med_local) * 1000,
        "in_process_s": local,
        "http_s": over_http,
    }


async def separate_process(env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """The deployed shape: ``python -m entrypoints serve`` in its own process, loaded
    concurrently."""
    port = free_port()
    log = Path(args.server_log)
    t0 = time.perf_counter()
    proc = start_server(ROOT, port, env, log, ready_s=300)
    startup_s = time.perf_counter() - t0
    print(f"separate server ready in {startup_s:.1f} s (log: {log})")
    levels = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as hc:
            client = Client(hc)
            await client.once()
            for c in (int(x) for x in args.levels.split(",")):
                client.server_total_s.clear()
                client.overhead_s.clear()
                row = await load_level(client.once, c, args.per_level)
                if c == 1:
                    row["server_pipeline_median_s"] = statistics.median(client.server_total_s)
                    row["http_and_json_median_ms"] = statistics.median(client.overhead_s) * 1000
                levels.append(row)
                print(
                    f"concurrency {c}: {row['requests']} requests, {row['errors']} errors, "
                    f"p50 {row['p50_s']:.2f} s, p90 {row['p90_s']:.2f} s, "
                    f"p99 {row['p99_s']:.2f} s, {row['throughput_rps']:.2f} req/s"
                )
            info = (await hc.get("/info")).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    print(f"separate server exit code after SIGTERM: {exit_code}")
    return {
        "startup_s": startup_s,
        "model": info["model"],
        "backend": info["backend"],
        "concurrency": levels,
        "exit_code_after_sigterm": exit_code,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "RAG_REORDER_BACKEND": args.backend,
        "RAG_REORDER_DEVICE": args.device,
        "RAG_REORDER_CANARY_INTERVAL_S": "0",
        "RAG_REORDER_ACCESS_LOG": "false",
    }
    os.environ.update(env)
    load_before = os.getloadavg()
    ratio = await ratio_same_engine(Settings(), args.pairs)
    print(
        f"ratio in-process / HTTP, same engine, median of {args.pairs} pair ratios: "
        f"{ratio['ratio_in_process_over_http']:.3f} (ratio of medians "
        f"{ratio['ratio_of_medians']:.3f}, of minimums {ratio['ratio_of_minimums']:.3f}; "
        f"medians {ratio['in_process_median_s'] * 1000:.0f} ms vs "
        f"{ratio['http_median_s'] * 1000:.0f} ms)"
    )
    separate = await separate_process(env, args)
    return {
        "command": shlex.join([".venv/bin/python", "-m", "bench.http_overhead", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": version("torch"),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "request": {"passages": len(PASSAGES), "design": DESIGN, "route": "/v1/reorder"},
        "ratio": ratio,
        "separate_process": separate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.http_overhead", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--per-level", type=int, default=8)
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "http_overhead.json"))
    ap.add_argument("--server-log", default="/tmp/rag-reorder-bench-server.log")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
