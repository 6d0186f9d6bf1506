"""Where a real server's CPU goes per MoI request, by stage: ``python -m entrypoints serve`` on the
paced engine (``bench/load.py``'s environment, the H200 transformers rate) under py-spy
(``--subprocesses``: the solver pool's workers too), driven by closed-loop clients with
``bench/load.py``'s 10-passage MoI bodies; py-spy's samples sorted into stages by the first
rule a stack matches (most specific first), and the server tree's CPU time per request from
``/proc`` beside them, so a stage's share converts to milliseconds.

With ``--workload auto_scores`` the requests are ``bench/default_path.py``'s no-model path
instead: ``auto`` placing by a trusted profile seeded before start, the caller's score on every
passage, that bench's server environment (no MoI, no model of any kind).

Usage: python -m bench.cpu_stages [--concurrency 8] [--requests 160] [--passages 10]
           [--workload moi|auto_scores] [--rate 200] [--server-root .]
           [--out results/bench/cpu_stages.json]

py-spy is a dev tool (``pip install py-spy``), not a dependency of the service. py-spy
attaches after a warm-up cycle (imports, the solver pool's start and the designs' cache are not
per-request costs) and its own process is not counted; sampling the server costs it a little.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import default_path
from bench.load import SERVER_ENV, level
from bench.report import parser as bench_parser
from bench.report import provenance
from bench.server_process import cpu_s, free_port, process_tree, start_server
from bench.workload import load_requests

# (stage, substrings of a frame); a stack goes to the first stage any of its frames matches.
# Most specific first: a tokenise call under a route counts as tokenising, not HTTP.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fit: jackknife", ("jackknife", "_refit")),
    ("fit: other", ("solver/fit.py", "solver/lm.py", "solver/profiles.py")),
    ("solver pool IPC", ("concurrent/futures/process.py", "multiprocessing/", "solver_pool.py")),
    ("design", ("solver/design.py", "solver/designs.py", "solver/adaptive.py")),
    ("tokenise", ("encode_batch", "encode (", "tokenizers", "decode (")),
    ("prompts: other", ("service/prompting/prompts.py", "service/prompting/templates.py")),
    ("paced engine", ("backends/fakes/paced.py",)),
    ("scheduler/backend", ("service/backends/",)),
    ("placement/confidence", ("solver/placement.py", "solver/trust.py", "strategies/placement")),
    ("strategy/pipeline", ("service/strategies/", "service/pipeline.py")),
    ("response: app", ("app/conversions.py", "app/routes/")),
    ("request id (uuid4)", ("uuid4",)),
    ("pydantic", ("pydantic",)),
    ("json", ("json/",)),
    ("metrics/middleware", ("prometheus_client", "app/middleware.py", "serving/metrics.py")),
    ("http: fastapi/starlette", ("fastapi/", "starlette/")),
    ("http: uvicorn/h11", ("uvicorn/", "h11/", "httptools")),
    ("asyncio", ("asyncio/",)),
)


def stage_of(frames: list[str]) -> str:
    for name, needles in STAGES:
        if any(needle in frame for frame in frames for needle in needles):
            return name
    return "other"


def categorise(raw: Path) -> dict[str, Any]:
    """py-spy's ``--format raw`` (one stack a line: ``frame;frame;... count``) by stage and by
    process (the server vs its solver workers)."""
    by_stage: collections.Counter[str] = collections.Counter()
    by_process: collections.Counter[str] = collections.Counter()
    other_leaves: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        n = int(count)
        process = frames[0]
        worker = "spawn_main" in stack or "multiprocessing" in process
        by_process["solver workers" if worker else "server"] += n
        stage = stage_of(frames[1:])
        by_stage[stage] += n
        if stage == "other":
            other_leaves[frames[-1]] += n
    total = sum(by_stage.values())
    return {
        "samples": total,
        "by_process": dict(by_process),
        "shares": {k: v / total for k, v in by_stage.most_common()},
        "other_top": other_leaves.most_common(8),
    }


async def warm_up(port: int, bodies: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        for body in bodies:
            (await client.post("/v1/reorder", json=body)).raise_for_status()


def run(args: argparse.Namespace) -> dict[str, Any]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    port = free_port()
    root = Path(args.server_root).resolve()
    tmp = Path(tempfile.mkdtemp())
    raw = tmp / "raw.txt"
    load_before = os.getloadavg()
    if args.workload == "auto_scores":
        default_path.trust_profile(tmp / "profiles", default_path.MODEL_ID)
        bodies = default_path.bodies(Path(args.data), args.queries, "auto_scores")
        env = {**default_path.SERVER_ENV, "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp / "profiles"),
               "RAG_REORDER_TRAFFIC_SAMPLE_DIR": str(tmp / "traffic")}  # fmt: skip
    else:
        bodies = load_requests(Path(args.data), args.queries, [args.passages])
        env = {**SERVER_ENV, "RAG_REORDER_BACKEND": "paced"}
    proc = start_server(root, port, env, Path(args.server_log), ready_s=300)
    try:
        # Warm-up before py-spy attaches: imports, the solver pool's start and the designs'
        # cache are not the per-request cost.
        asyncio.run(warm_up(port, bodies))
        spy_proc = subprocess.Popen(
            [
                *(spy, "record", "--pid", str(proc.pid), "--subprocesses", "--nonblocking"),
                *("-r", str(args.rate), "-f", "raw", "-o", str(raw)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(2)  # py-spy finds the processes before the level starts
        cpu0 = cpu_s(process_tree(proc.pid))
        t0 = time.perf_counter()
        row = asyncio.run(drive_level(port, bodies, args.concurrency, args.requests))
        wall = time.perf_counter() - t0
        cpu = cpu_s(process_tree(proc.pid)) - cpu0
        spy_proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy_proc.wait(60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    ok = args.requests - row["errors"]
    prof = categorise(raw)
    per_request_ms = cpu / max(1, ok) * 1e3
    return {
        **provenance(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "server_root": str(root),
        "engine": "paced (h200-transformers-bf16)",
        "workload": args.workload,
        "requests": {"passages": args.passages, "queries": args.queries, "design": "pruned_random"}
        if args.workload == "moi"
        else {"passages": default_path.PASSAGES, "queries": args.queries, "path": "profile"},
        "level": row,
        "wall_s": wall,
        "server_cpu_ms_per_request": per_request_ms,
        "profile": prof,
        "stage_ms_per_request": {
            k: round(share * per_request_ms, 1) for k, share in prof["shares"].items()
        },
    }


async def drive_level(port: int, bodies: list[dict[str, Any]], c: int, n: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        return await level(client, bodies, c, n)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['command']}`: {result['server_cpu_ms_per_request']:.1f} ms of server CPU "
        f"per request ({result['level']['requests']} requests at concurrency "
        f"{result['level']['concurrency']}, {result['profile']['samples']} samples: "
        f"{result['profile']['by_process']}), load average before "
        f"{result['load_average_before'][0]:.2f}.",
        "",
        "| stage | share | ms/request |",
        "|---|---:|---:|",
    ]
    for k, share in result["profile"]["shares"].items():
        lines.append(f"| {k} | {share:.1%} | {result['stage_ms_per_request'][k]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = bench_parser("cpu_stages", __doc__, data=True)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument(
        "--workload",
        choices=("moi", "auto_scores"),
        default="moi",
        help="MoI requests, or auto's no-model path (bench/default_path.py's)",
    )
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--server-root", default=str(ROOT))
    ap.add_argument("--server-log", default="/tmp/rag-reorder-cpu-stages.log")
    args = ap.parse_args()
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
