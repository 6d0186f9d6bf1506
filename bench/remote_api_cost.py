"""Where the remote engine's time goes at GPU speed: the CPU that vLLM's OpenAI server spends
*outside* its engine on each prompt token whose log-prob it returns (issue 60).

On an H100 (2026-11-27, `bench/results/gpu_h100_20261127/load_remote.*`) the service through
vLLM's OpenAI server reached 0.32x the in-process engine at concurrency 8 while the server's
engine reported `Running: 0 reqs` in most of its 10 s samples: the engine waited on something
else. This measures, on this CPU, the API server process's own CPU seconds (the parent
process; the engine core runs in a child with `VLLM_ENABLE_V1_MULTIPROCESSING=1`, the
server's default) for the same prompts asked with `prompt_logprobs: 0` (what the remote
backend sends) and without, and the client's JSON decoding of the answer. The API process's
CPU does not depend on the forward's speed, so its per-token figure carries to a GPU, where
it bounds the throughput of one API process: 1 / (seconds per token) prompt tokens/s.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 .venv-vllm/bin/python bench/remote_api_cost.py \\
        --out bench/results/remote_api_cost.json        # ~3 min
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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.remote import start_vllm_server
from bench.report import provenance
from bench.server_process import cpu_s, free_port
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per call (one request's share)")
    ap.add_argument("--tokens", default="128,512", help="prompt lengths to try, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="calls per length and mode")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import psutil

    folder = resolve_model(Settings())
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "vllm-serve.log"
    proc = start_vllm_server(folder, port, log, kv_bytes=1 << 30)
    api = psutil.Process(proc.pid)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client() as client:
            ask(client, url, [[1, 2, 3]], True)  # warm the route
            for length in [int(x) for x in args.tokens.split(",")]:
                for logprobs in (False, True):
                    for rep in range(args.repeats):
                        # Distinct prompts each call: no prefix-cache hit flatters either mode.
                        base = 100 + 7 * rep + (1000 if logprobs else 0)
                        prompts = [
                            [(base + i * 13 + j) % 40000 + 10 for j in range(length)]
                            for i in range(args.prompts)
                        ]
                        before = cpu_s([api])
                        t = time.perf_counter()
                        decode, size = ask(client, url, prompts, logprobs)
                        wall = time.perf_counter() - t
                        used = cpu_s([api]) - before
                        tokens = length * args.prompts
                        rows.append(
                            {
                                "prompt_tokens": tokens,
                                "prompt_logprobs": logprobs,
                                "api_cpu_s": used,
                                "api_cpu_us_per_token": 1e6 * used / tokens,
                                "wall_s": wall,
                                "answer_bytes": size,
                                "client_decode_us_per_token": 1e6 * decode / tokens,
                            }
                        )
                        print(json.dumps(rows[-1]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

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
    summary = {
        "api_cpu_us_per_token_with_prompt_logprobs": with_lp,
        "api_cpu_us_per_token_without": without,
        "prompt_logprobs_share_us_per_token": with_lp - without,
        "client_decode_us_per_token": mean("client_decode_us_per_token", True),
        "answer_bytes_per_token": mean("answer_bytes", True)
        / (max(int(x) for x in args.tokens.split(",")) * args.prompts),
        # One API process, busy only on this, serves at most this many prompt tokens/s.
        "one_api_process_max_prompt_tokens_per_s": 1e6 / with_lp,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "provenance": provenance(),
                    "args": vars(args) | {"out": str(args.out)},
                    "summary": summary,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
