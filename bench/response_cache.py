"""The response cache on a stream with re-fires: the same request stream through the app with
the cache off and on, in one run, in process (issue 94, item 3; docs/cache.md).

The stream: ``--requests`` ``POST /v1/rerank`` calls (``reorder.strategy: moi``, the path
that calls the model), each a re-fire of an earlier request (uniform among those sent so far)
with probability ``--refire``, else a new question over ``--passages`` passages. The same
stream (one seed) goes through both cases, ``--concurrency`` closed-loop clients over the
ASGI transport (no sockets), on the ``paced`` backend (no model: each forward takes the time
the measured GPU engine took, and no CPU), MoI's fits in process (``solver_processes=0``),
so the CPU counted is the service's own, all of it in this process.

Per case: the hit rate (``X-Cache: hit``), model calls made, p50/p99 latency, wall time, and
the process's CPU ms per request (user + system over the case, divided by the requests; the
clients share the process, so it is an upper bound of the server's). A re-fire that arrives
while its original is still in flight is a miss (no coalescing of in-flight requests).

Usage: python -m bench.response_cache [--requests 1000] [--refire 0.37] [--concurrency 8]
           [--passages 10] [--seed 0] [--out results/bench/response_cache.json]
Writes the JSON and a markdown table beside it (.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]

from app.main import create_app
from service.config.settings import Settings

WORDS = [
    "river", "town", "bridge", "harbour", "castle", "market", "valley", "forest", "mill",
    "church", "school", "road", "station", "tower", "garden", "lake", "island", "field", "hill",
    "coast",
]  # fmt: skip


def stream(n: int, refire: float, passages: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    sent: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for k in range(n):
        if sent and rng.random() < refire:
            out.append(rng.choice(sent))
            continue
        docs = [
            f"Passage {j} of question {k}: the {rng.choice(WORDS)} near the "
            f"{rng.choice(WORDS)} and the {rng.choice(WORDS)}."
            for j in range(passages)
        ]
        body = {
            "query": f"question {k}: where is the {rng.choice(WORDS)}?",
            "documents": docs,
            "reorder": {"strategy": "moi"},
        }
        sent.append(body)
        out.append(body)
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_case(
    name: str, bodies: list[dict[str, Any]], concurrency: int, **over: Any
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            bias_profile_dir=Path(tmp), backend="paced", canary_interval_s=0, rate_canary=False,
            request_timeout_s=120, solver_processes=0, **over,
        )  # fmt: skip
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=120) as c,
        ):
            while (await c.get("/ready")).status_code != 200:
                await anyio.sleep(0.05)
            await c.post("/v1/rerank", json={**bodies[0], "query": "warm-up?"})
            latencies: list[float] = []
            hits = errors = 0
            backend = app.state.ctx.engine.backend
            queue = iter(bodies)

            async def client() -> None:
                nonlocal hits, errors
                for body in queue:
                    t = time.perf_counter()
                    r = await c.post("/v1/rerank", json=body)
                    latencies.append(time.perf_counter() - t)
                    errors += r.status_code != 200
                    hits += r.headers.get("X-Cache") == "hit"

            cpu0, t0 = time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(client)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            n = len(bodies)
            return {
                "case": name,
                "requests": n,
                "errors": errors,
                "hit_rate": hits / n,
                "wall_s": wall,
                "requests_per_s": n / wall,
                "cpu_ms_per_request": 1000 * cpu / n,
                "p50_ms": 1000 * percentile(latencies, 0.50),
                "p99_ms": 1000 * percentile(latencies, 0.99),
                "mean_ms": 1000 * sum(latencies) / n,
                "engine": type(backend).__name__,
            }


def table(rows: list[dict[str, Any]]) -> str:
    head = "| case | requests | hit rate | req/s | p50 ms | p99 ms | mean ms | CPU ms/request |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['requests']} | {r['hit_rate']:.1%} | {r['requests_per_s']:.1f} "
            f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['mean_ms']:.1f} "
            f"| {r['cpu_ms_per_request']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.response_cache", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--refire", type=float, default=0.37)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results/bench/response_cache.json")
    args = ap.parse_args()
    bodies = stream(args.requests, args.refire, args.passages, args.seed)
    distinct = len({json.dumps(b, sort_keys=True) for b in bodies})

    async def both() -> list[dict[str, Any]]:
        return [
            await run_case("cache off", bodies, args.concurrency),
            await run_case("cache on (64 MiB)", bodies, args.concurrency, cache_max_bytes=2**26),
        ]

    rows = anyio.run(both)
    result = {
        "command": "python " + " ".join(sys.argv),
        "stream": {
            "requests": args.requests,
            "refire": args.refire,
            "distinct": distinct,
            "refires": args.requests - distinct,
            "passages": args.passages,
            "concurrency": args.concurrency,
            "seed": args.seed,
        },
        "load_avg_1m": os.getloadavg()[0],
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"`{result['command']}`: {args.requests} requests, {args.requests - distinct} re-fires "
        f"({(args.requests - distinct) / args.requests:.1%}), {args.concurrency} concurrent, "
        f"{args.passages} passages, paced backend, in process; load average "
        f"{result['load_avg_1m']:.2f}\n\n" + table(rows)
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
