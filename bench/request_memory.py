"""Server memory of the largest requests the default limits let in (issue 54), on the real
server process and the embedded default model (SmolLM2-135M-Instruct, CPU).

Before issue 54 one request inside the input limits (100 passages of 32,768 characters, a
random design of 512 prompts) rendered and tokenised every prompt before any length check:
gigabytes, in a worker thread its deadline could not stop. Now a prompt is refused before it
is rendered when its characters could not fit the model's context (``prompt_chars``), the
request's prompts x characters are charged before each prompt is rendered
(``max_prompt_chars_x_prompts``), and prompts are tokenised a chunk at a time.

Scenarios, each on a fresh server process with the shipped defaults (only the bias profile
folder is a temporary one), sent ``--concurrency`` at once (1, then 8):

- ``old_worst``: the request above; it must now be refused (4xx) at once.
- ``chars_worst``: prose passages sized so every prompt is just under the context (8,192
  tokens) and as many prompts as ``max_prompt_chars_x_prompts`` lets in: everything the
  character checks admit is rendered and tokenised, then ``max_prompt_tokens_x_prompts`` (422).
- ``dense_worst``: the same with text of about 3 tokens a character (emoji), 512 prompts just
  under the context each: the most tokens the character checks let through.
- ``served_max``: prose, prompts x tokens just under ``max_prompt_tokens_x_prompts``: the
  largest request actually scored (the first is admitted; others that arrive before the
  engine's rate is measured may get 503 from ``unmeasured_inflight_prompt_tokens``).

Per scenario: the server's RSS when idle (after ready and one small request), its peak while
the requests run (sampled every 10 ms), the statuses, error parameters and seconds.
Target (issue 54): the peak under 1 GiB above idle.

Usage: python -m bench.request_memory [--concurrency 1,8] [--scenarios ...]
       [--out results/bench/request_memory.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.server_process import free_port, start_server
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.config.settings import EMBEDDED_MODEL, Settings
from service.passage import Passage
from service.prompting.prompts import build_prompt

MIB = float(1 << 20)
QUERY = "Which document describes the capital of France?"
WORDS = (
    "the capital of France is Paris a city on the river Seine with museums bridges and "
    "old streets where people walk in the evening and talk about history art and food"
)


class PeakRss:
    """Samples a process's RSS every ``period_s`` in a thread; ``peak`` since ``reset``."""

    def __init__(self, pid: int, period_s: float = 0.01) -> None:
        self._proc = psutil.Process(pid)
        self._period = period_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def reset(self) -> None:
        self._peak = self.rss()

    @property
    def peak(self) -> int:
        return self._peak

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._peak = max(self._peak, self.rss())
            except psutil.Error:
                return
            time.sleep(self._period)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def prose(rng: random.Random, chars: int) -> str:
    words_ = WORDS.split()
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(words_)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[: chars - 1] + "."


def dense(rng: random.Random, chars: int) -> str:
    # Emoji: about 3 tokens a character with SmolLM2's byte-level BPE (4 UTF-8 bytes each).
    return "".join(chr(rng.randrange(0x1F300, 0x1F5FF)) for _ in range(chars))


def tokenizer() -> HFPromptTokenizer:
    from transformers import AutoTokenizer

    folder = Settings().cache_dir / "models" / EMBEDDED_MODEL.replace("/", "--")
    return HFPromptTokenizer(AutoTokenizer.from_pretrained(str(folder)))


def fit_passages(
    tok: HFPromptTokenizer, make: Any, n: int, target_tokens: int, seed: int
) -> tuple[list[str], int, int]:
    """``n`` passages made by ``make`` whose prompt (all ``n``, qa_default) has at most
    ``target_tokens`` tokens, as long as that allows; returns them, the prompt's tokens and
    its characters."""
    chars = 4 * target_tokens // n
    while True:
        rng = random.Random(seed)
        texts = [make(rng, chars) for _ in range(n)]
        prompt = build_prompt(tok, "qa_default", QUERY, [Passage(t) for t in texts], range(n))
        tokens = len(prompt.token_ids)
        if tokens <= target_tokens:
            return texts, tokens, len(prompt.text)
        chars = int(chars * 0.97 * target_tokens / tokens)


