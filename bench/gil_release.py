"""Does the service's CPU work let the event loop run beside it? (issue 57)

A Python loop counts on the main thread for a second while a thread repeats one kind of work;
its speed against the loop alone says how much of the time that work holds the GIL (about
0.5x or less: holds it, as pure Python does; about 1x: releases it, as a sleep does). The work:
encoding a batch of scoring-prompt texts through the Rust tokenizer directly (what
``HFPromptTokenizer.encode_batch`` calls) and through transformers' ``__call__`` (what it called
before), and a jackknifed MoI fit (numpy/scipy on small arrays). The embedded SmolLM2
tokenizer, its own Rust parallelism off so one thread is one core.

    python -m bench.gil_release [--out results/bench/gil_release.json]
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import solver
from bench.report import provenance
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from service.config.settings import Settings
from service.model_assets import resolve_model


def spin(seconds: float) -> int:
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        n += 1
    return n


def beside(work: Callable[[], object], seconds: float = 1.0) -> int:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        return spin(seconds)
    finally:
        stop.set()
        thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gil_release", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/nq_open_dev.jsonl")
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    settings = Settings()
    tok = load_prompt_tokenizer(resolve_model(settings), name=settings.model)
    hf = tok.hf_tokenizer
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[:8]]
    texts = [
        " ".join(p.get("title", "") + " " + p["text"] for p in r["passages"][:5]) for r in rows
    ] * 3
    perms = solver.plan("pruned_random", 10, seed=0)
    scores = np.random.default_rng(0).normal(size=perms.shape[0])

    def pure_python() -> None:
        total = 0
        for i in range(200_000):
            total += i

    works: dict[str, Callable[[], object]] = {
        "pure Python (holds the GIL)": pure_python,
        "sleep (releases it)": lambda: time.sleep(0.01),
        "Rust tokenizer, encode_batch": lambda: hf.backend_tokenizer.encode_batch(
            texts, add_special_tokens=False
        ),
        "transformers tokenizer __call__": lambda: hf(
            texts, return_offsets_mapping=True, add_special_tokens=False
        ),
        "MoI fit with jackknife (N = 10)": lambda: solver.fit(perms, scores, n_passages=10),
    }
    result: dict[str, list[float]] = {name: [] for name in works}
    for _ in range(args.repeats):
        alone = spin(1.0)
        for name, work in works.items():
            result[name].append(beside(work) / alone)
    summary = {name: float(np.median(v)) for name, v in result.items()}
    for name, ratio in summary.items():
        print(f"{ratio:5.2f}x  the loop's speed beside: {name}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"provenance": provenance(), "median_ratio": summary, "runs": result}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
