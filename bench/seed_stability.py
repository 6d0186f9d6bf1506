"""How reproducible is MoI's ranking across design seeds, and does spending more prompts fix it?

bench/dtype_fidelity.py found that two draws of the default design (pruned_random, 2N prompts)
rank SmolLM2's passages at Kendall tau 0.36 median. This measures, per prompt budget M: two
designs drawn with different seeds for each question, each scored and fitted on its first M
prompts (a balanced pruned design is built greedily row by row, so its first M rows are the
design ``plan`` would draw for M), and reports how far the two fits agree (rank tau, same top
passage, same order), how often each top passage is the gold one, and whether the response's
own confidence says so: the median ``confidence[0]`` (probability that the top passage beats
the second) for questions whose two draws agreed on the top and for those that did not, from
the delta method and from the jackknife (the service's default) on the same fits.

Passages: by default as ``rag-reorder eval`` cuts them (``--selection eval``: the gold passage
kept among ``--passages``); ``--selection first`` takes the first ``--passages`` as they come,
which on NQ-Open dev mostly leaves the gold passage out (a retriever miss: every passage a
distractor).

Usage: python -m bench.seed_stability [--queries 8] [--passages 10] [--budgets 20,40,60]
       [--selection eval|first] [--out results/bench/seed_stability.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

import solver
from bench import report
from bench.dtype_fidelity import agreement
from bench.report import provenance
from offline.evaluation.runner import prepare
from service.backends.base import SpanLogprobs
from service.backends.engines.transformers_backend import TransformersBackend
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.prompting.prompts import build_prompts

SEEDS = (0, 1000)  # design seed = SEED + question index


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    backend = TransformersBackend.from_settings(settings)
    budgets = sorted(int(b) for b in args.budgets.split(","))
    examples = load_examples(Path(args.data), limit=args.queries)
    per_question = []
    t0 = time.perf_counter()
    tokens = 0
    gold_shown = 0
    for k, ex in enumerate(examples):
        if args.selection == "eval":
            q = prepare(ex, args.passages)
            passages, gold = q.passages, tuple(q.gold)
        else:
            passages = ex.passages[: args.passages]
            gold = tuple(g for g in ex.gold if g < args.passages)
        gold_shown += bool(gold)
        n = len(passages)
        draws = []
        for base in SEEDS:
            perms = solver.plan("pruned_random", n, num_prompts=budgets[-1], seed=base + k)
            orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
            prompts = build_prompts(
                backend.tokenizer, settings.chat_template, ex.question, passages, orders
            )
            requests = [p.span_request(f"s{base}-q{k}-{i}") for i, p in enumerate(prompts)]
            tokens += sum(len(r.token_ids) for r in requests)
            got = await backend.score(requests)
            if not all(isinstance(g, SpanLogprobs) for g in got):
                raise RuntimeError(f"question {k}: a prompt failed to score")
            draws.append((perms, np.asarray([sum(cast(SpanLogprobs, g).logprobs) for g in got])))
        fits = {
            m: [solver.fit(perms[:m], s[:m], n_passages=n) for perms, s in draws] for m in budgets
        }
        # The same fits' confidences from the jackknife (the service's default estimate).
        jack = {
            m: [
                solver.fit(perms[:m], s[:m], n_passages=n, variance="jackknife")
                for perms, s in draws
            ]
            for m in budgets
        }
        per_question.append((gold, fits, jack))
        print(f"question {k + 1}/{len(examples)} scored", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0

    rows = []
    for m in budgets:
        a = [fits[m][0] for _, fits, _ in per_question]
        b = [fits[m][1] for _, fits, _ in per_question]
        a_jack = [jack[m][0] for _, _, jack in per_question]
        golds = [gold for gold, _, _ in per_question]
        agree = [f.order[0] == g.order[0] for f, g in zip(a, b, strict=True)]
        conf = [
            float(f.confidence[0])
            for f in a
            if f.confidence is not None and np.isfinite(f.confidence[0])
        ]
        conf_agree = [
            float(f.confidence[0])
            for f, same in zip(a, agree, strict=True)
            if same and f.confidence is not None
        ]
        conf_differ = [
            float(f.confidence[0])
            for f, same in zip(a, agree, strict=True)
            if not same and f.confidence is not None
        ]
        jack_differ = [
            float(f.confidence[0])
            for f, same in zip(a_jack, agree, strict=True)
            if not same and f.confidence is not None
        ]
        jack_agree = [
            float(f.confidence[0])
            for f, same in zip(a_jack, agree, strict=True)
            if same and f.confidence is not None
        ]
        row = {
            "num_prompts": m,
            **agreement(a, b),
            "top_is_gold": statistics.mean(
                [f.order[0] in g for f, g in zip(a, golds, strict=True)]
                + [f.order[0] in g for f, g in zip(b, golds, strict=True)]
            ),
            "median_top_confidence": _median(conf),
            "median_top_confidence_when_tops_agree": _median(conf_agree),
            "median_top_confidence_when_tops_differ": _median(conf_differ),
            "jackknife_median_top_confidence_when_tops_agree": _median(jack_agree),
            "jackknife_median_top_confidence_when_tops_differ": _median(jack_differ),
        }
        rows.append(row)
        print(
            f"M={m:>3}: Kendall tau median {row['median_kendall_tau']:.3f} min "
            f"{row['min_kendall_tau']:.3f}, same top {row['same_top_passage']:.2f}, same order "
            f"{row['same_order']:.2f}, top is gold {row['top_is_gold']:.2f}, top confidence "
            f"median {row['median_top_confidence']} (tops agree "
            f"{row['median_top_confidence_when_tops_agree']}, differ "
            f"{row['median_top_confidence_when_tops_differ']}; jackknife agree "
            f"{row['jackknife_median_top_confidence_when_tops_agree']}, differ "
            f"{row['jackknife_median_top_confidence_when_tops_differ']})"
        )
    return {
        **provenance(),
        "device": backend.device,
        "model": backend.model_id,
        "design": "pruned_random",
        "passages": args.passages,
        "selection": args.selection,
        "questions_with_gold_shown": gold_shown,
        "questions": len(per_question),
        "seeds": list(SEEDS),
        "prompt_tokens": tokens,
        "seconds": seconds,
        "rows": rows,
    }


def main() -> int:
    ap = report.parser("seed_stability", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--budgets", default="20,40,60", help="prompt counts M to compare")
    ap.add_argument("--selection", choices=("eval", "first"), default="eval")
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
