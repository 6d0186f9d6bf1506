"""The no-model default path's CPU per request with ``auto``'s randomized holdout on and off,
in one run (issue 92, docs/outcomes.md "Cost").

``bench/default_path.py``'s ``auto_scores`` case (a real ``python -m entrypoints serve`` on the
``paced`` backend, a trusted 5-slot profile written before the start, the caller's scores on
every passage: ranked by them, placed by the profile, no model of any kind), three ways:

- ``feedback_off``: the defaults: no served request kept, no holdout (the rate applies only
  with feedback on).
- ``holdout_0``: ``RAG_REORDER_FEEDBACK_MAX_REQUESTS=10000`` (each served request's record
  kept in the folder's SQLite file for ``POST /v1/feedback``), ``RAG_REORDER_HOLDOUT_RATE=0``.
- ``holdout_on``: the same with the holdout at its default rate (0.1): an arm drawn per
  request, a tenth served the retriever's order, the arm kept in the record.

At each concurrency level, closed-loop clients for ``--seconds``; the server's process tree's
CPU ms per request, requests/s, p50/p99 (``default_path.level``). Cases run in turn, then
again in reverse order (``--rounds 2``), so the shared machine's drift shows as the spread of
one case's rounds. The arms drawn are read from ``/metrics`` at the end of each case.

Usage: python bench/holdout_cost.py [--levels 1,16] [--seconds 8] [--rounds 2]
           [--out results/bench/holdout_cost.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench import default_path as dp
from bench import report
from bench.server_process import cpu_s, free_port, process_tree, start_server

# The scorer's learned profile placed by in every case: with RAG_REORDER_GENERATOR_MODEL set
# (feedback needs it) auto would otherwise not place by a profile learned from the scorer, and
# the feedback cases would run MoI (a first run measured that: 68-74 ms of CPU a request).
SCORER = {"RAG_REORDER_AUTO_LEARN_FROM_SCORER": "true"}
CASES = {
    "feedback_off": {**SCORER},
    "holdout_0": {
        **SCORER,
        "RAG_REORDER_FEEDBACK_MAX_REQUESTS": "10000",
        "RAG_REORDER_GENERATOR_MODEL": "answering-generator",
        "RAG_REORDER_HOLDOUT_RATE": "0",
    },
    "holdout_on": {
        **SCORER,
        "RAG_REORDER_FEEDBACK_MAX_REQUESTS": "10000",
        "RAG_REORDER_GENERATOR_MODEL": "answering-generator",
        "RAG_REORDER_HOLDOUT_RATE": "0.1",
    },
}


async def run_case(case: str, args: argparse.Namespace, tmp: Path, rnd: int) -> dict[str, Any]:
    folder = tmp / f"profiles-{case}-{rnd}"
    dp.trust_profile(folder, dp.MODEL_ID)
    env = {
        **dp.SERVER_ENV,
        "RAG_REORDER_BIAS_PROFILE_DIR": str(folder),
        "RAG_REORDER_CACHE_DIR": args.cache_dir,
        **CASES[case],
    }
    port = free_port()
    proc = start_server(dp.ROOT, port, env, tmp / f"server-{case}-{rnd}.log", ready_s=600)
    try:
        reqs = dp.encoded(dp.bodies(Path(args.data), args.queries, "auto_scores"), port)
        await dp.level(port, reqs, 4, 0.0, len(reqs), None)  # warm-up
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            auto = (await client.post("/v1/reorder", json=json.loads(reqs[0][1]))).json()["auto"]
        # Every case on the placed path (the holdout's arm aside): what is compared.
        assert auto["path"] in ("profile", "holdout"), auto
        levels = []
        for c in args.levels:
            tree = process_tree(proc.pid)
            cpu0, load0 = cpu_s(tree), os.getloadavg()[0]
            row = await dp.level(port, reqs, c, args.seconds, max(c, args.min_requests), None)
            row["server_cpu_ms_per_request"] = 1000 * (cpu_s(tree) - cpu0) / max(1, row["requests"])
            row["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            print(
                f"{case} round {rnd} c={c}: {row['requests']} ok {row['errors']} err, "
                f"{row['requests_per_s']:.0f} req/s, p50 {row['p50_ms']:.2f} ms, "
                f"{row['server_cpu_ms_per_request']:.3f} CPU ms/req, load {row['load_1min']}",
                flush=True,
            )
            levels.append(row)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            text = (await client.get("/metrics")).text
        drawn = {
            line.split('arm="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("rag_reorder_holdout_draws_total{")
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"case": case, "round": rnd, "levels": levels, "arms_drawn": drawn}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| case | round | concurrency | requests/s | p50 ms | server CPU ms/request | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        for lv in row["levels"]:
            lines.append(
                f"| {row['case']} | {row['round']} | {lv['concurrency']} | "
                f"{lv['requests_per_s']:.0f} | {lv['p50_ms']:.2f} | "
                f"{lv['server_cpu_ms_per_request']:.3f} | {lv['load_1min']} |"
            )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    result: dict[str, Any] = {**report.provenance(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="holdout-cost-") as name:
        order = list(CASES)
        for rnd in range(args.rounds):
            for case in order if rnd % 2 == 0 else order[::-1]:
                result["runs"].append(await run_case(case, args, Path(name), rnd))
                report.write(result, out)
                out.with_suffix(".md").write_text(markdown(result))
    return result


def main() -> int:
    ap = report.parser("holdout_cost", __doc__, data=True)
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--min-requests", type=int, default=20)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-dir", default="/tmp/rag-reorder-bench-cache")
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
