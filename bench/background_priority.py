"""Where `auto`'s assessments run: a nice-19 thread of the server (before) against the
background worker process (``service.runtime.background``), quiet and beside busy processes.

Each arm runs in its own child process (a thread cannot be stopped, and one left running
would spoil the next arm): an asyncio loop wakes every 5 ms, as the server's event loop does
for requests, while ``--assessments`` trust assessments (``solver.trust.assess``, the service's
rules) of ``--runs`` real SmolLM2 runs (``results/bench/auto_trust_runs_smollm2.jsonl``) run
the arm's way. Reported per arm: each assessment's wall time (or that it did not finish within
``--limit-s``) and the loop's lateness past each 5 ms wake-up (p50, p99, max): the time a
request waiting on the loop would lose. ``none`` runs no assessment (the lateness the machine
alone causes). ``--busy K`` starts K processes that spin (``while True: pass``) beside it, a
shared node's neighbours.

Usage: python -m bench.background_priority [--arms none,thread19,process10,process19]
       [--busy 0,2] [--assessments 3] [--runs 60] [--limit-s 180]
       [--out results/bench/background_priority.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import contextlib
import functools
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from bench.auto_trust import load
from service.runtime.background import BackgroundWorker
from solver import trust

WAKE_S = 0.005
PLACEMENT_SLOTS = 10


def _thread_nice19(fn: Any) -> Any:
    """The learner's old way: a daemon thread at nice 19, awaited from the loop."""
    future: Future[Any] = Future()

    def target() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return asyncio.wrap_future(future)


async def _arm(arm: str, runs: list[Any], assessments: int, limit_s: float) -> dict[str, Any]:
    late: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(WAKE_S)
            late.append(time.perf_counter() - t0 - WAKE_S)

    assess = functools.partial(
        trust.assess, runs, placement_slots=PLACEMENT_SLOTS, rules=trust.TrustRules()
    )
    worker = BackgroundWorker(int(arm.removeprefix("process"))) if arm.startswith("p") else None
    if worker is not None:  # the worker's start (spawn, imports) is paid once, not measured
        await worker.run(time.sleep, 0)
    walls: list[float | None] = []
    task = asyncio.create_task(probe())
    t_arm = time.perf_counter()
    if arm == "none":
        await asyncio.sleep(5.0)
    for _ in range(assessments if arm != "none" else 0):
        t0 = time.perf_counter()
        call = _thread_nice19(assess) if arm == "thread19" else worker.run(assess)  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(call, max(1.0, limit_s - (t0 - t_arm)))
            walls.append(round(time.perf_counter() - t0, 3))
        except TimeoutError:
            walls.append(None)
            break
    stop.set()
    await task
    if worker is not None:
        worker.abandon()
    lat = np.asarray(late) * 1e3
    return {
        "arm": arm,
        "assessment_s": walls,
        "finished": sum(w is not None for w in walls),
        "loop_late_ms": {
            "wakeups": int(lat.size),
            "p50": round(float(np.percentile(lat, 50)), 2),
            "p99": round(float(np.percentile(lat, 99)), 2),
            "max": round(float(lat.max()), 2),
        },
    }


def _child(args: argparse.Namespace) -> None:
    runs = load(Path(args.runs_file))[: args.runs]
    print(json.dumps(asyncio.run(_arm(args.child, runs, args.assessments, args.limit_s))))


def main() -> None:
    ap = report.parser("background_priority", __doc__)
    ap.add_argument("--arms", default="none,thread19,process10,process19")
    ap.add_argument("--busy", default="0,2", help="neighbours to start, per round")
    ap.add_argument("--assessments", type=int, default=3)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--runs-file", default=str(report.RESULTS / "auto_trust_runs_smollm2.jsonl"))
    ap.add_argument("--limit-s", type=float, default=180.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    rows: list[dict[str, Any]] = []
    rest = sys.argv[1:]
    for busy in (int(b) for b in args.busy.split(",")):
        for arm in args.arms.split(","):
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)
            ]
            try:
                out = subprocess.run(
                    [sys.executable, "-m", "bench.background_priority", "--child", arm, *rest],
                    capture_output=True,
                    cwd=report.ROOT,
                    text=True,
                    timeout=args.limit_s + 120,
                    check=True,
                )
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            row = {"busy_neighbours": busy, **json.loads(out.stdout.splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        **report.provenance(),
        "runs": args.runs,
        "assessments": args.assessments,
        "limit_s": args.limit_s,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    report.write(result, args.out)


if __name__ == "__main__":
    main()
