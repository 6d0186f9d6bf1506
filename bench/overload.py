"""Overload mode of bench/load.py (issue 44): open-loop arrivals above the engine's capacity,
the default deadline and admission, this code against a baseline, side by side in one run.

``python -m bench.load --overload 1.5,3 --baseline-root <checkout of the old code>``

1. Capacity: the offline ceiling of ``bench/load.py`` (the requests' prompts through the backend
   alone, prompt tokens/s) divided by the prompt tokens of one request (as the server reports
   them) is the engine's capacity in requests/s.
2. For each multiplier and each server (the baseline first, then this code; a fresh server
   process each time, warmed by one request, with the shipped defaults: ``request_timeout_s``
   120 s, admission as configured out of the box), requests arrive as a Poisson process at
   multiplier x capacity for ``--duration`` seconds, from a fixed seed (the same arrival times
   for both servers), each sent when due whatever the others are doing.
3. Per run: goodput (200s per second, over the arrival window plus the time until the last
   answer), its ratio to the capacity, the share of 200/503/504, p50/p99 latency of the 200s,
   the slowest 503 and whether any admitted request got a 504.

Targets at 3x (issue 44): goodput >= 0.8x capacity, no 504, every 503 in under 1 s.
Results are written after every run (``--out``, ``.md`` beside it); ``--resume`` keeps the runs
already there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.server_process import free_port, percentile, start_server

# The shipped defaults, but for what the bench cannot use: canaries would add work at random
# moments, access logs cost CPU, sampling writes nothing we read.
OVERLOAD_ENV = {
    "RAG_REORDER_BACKEND": "transformers",
    "RAG_REORDER_DEVICE": "cpu",
    "RAG_REORDER_CANARY_INTERVAL_S": "0",
    "RAG_REORDER_ACCESS_LOG": "false",
    "RAG_REORDER_TRAFFIC_SAMPLE_RATE": "0",
}


async def open_loop(
    port: int, bodies: list[dict[str, Any]], arrivals: list[float]
) -> list[dict[str, Any]]:
    """Send ``bodies`` in turn at the ``arrivals`` offsets (seconds), each on its own task."""
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=900, limits=limits
    ) as client:
        t0 = time.perf_counter()

        async def one(k: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter()
            try:
                r = await client.post("/v1/reorder", json=bodies[k % len(bodies)])
                status = r.status_code
                retry = r.headers.get("Retry-After")
            except httpx.HTTPError as exc:
                status, retry = type(exc).__name__, None
            done = time.perf_counter()
            records.append(
                {
                    "k": k,
                    "sent_s": sent - t0,
                    "done_s": done - t0,
                    "latency_s": done - sent,
                    "status": status,
                    "retry_after": retry,
                }
            )

        await asyncio.gather(*(one(k, at) for k, at in enumerate(arrivals)))
    return sorted(records, key=lambda r: r["k"])


def summarise(records: list[dict[str, Any]], duration: float, capacity: float) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200]
    shed = [r for r in records if r["status"] == 503]
    late = [r for r in records if r["status"] == 504]
    span = max([duration, *(r["done_s"] for r in records)])
    n = len(records)
    goodput = len(ok) / span
    return {
        "requests": n,
        "span_s": span,
        "ok": len(ok),
        "shed_503": len(shed),
        "late_504": len(late),
        "other": n - len(ok) - len(shed) - len(late),
        "share_200": len(ok) / n,
        "share_503": len(shed) / n,
        "share_504": len(late) / n,
        "goodput_rps": goodput,
        "goodput_x_capacity": goodput / capacity,
        "p50_ok_s": percentile([r["latency_s"] for r in ok], 50) if ok else math.nan,
        "p99_ok_s": percentile([r["latency_s"] for r in ok], 99) if ok else math.nan,
        "max_503_s": max((r["latency_s"] for r in shed), default=math.nan),
        "p50_504_s": percentile([r["latency_s"] for r in late], 50) if late else math.nan,
    }


def markdown(result: dict[str, Any]) -> str:
    cap = result["capacity"]
    lines = [
        "# Overload benchmark (bench/load.py --overload)",
        "",
        f"`{result['command']}` on {result['machine']['platform']}, "
        f"{result['machine']['cpus']} CPUs.",
        "",
        f"Engine capacity: {cap['requests_per_s']:.4f} requests/s "
        f"({cap['ceiling_prompt_tokens_per_s']:.0f} prompt tokens/s offline ceiling / "
        f"{cap['prompt_tokens_per_request']:.0f} prompt tokens per request). "
        f"Open-loop Poisson arrivals for {result['duration_s']:.0f} s at each multiple of it, "
        "the shipped deadline (120 s) and admission, a fresh server each run.",
        "",
        "| load | server | requests | 200 | 503 | 504 | goodput req/s | x capacity "
        "| p50 ok s | p99 ok s | slowest 503 s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(
            f"| {run['multiplier']:g}x | {run['server']} | {s['requests']} | "
            f"{s['share_200']:.0%} | {s['share_503']:.0%} | {s['share_504']:.0%} | "
            f"{s['goodput_rps']:.4f} | {s['goodput_x_capacity']:.2f} | {s['p50_ok_s']:.1f} | "
            f"{s['p99_ok_s']:.1f} | {s['max_503_s']:.2f} |"
        )
    lines += ["", "Targets: " + json.dumps(result["targets"]), ""]
    return "\n".join(lines)


def targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in runs:
        if run["server"] != "this" or run["multiplier"] < 3:
            continue
        s = run["summary"]
        out[f"goodput_x_capacity_at_{run['multiplier']:g}x"] = s["goodput_x_capacity"]
        out["goodput_target_met"] = s["goodput_x_capacity"] >= 0.8
        out["no_504_met"] = s["late_504"] == 0
        out["shed_under_1s_met"] = not s["shed_503"] or s["max_503_s"] < 1.0
    return out


async def run_overload(args: argparse.Namespace) -> None:
    # Imported here: they need the backend stack, which the parser and report do not.
    from bench.workload import capture_prompts, ceiling, load_requests
    from service.backends.factory import create_backend
    from service.config.settings import Settings

    out = Path(args.out)
    multipliers = [float(x) for x in args.overload.split(",")]
    servers = [("baseline", Path(args.baseline_root).resolve())] if args.baseline_root else []
    servers.append(("this", Path(args.server_root).resolve()))
    bodies = load_requests(Path(args.data), args.queries, args.passages)
    old: dict[str, Any] = json.loads(out.read_text()) if args.resume and out.exists() else {}
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.load", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "duration_s": args.duration,
        "seed": args.seed,
        "servers": {name: str(root) for name, root in servers},
        "requests": {"queries": args.queries, "passages": args.passages, "route": "/v1/reorder"},
        "capacity": old.get("capacity"),
        "runs": list(old.get("runs", [])),
    }
    if result["capacity"] is None:
        os.environ.update(
            {k: v for k, v in OVERLOAD_ENV.items() if k.endswith(("BACKEND", "DEVICE"))}
        )
        backend = await asyncio.to_thread(create_backend, Settings())
        prompts = await capture_prompts(backend, bodies)
        top = await ceiling(backend, prompts, 1)
        await backend.aclose()
        per_request = top["prompt_tokens"] / len(bodies)
        result["capacity"] = {
            "ceiling_prompt_tokens_per_s": top["prompt_tokens_per_s"],
            "prompt_tokens_per_request": per_request,
            "requests_per_s": top["prompt_tokens_per_s"] / per_request,
        }
    capacity = result["capacity"]["requests_per_s"]
    for mult in multipliers:
        rng = random.Random(args.seed)
        arrivals: list[float] = []
        t = rng.expovariate(mult * capacity)
        while t < args.duration:
            arrivals.append(t)
            t += rng.expovariate(mult * capacity)
        for name, root in servers:
            if any(r["server"] == name and r["multiplier"] == mult for r in result["runs"]):
                continue  # measured by the run this one resumes
            port = free_port()
            log = Path(f"/tmp/rag-reorder-overload-{name}.log")
            proc = start_server(root, port, OVERLOAD_ENV, log, ready_s=600)
            try:
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=900
                ) as client:
                    (await client.post("/v1/reorder", json=bodies[0])).raise_for_status()
                print(f"{mult:g}x capacity, {name}: {len(arrivals)} arrivals", flush=True)
                records = await open_loop(port, bodies, arrivals)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(180)
            summary = summarise(records, args.duration, capacity)
            print(json.dumps(summary), flush=True)
            result["runs"].append(
                {"multiplier": mult, "server": name, "summary": summary, "records": records}
            )
            result["targets"] = targets(result["runs"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
            out.with_suffix(".md").write_text(markdown(result))
    result["targets"] = targets(result["runs"])
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(json.dumps(result["targets"], indent=2))
    print(f"wrote {out} (+ .md)")
