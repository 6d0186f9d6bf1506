"""What reading a bias profile costs a request, the folder against Redis, side by side in one run.

A request placed by a stored profile (``bias_matched`` on a model-free ranker, ``auto``'s
profile path, a cyclic MoI design) reads it once: ``ProfileStore.for_slots``. The folder reads
and parses the file each time; the Redis store reads this replica's memory, refreshed in the
background, so no request makes a network call. Runs a real ``redis-server`` (scripts/
redis-server.sh installs it) on a loopback port.

Usage: python -m bench.state_store [--reads 20000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from bench import report
from service.config.settings import Settings
from service.state.profile_store import ProfileStore
from service.state.state_store import FolderState, open_state
from tests.support.redis_server import RedisServer


def _timed(store: ProfileStore, reads: int) -> dict[str, float]:
    times = []
    for _ in range(reads):
        t = time.perf_counter_ns()
        found = store.for_slots("m", "qa_default", 5)
        times.append((time.perf_counter_ns() - t) / 1000)
        assert found is not None
    times.sort()
    return {
        "p50_us": round(times[len(times) // 2], 2),
        "p99_us": round(times[int(len(times) * 0.99)], 2),
        "mean_us": round(statistics.fmean(times), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-state-"))
    server = RedisServer(tmp / "redis")
    server.start()
    try:
        folder = FolderState(tmp / "profiles")
        settings = Settings(
            cache_dir=tmp,
            state_url=SecretStr(server.url),
            state_password=SecretStr(server.password),
        )
        redis_store = open_state(settings)
        redis_store.start()
        assert redis_store.wait_loaded(5)
        for store in (folder, redis_store):
            store.profiles.put(
                model="m", template="qa_default", coefficients=[0.3, 0.25, 0.2, 0.15, 0.1],
                identification="full", runs=10, prompts=200, r2=0.9, source="bench",
            )  # fmt: skip
        results = {"folder": _timed(folder.profiles, args.reads)}
        results["redis"] = _timed(redis_store.profiles, args.reads)
        redis_store.close()
    finally:
        server.kill()
    ratio = results["redis"]["p50_us"] / results["folder"]["p50_us"]
    print(f"{'store':8} {'p50 us':>8} {'p99 us':>8} {'mean us':>8}")
    for name, r in results.items():
        print(f"{name:8} {r['p50_us']:8.2f} {r['p99_us']:8.2f} {r['mean_us']:8.2f}")
    print(f"redis / folder (p50): {ratio:.3f}")
    return {**report.provenance(), "reads": args.reads, "stores": results, "p50_ratio": ratio}


if __name__ == "__main__":
    ap = report.parser("state_store", __doc__)
    ap.add_argument("--reads", type=int, default=20_000, help="profile reads per store")
    raise SystemExit(report.main(ap, run))
