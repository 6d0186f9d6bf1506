"""What tracing costs a request: CPU and wall time per MoI request with tracing off and on,
side by side in one run (docs/tracing.md, "Cost").

The app in process on the fake backend (the in-process ASGI client, as the route tests), the
fit in the request's process (``solver_processes`` 0) so the process's CPU time is all of a
request's work; each round runs ``--requests`` requests with tracing off, then the same with
tracing on, exporting over OTLP/HTTP to a receiver in another process (it decodes nothing and
answers 200; its CPU is not counted). Rounds alternate so drift on a shared machine hits both.
CPU is the process's (``time.process_time``: every thread, the exporter's included) divided by
the requests.

Usage: python -m bench.tracing_cost [--rounds 3] [--requests 200] [--passages 10]
           [--out results/bench/tracing_cost.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from app.main import create_app
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.runtime import tracing

RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


async def _run(tmp: Path, n: int, passages: int, endpoint: str | None) -> dict[str, float]:
    truth = {
        f"Passage {i} says something about topic {i % 3}.": float(i % 5) for i in range(passages)
    }
    settings = Settings(
        cache_dir=tmp,
        canary_interval_s=0,
        rate_canary=False,
        solver_processes=0,
        otel_endpoint=endpoint,
    )
    app = create_app(settings, backend=FakeBackend(truth))
    counted = _SpanCounter()
    if tracing._process.provider is not None:  # the bench's look inside: spans per request
        tracing._process.provider.add_span_processor(counted)
    transport = httpx.ASGITransport(app=app)
    body = {"query": "which passage?", "passages": list(truth), "strategy": "moi"}
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
    ):
        while (await client.get("/ready")).status_code != 200:
            await asyncio.sleep(0.01)
        for _ in range(20):  # warm-up: imports, caches
            (await client.post("/v1/reorder", json=body, headers=headers)).raise_for_status()
        counted.spans = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            (await client.post("/v1/reorder", json=body, headers=headers)).raise_for_status()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        assert tracing.enabled() == (endpoint is not None)
    # The lifespan's end flushed and shut tracing down: its export is inside `cpu` only up to
    # the last batch, which is at most the schedule delay's worth; count the flush too.
    cpu = time.process_time() - cpu0
    return {
        "cpu_ms_per_request": 1e3 * cpu / n,
        "wall_ms_per_request": 1e3 * wall / n,
        "spans_per_request": counted.spans / n,
    }


class _SpanCounter(SpanProcessor):
    def __init__(self) -> None:
        self.spans = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.spans += 1


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tracing_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("results/bench/tracing_cost.json"))
    args = parser.parse_args()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        endpoint = f"http://127.0.0.1:{int(receiver.stdout.readline())}"
        rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for mode in ("off", "on"):
                    row = asyncio.run(
                        _run(
                            Path(tmp) / f"{mode}{r}",
                            args.requests,
                            args.passages,
                            endpoint if mode == "on" else None,
                        )
                    )
                    rows[mode].append(row)
                    print(mode, r, json.dumps(row), flush=True)
    finally:
        receiver.terminate()
        receiver.wait()
    summary: dict[str, Any] = {
        mode: {
            key: statistics.median(row[key] for row in rows[mode])
            for key in ("cpu_ms_per_request", "wall_ms_per_request")
        }
        for mode in rows
    }
    summary["extra_cpu_ms_per_request"] = (
        summary["on"]["cpu_ms_per_request"] - summary["off"]["cpu_ms_per_request"]
    )
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "passages": args.passages,
        "requests_per_round": args.requests,
        "rounds": rows,
        "median": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