def scenarios(defaults: Settings) -> dict[str, dict[str, Any]]:
    """The request bodies (and what is known about them) of every scenario."""
    tok = tokenizer()
    context = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
    out: dict[str, dict[str, Any]] = {}
    rng = random.Random(0)
    n = defaults.max_passages
    old = [prose(rng, defaults.max_passage_chars) for _ in range(n)]
    out["old_worst"] = {
        "passages": n,
        "passage_chars": defaults.max_passage_chars,
        "prompts": defaults.max_prompts_per_request,
        "body": body(old, defaults.max_prompts_per_request),
    }
    # Fewer passages where the prompts are few: a random design needs about as many prompts
    # as passages to identify the fit (else 422 before any prompt is built).
    texts, tokens, chars = fit_passages(tok, prose, 20, context - 192, 1)
    prompts = min(defaults.max_prompts_per_request, defaults.max_prompt_chars_x_prompts // chars)
    out["chars_worst"] = {
        "passages": 20,
        "prompt_tokens": tokens,
        "prompt_chars": chars,
        "prompts": prompts,
        "body": body(texts, prompts),
    }
    texts, tokens, chars = fit_passages(tok, dense, n, context - 192, 2)
    prompts = min(defaults.max_prompts_per_request, defaults.max_prompt_chars_x_prompts // chars)
    out["dense_worst"] = {
        "passages": n,
        "prompt_tokens": tokens,
        "prompt_chars": chars,
        "prompts": prompts,
        "body": body(texts, prompts),
    }
    texts, tokens, chars = fit_passages(tok, prose, 20, context - 192, 3)
    prompts = defaults.max_prompt_tokens_x_prompts // tokens
    out["served_max"] = {
        "passages": 20,
        "prompt_tokens": tokens,
        "prompt_chars": chars,
        "prompts": prompts,
        "body": body(texts, prompts),
    }
    return out


def body(passages: list[str], prompts: int) -> dict[str, Any]:
    return {
        "query": QUERY,
        "passages": passages,
        "strategy": "moi",
        "design": {"kind": "random", "num_prompts": prompts},
    }


async def send(url: str, payload: dict[str, Any], k: int) -> list[dict[str, Any]]:
    async def one(client: httpx.AsyncClient) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = await client.post("/v1/reorder", json=payload)
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {"status": r.status_code, "seconds": round(seconds, 2)}
        if r.status_code != 200:
            err = r.json().get("error", {})
            row.update(param=err.get("param"), limit=err.get("limit"), value=err.get("value"))
        else:
            row["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]
        return row

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(k))))


def run_one(name: str, shape: dict[str, Any], k: int, work: Path) -> dict[str, Any]:
    port = free_port()
    env = {
        "RAG_REORDER_BIAS_PROFILE_DIR": str(work / f"profiles-{name}-{k}"),
        "RAG_REORDER_LOG_LEVEL": "warning",
    }
    proc = start_server(ROOT, port, env, work / f"server-{name}-{k}.log", ready_s=600)
    url = f"http://127.0.0.1:{port}"
    sampler = PeakRss(proc.pid)
    try:
        small = {"query": QUERY, "passages": ["Paris is in France.", "Berlin is in Germany."]}
        httpx.post(f"{url}/v1/reorder", json=small, timeout=60).raise_for_status()
        time.sleep(2.0)
        samples = []
        for _ in range(20):
            samples.append(sampler.rss())
            time.sleep(0.05)
        idle = statistics.median(samples)
        sampler.reset()
        t0 = time.perf_counter()
        rows = asyncio.run(send(url, shape["body"], k))
        wall = time.perf_counter() - t0
        peak = sampler.peak
    finally:
        sampler.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
    shown = {key: v for key, v in shape.items() if key != "body"}
    result = {
        "scenario": name,
        "concurrency": k,
        **shown,
        "idle_rss_mib": round(idle / MIB),
        "peak_rss_mib": round(peak / MIB),
        "peak_above_idle_mib": round((peak - idle) / MIB),
        "wall_s": round(wall, 2),
        "responses": rows,
    }
    codes = sorted({r["status"] for r in rows})
    params = sorted({str(r.get("param")) for r in rows if r["status"] != 200})
    print(
        f"{name:12s} x{k}: idle {idle / MIB:6.0f} MiB, peak +{(peak - idle) / MIB:6.0f} MiB, "
        f"{wall:6.1f} s, status {codes} {params}",
        flush=True,
    )
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    defaults = Settings()
    shapes = scenarios(defaults)
    chosen = args.scenarios.split(",") if args.scenarios else list(shapes)
    levels = [int(x) for x in args.concurrency.split(",")]
    runs = []
    work = Path(tempfile.mkdtemp(prefix="request-memory-"))  # server logs, kept
    print(f"server logs in {work}", flush=True)
    for name in chosen:
        for k in levels:
            runs.append(run_one(name, shapes[name], k, work))
    worst = max(r["peak_above_idle_mib"] for r in runs)
    print()
    print(f"{'scenario':12s} {'x':>3s} {'prompts':>7s} {'idle MiB':>9s} {'+peak MiB':>10s} "
          f"{'wall s':>7s}  statuses")  # fmt: skip
    for r in runs:
        statuses = ",".join(
            f"{row['status']}" + (f"({row['param']})" if row.get("param") else "")
            for row in r["responses"][:1]
        )
        print(
            f"{r['scenario']:12s} {r['concurrency']:3d} {r['prompts']:7d} "
            f"{r['idle_rss_mib']:9d} {r['peak_above_idle_mib']:10d} {r['wall_s']:7.1f}  "
            f"{statuses}{' ...' if len(r['responses']) > 1 else ''}"
        )
    print(f"worst peak above idle: {worst} MiB (target < 1024)")
    return {
        "benchmark": "request_memory",
        "model": defaults.model,
        "limits": {
            "max_passages": defaults.max_passages,
            "max_passage_chars": defaults.max_passage_chars,
            "max_prompts_per_request": defaults.max_prompts_per_request,
            "max_prompt_tokens_x_prompts": defaults.max_prompt_tokens_x_prompts,
            "max_prompt_chars_x_prompts": defaults.max_prompt_chars_x_prompts,
            "unmeasured_inflight_prompt_tokens": defaults.unmeasured_inflight_prompt_tokens,
        },
        "target_mib": 1024,
        "worst_peak_above_idle_mib": worst,
        "runs": runs,
        "provenance": report.provenance(),
    }


def main() -> int:
    ap = report.parser("request_memory", __doc__)
    ap.add_argument("--concurrency", default="1,8", help="requests sent at once, per run")
    ap.add_argument("--scenarios", default="", help="comma-separated subset (default: all)")
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
