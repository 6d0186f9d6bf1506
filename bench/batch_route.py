"""``POST /v1/reorder/batch`` (issue 94, item 5) against the same 32 queries sent as single
``POST /v1/reorder`` calls, one after another and all at once, in process on the paced
backend (GPU-speed forwards that take no CPU; SmolLM2's tokenizer, no weights).

Each query: a synthetic question and 10 passages of about 60 words, ``strategy: moi`` with
its default design, seeded by the query, so every mode computes the same fits (checked: the
orders must agree). Modes, each ``--repeats`` times on one app (median wall seconds):

- ``sequential``: 32 single calls, each awaited before the next;
- ``concurrent``: 32 single calls at once (``max_concurrent_requests`` 64 admits them all);
- ``batch``: one batch of 32 at the default ``RAG_REORDER_BATCH_CONCURRENCY`` (4);
- ``batch_c32``: one batch of 32 with ``RAG_REORDER_BATCH_CONCURRENCY=32`` (its own app).

The machine is shared (2 cores, other engineers' work): the 1-minute load average is
recorded beside the figures.

Usage: python -m bench.batch_route [--items 32] [--repeats 3]
           [--out results/bench/batch_route.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]

from app.main import create_app
from service.backends.fakes.paced import PacedBackend
from service.config.settings import Settings

WORDS = [
    "river",
    "mountain",
    "treaty",
    "engine",
    "protein",
    "orbit",
    "harvest",
    "canal",
    "senate",
    "glacier",
    "voltage",
    "novel",
    "empire",
    "circuit",
    "migration",
    "theorem",
    "festival",
    "harbour",
    "enzyme",
    "dynasty",
    "comet",
    "reactor",
    "poem",
    "vaccine",
    "bridge",
    "desert",
    "algorithm",
    "cathedral",
    "monsoon",
    "satellite",
]


def bodies(n: int, seed: int = 94) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        query = f"question {i}: what about the " + " ".join(rng.choices(WORDS, k=6)) + "?"
        passages = [" ".join(rng.choices(WORDS, k=60)) + f" ({i}.{j})" for j in range(10)]
        out.append({"query": query, "passages": passages, "strategy": "moi"})
    return out


def settings(cache: Path, tmp: Path, **overrides: Any) -> Settings:
    return Settings(
        backend="paced",
        cache_dir=cache,
        bias_profile_dir=tmp / "profiles",
        canary_interval_s=0,
        rate_canary=False,
        **overrides,
    )


async def ready(client: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 120
    while (await client.get("/ready")).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("never ready")
        await anyio.sleep(0.05)


async def timed_modes(
    s: Settings, items: list[dict[str, Any]], modes: list[str], repeats: int
) -> dict[str, Any]:
    backend = PacedBackend.from_settings(s)
    app = create_app(s, backend=backend)
    transport = httpx.ASGITransport(app=app)
    out: dict[str, Any] = {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client,
    ):
        await ready(client)

        async def single(body: dict[str, Any]) -> list[int]:
            r = await client.post("/v1/reorder", json=body)
            assert r.status_code == 200, r.text
            return list(r.json()["order"])

        async def sequential() -> list[list[int]]:
            return [await single(b) for b in items]

        async def concurrent() -> list[list[int]]:
            orders: list[list[int]] = [[] for _ in items]

            async def one(i: int) -> None:
                orders[i] = await single(items[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(items)):
                    tg.start_soon(one, i)
            return orders

        async def batch() -> list[list[int]]:
            r = await client.post("/v1/reorder/batch", json={"items": items})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert all(x["status"] == 200 for x in results), results
            return [list(x["response"]["order"]) for x in results]

        run = {"sequential": sequential, "concurrent": concurrent, "batch": batch}
        await sequential()  # warm: tokenizer caches, the solver's first call
        for mode in modes:
            walls = []
            orders: list[list[int]] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                orders = await run[mode]()
                walls.append(time.perf_counter() - t0)
            out[mode] = {"wall_s": walls, "median_s": statistics.median(walls), "orders": orders}
        out["engine_busy_s"] = backend.busy_s
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    items = bodies(args.items)
    cache = Path(os.environ.get("RAG_REORDER_CACHE_DIR", Path.home() / ".cache" / "rag-reorder"))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = await timed_modes(
            settings(cache, Path(tmp) / "a"),
            items,
            ["sequential", "concurrent", "batch"],
            args.repeats,
        )
        wide = await timed_modes(
            settings(cache, Path(tmp) / "b", batch_concurrency=args.items),
            items,
            ["batch"],
            args.repeats,
        )
    modes = {
        "sequential": base["sequential"],
        "concurrent": base["concurrent"],
        "batch": base["batch"],
        "batch_c32": wide["batch"],
    }
    reference = modes["sequential"]["orders"]
    same = {m: v["orders"] == reference for m, v in modes.items()}
    seq = modes["sequential"]["median_s"]
    return {
        "items": args.items,
        "passages_per_item": 10,
        "repeats": args.repeats,
        "paced_profile": Settings().paced_profile,
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
        "same_orders_as_sequential": same,
        "modes": {
            m: {
                "median_s": round(v["median_s"], 3),
                "wall_s": [round(w, 3) for w in v["wall_s"]],
                "speedup_vs_sequential": round(seq / v["median_s"], 2),
            }
            for m, v in modes.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batch_route", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results/bench/batch_route.json")
    args = parser.parse_args()
    result = anyio.run(main_async, args)
    print(f"{'mode':<12} {'median s':>9} {'x sequential':>13}   all runs (s)")
    for mode, row in result["modes"].items():
        print(
            f"{mode:<12} {row['median_s']:>9.3f} {row['speedup_vs_sequential']:>13.2f}   "
            f"{row['wall_s']}"
        )
    print("same orders as sequential:", result["same_orders_as_sequential"])
    print(f"load average: {result['load_1min_before']:.2f} -> {result['load_1min_after']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result["same_orders_as_sequential"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
