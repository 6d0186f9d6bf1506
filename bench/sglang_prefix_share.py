"""How much of a MoI request's prompt tokens SGLang's radix cache may reuse (issue 94).

SGLang reuses a cached prefix of a prompt that asks for log-probs up to its
``logprob_start_len`` (``schedule_batch.py`` ``_compute_max_prefix_len``); the SGLang dialect
asks from the token before each span. This takes the prompts the default design plans for
one request (SmolLM2's tokenizer, the default template) in the order they are planned and
counts, for each, the tokens before its span that an earlier prompt of the same request
already holds: what a warm cache, not evicted in between, can skip. An upper bound on one
request's hits: SGLang reports the real ones per prompt (``meta_info.cached_tokens``).
vLLM computes prompt log-probs without its prefix cache, so there the share is 0.

    .venv/bin/python -m bench.sglang_prefix_share --passages 4 10
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
from collections.abc import Sequence
from typing import Any

from bench import report
from service.backends.base import SpanRequest
from service.backends.engines.transformers_backend import TransformersBackend
from service.config.settings import Settings
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest
from tests.support.models import cache_dir_for_tests, embedded_model_dir

QUERY = "Which river flows through Vienna?"
TEXTS = [
    "The Danube flows through Vienna, Bratislava and Budapest.",
    "The Rhine rises in the Swiss Alps.",
    "Vienna is the capital of Austria.",
    "The Seine flows through Paris.",
]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


def share(prompts: Sequence[SpanRequest]) -> dict[str, int]:
    """Prompt tokens, those before the spans, and those an earlier prompt already holds."""
    seen: list[tuple[int, ...]] = []
    reusable = 0
    for r in prompts:
        ids = r.token_ids[: r.span_end]
        best = max((_common(old, ids) for old in seen), default=0)
        reusable += min(best, r.span_start - 1, len(ids) - 1)
        seen.append(ids)
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(r.span_end for r in prompts),
        "before_spans": sum(r.span_start - 1 for r in prompts),
        "reusable": reusable,
    }


async def planned(local: TransformersBackend, passages: int) -> list[SpanRequest]:
    captured: list[SpanRequest] = []

    class Recorder:
        model_id = local.model_id
        max_model_len = local.max_model_len
        tokenizer = local.tokenizer

        async def score(self, requests: Any) -> Any:
            captured.extend(requests)
            return await local.score(requests)

        async def generate(self, requests: Any) -> Any:
            return await local.generate(requests)

        async def aclose(self) -> None:
            return None

    docs = [Passage(text=f"{TEXTS[i % len(TEXTS)]} (source {i})") for i in range(passages)]
    settings = Settings(cache_dir=cache_dir_for_tests())
    await Reorderer(Recorder(), settings).reorder(ReorderRequest(QUERY, docs))  # type: ignore[arg-type]
    return captured


def build_parser() -> argparse.ArgumentParser:
    ap = report.parser("sglang_prefix_share", __doc__)
    ap.add_argument("--passages", type=int, nargs="+", default=[4, 10])
    return ap


async def run(args: argparse.Namespace) -> report.Result:
    local = TransformersBackend.load(embedded_model_dir(), device="cpu")
    rows: list[dict[str, Any]] = []
    for n in args.passages:
        s = share(await planned(local, n))
        pct = 100 * s["reusable"] / s["prompt_tokens"]
        print(f"passages={n} " + " ".join(f"{k}={v}" for k, v in s.items()) + f" ({pct:.1f}%)")
        rows.append({"passages": n, **s, "reusable_pct": round(pct, 1)})
    await local.aclose()
    return {**report.provenance(), "requests": rows}


if __name__ == "__main__":
    raise SystemExit(report.main(build_parser(), run))
