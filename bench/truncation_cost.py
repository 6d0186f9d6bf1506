"""Opt-in truncation's cost (issue 94, item 4): the per-passage token limit's tokenisation for
a 100-passage request of long passages, with SmolLM2's tokenizer (no model is loaded).

Three cases of ``service.prompting.truncation.fit_passages`` on the same request:
``refuse`` (the default: stops at the first passage over the limit, here the first chunk),
``truncate`` (every passage over the limit, cut and checked), and ``pre_cut`` (the caller sent
the cut texts itself: the check tokenises them and cuts nothing). The median of ``--repeats``
runs each, alternating.

Usage: python -m bench.truncation_cost [--passages 100] [--chars 8000] [--limit 256]
       [--repeats 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import time

from bench import report
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from service.errors import LimitExceeded
from service.passage import Passage
from service.prompting.truncation import fit_passages
from tests.support.models import embedded_model_dir

PROSE = (
    "The river Loire rises in the Massif Central and flows north, then west, for about a "
    "thousand kilometres to the Atlantic at Saint-Nazaire. Its valley holds the chateaux of "
    "Chambord and Chenonceau, and its floods, fed by the autumn storms, have shaped the towns "
    "along it since Roman times. "
)


def build_parser() -> argparse.ArgumentParser:
    ap = report.parser("truncation_cost", __doc__)
    ap.add_argument("--passages", type=int, default=100)
    ap.add_argument("--chars", type=int, default=8000)
    ap.add_argument("--limit", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    return ap


def run(args: argparse.Namespace) -> report.Result:
    tokenizer = load_prompt_tokenizer(embedded_model_dir(), name="smollm2")
    # Distinct texts (a number in each), so no tokenizer cache flatters the figure.
    passages = [
        Passage(f"Passage {i}. " + (PROSE * (args.chars // len(PROSE) + 1))[: args.chars])
        for i in range(args.passages)
    ]
    cut, cuts = fit_passages(tokenizer, passages, args.limit, truncate=True)
    tokens = sum(c.tokens for c in cuts)

    def refuse() -> None:
        try:
            fit_passages(tokenizer, passages, args.limit, truncate=False)
        except LimitExceeded:
            return
        raise AssertionError("not refused")

    cases = {
        "refuse": refuse,
        "truncate": lambda: fit_passages(tokenizer, passages, args.limit, truncate=True),
        "pre_cut": lambda: fit_passages(tokenizer, cut, args.limit, truncate=True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeats):
        for name in list(cases)[r % 3 :] + list(cases)[: r % 3]:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    print(
        f"{args.passages} passages of {args.chars} characters ({tokens} tokens, "
        f"{len(cuts)} cut to {args.limit}), SmolLM2 tokenizer, {os.cpu_count()} CPUs, "
        f"median of {args.repeats}:"
    )
    for name, ts in times.items():
        print(f"  {name:9s} {statistics.median(ts) * 1000:8.1f} ms")
    return {
        **report.provenance(),
        "passages": args.passages,
        "chars": args.chars,
        "limit": args.limit,
        "tokens": tokens,
        "cut": len(cuts),
        "repeats": args.repeats,
        "median_ms": {name: statistics.median(ts) * 1000 for name, ts in times.items()},
    }


if __name__ == "__main__":
    raise SystemExit(report.main(build_parser(), run))
