"""Where the remote engine's time goes at GPU speed: the CPU that vLLM's OpenAI server spends
*outside* its engine on each prompt token whose log-prob it returns (issue 60).

On an H100 (2026-11-27, `results/bench/gpu_h100_20261127/load_remote.*`) the service through
vLLM's OpenAI server reached 0.32x the in-process engine at concurrency 8 while the server's
engine reported `Running: 0 reqs` in most of its 10 s samples: the engine waited on something
else. This measures, on this CPU, the API server process's own CPU seconds (the parent
process; the engine core runs in a child with `VLLM_ENABLE_V1_MULTIPROCESSING=1`, the
server's default) for the same prompts asked with `prompt_logprobs: 0` (what the remote
backend sends) and without, and the client's JSON decoding of the answer. The API process's
CPU does not depend on the forward's speed, so its per-token figure carries to a GPU, where
it bounds the throughput of one API process: 1 / (seconds per token) prompt tokens/s.

``--api-server-counts 1,2`` runs one server per count through ``vllm serve
--api-server-count N`` (``scripts/vllm_serve.py``: N API processes in front of one engine
core, the connections spread over them by the kernel) and sums the API processes' CPU; the
bound is then N times one process's.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 .venv-vllm/bin/python -m bench.remote_api_cost \\
        --out results/bench/remote_api_cost.json        # ~3 min
    .venv-vllm/bin/python -m bench.remote_api_cost --api-server-counts 1,2 \\
        --out results/bench/remote_api_servers.json     # ~8 min
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The server's default on a GPU: the engine core in a process of its own, so the parent's CPU
# is the API layer's alone.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.remote import start_vllm_server
from bench.report import main as report_main
from bench.report import parser, provenance
from bench.server_process import free_port, thread_cpu_s
from service.config.settings import EMBEDDED_MODEL, Settings
from service.model_assets import resolve_model


def ask(
    client: httpx.Client, url: str, prompts: list[list[int]], logprobs: bool
) -> tuple[float, int]:
    body: dict[str, Any] = {
        "model": EMBEDDED_MODEL,
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 0.0,
    }
    if logprobs:
        body["prompt_logprobs"] = 0
    answer = client.post(url, json=body, timeout=900)
    answer.raise_for_status()
    text = answer.text
    t = time.perf_counter()
    parsed = json.loads(text)
    decode = time.perf_counter() - t
    if logprobs:
        rows = sum(len(c["prompt_logprobs"]) for c in parsed["choices"])
        assert rows == sum(len(p) for p in prompts), (rows, [len(p) for p in prompts])
    return decode, len(text)


def api_processes(server: Any, count: int) -> list[Any]:
    """The server's API processes: itself with one (``vllm serve`` runs it in the main
    process, the engine core a child), else its ``VLLM::APIServer_<i>`` children."""
    import psutil

    if count == 1:
        return [psutil.Process(server.pid)]
    found: list[Any] = []
    for _ in range(120):
        found = [
            p for p in psutil.Process(server.pid).children() if p.name().startswith("VLLM::APIServ")
        ]
        if len(found) == count:
            return found
        time.sleep(0.5)
    raise RuntimeError(f"{len(found)} API processes, not {count}")


def measure(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """Every call of the run against one server with ``count`` API processes."""
    folder = resolve_model(Settings())
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "vllm-serve.log"
    proc = start_vllm_server(folder, port, log, kv_bytes=1 << 30, api_servers=count)
    apis = api_processes(proc, count)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(2 * count):  # warm each process's route (connections spread over them)
            with httpx.Client() as client:
                ask(client, url, [[1, 2, 3]], True)
        for length in [int(x) for x in args.tokens.split(",")]:
            for logprobs in (False, True):
                for rep in range(args.repeats):
                    # Distinct prompts each call: no prefix-cache hit flatters either mode.
                    base = 100 + 7 * rep + (1000 if logprobs else 0)
                    prompts = [
                        [(base + i * 13 + j) % 40000 + 10 for j in range(length)]
                        for i in range(args.prompts)
                    ]
                    before = [thread_cpu_s([a]) for a in apis]
                    t = time.perf_counter()
                    # A connection of its own: with several API processes the kernel picks
                    # one for each (SO_REUSEPORT), as for callers.
                    with httpx.Client() as client:
                        decode, size = ask(client, url, prompts, logprobs)
                    wall = time.perf_counter() - t
                    used = [thread_cpu_s([a]) - b for a, b in zip(apis, before, strict=True)]
                    tokens = length * args.prompts
                    rows.append(
                        {
                            "api_servers": count,
                            "prompt_tokens": tokens,
                            "prompt_logprobs": logprobs,
                            "api_cpu_s": sum(used),
                            "api_cpu_s_by_process": used,
                            "api_cpu_us_per_token": 1e6 * sum(used) / tokens,
                            "wall_s": wall,
                            "answer_bytes": size,
                            "client_decode_us_per_token": 1e6 * decode / tokens,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def summarise(args: argparse.Namespace, rows: list[dict[str, Any]], count: int) -> dict[str, Any]:
    def mean(key: str, logprobs: bool) -> float:
        vals = [
            r[key]
            for r in rows
            if r["prompt_logprobs"] is logprobs and r["prompt_tokens"] >= 512 * args.prompts
        ]
        vals = vals or [r[key] for r in rows if r["prompt_logprobs"] is logprobs]
        return sum(vals) / len(vals)

    with_lp = mean("api_cpu_us_per_token", True)
    without = mean("api_cpu_us_per_token", False)
    by_process = [sum(r["api_cpu_s_by_process"][i] for r in rows) for i in range(count)]
    return {
        "api_servers": count,
        "api_cpu_us_per_token_with_prompt_logprobs": with_lp,
        "api_cpu_us_per_token_without": without,
        "prompt_logprobs_share_us_per_token": with_lp - without,
        "client_decode_us_per_token": mean("client_decode_us_per_token", True),
        "answer_bytes_per_token": mean("answer_bytes", True)
        / (max(int(x) for x in args.tokens.split(",")) * args.prompts),
        # Each API process's share of the API CPU over the run: how evenly the kernel spread
        # the connections.
        "api_cpu_share_by_process": [x / sum(by_process) for x in by_process],
        # The API processes, busy only on this with the work spread evenly, serve at most
        # this many prompt tokens/s.
        "api_processes_max_prompt_tokens_per_s": count * 1e6 / with_lp,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    summaries = []
    for count in [int(x) for x in args.api_server_counts.split(",")]:
        mine = measure(args, count)
        rows += mine
        summaries.append(summarise(args, mine, count))
        print(json.dumps(summaries[-1], indent=2), flush=True)
    return {
        "provenance": provenance(),
        "args": vars(args),
        "summary": summaries[0] if len(summaries) == 1 else summaries,
        "rows": rows,
    }


def main() -> int:
    ap = parser("remote_api_cost", __doc__)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per call (one request's share)")
    ap.add_argument("--tokens", default="128,512", help="prompt lengths to try, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="calls per length and mode")
    ap.add_argument(
        "--api-server-counts",
        default="1",
        help="vllm serve --api-server-count values, one server each, comma-separated",
    )
    return report_main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
