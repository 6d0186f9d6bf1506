"""The workload the load and overload benchmarks share: their request bodies from the
development questions, and the offline ceiling (the same requests' prompts through the
backend alone, captured by running the pipeline on a recording backend).

A module of its own so that ``bench/load.py`` (which runs ``bench/overload.py`` for
``--overload``) and ``bench/overload.py`` import it, not each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    PromptTokenizer,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
)
from service.config.settings import Settings
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest


def load_requests(data: Path, queries: int, passages: Sequence[int]) -> list[dict[str, Any]]:
    """Request bodies: each of the first ``queries`` questions with each passage count."""
    rows = [json.loads(line) for line in data.read_text().splitlines()[:queries]]
    return [
        {
            "query": row["question"],
            "passages": [f"{p['title']}: {p['text']}" for p in row["passages"][:n]],
            # MoI by name: this measures the engine under load, and the default (auto) stops
            # calling it once a trusted profile is in the folder. Its pruned random design by
            # name: planned up front, so capture_prompts sees the server's very prompts (the
            # adaptive default's later rounds depend on the scores).
            "strategy": "moi",
            "design": {"kind": "pruned_random"},
        }
        for n in passages
        for row in rows
    ]


class RecordingBackend:
    """Delegates the tokenizer and limits to a real backend; records prompts, scores -1."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.prompts: list[SpanRequest] = []

    @property
    def model_id(self) -> str:
        return str(self.real.model_id)

    @property
    def max_model_len(self) -> int:
        return int(self.real.max_model_len)

    @property
    def tokenizer(self) -> PromptTokenizer:
        tok: PromptTokenizer = self.real.tokenizer
        return tok

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.prompts.extend(requests)
        # Slightly different per prompt, so the fit has something to fit.
        return [
            SpanLogprobs(
                r.request_id, tuple(-1.0 - 0.01 * (k % 7) for k in range(r.span_end - r.span_start))
            )
            for r in requests
        ]

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        raise NotImplementedError("the default design does not generate")

    async def aclose(self) -> None:
        return None


async def capture_prompts(backend: Any, bodies: list[dict[str, Any]]) -> list[SpanRequest]:
    settings = Settings()
    prompts: list[SpanRequest] = []
    for k, body in enumerate(bodies):
        recorder = RecordingBackend(backend)
        request = ReorderRequest(
            body["query"],
            [Passage(text=p) for p in body["passages"]],
            design=DesignSpec(kind=body["design"]["kind"]),
        )
        await Reorderer(recorder, settings).reorder(request)  # type: ignore[arg-type]
        prompts.extend(
            SpanRequest(f"{k}-{i}", r.token_ids, r.span_start, r.span_end)
            for i, r in enumerate(recorder.prompts)
        )
    return prompts


async def ceiling(backend: Any, prompts: list[SpanRequest], repeat: int) -> dict[str, Any]:
    """Every prompt of one cycle of requests through ``backend.score`` as one stream,
    ``repeat`` times; tokens/s of the whole."""
    tokens = sum(len(p.token_ids) for p in prompts) * repeat
    t = time.perf_counter()
    for _ in range(repeat):
        results = await backend.score(prompts)
    wall = time.perf_counter() - t
    failed = sum(not isinstance(r, SpanLogprobs) for r in results)
    row = {
        "prompts": len(prompts) * repeat,
        "prompt_tokens": tokens,
        "wall_s": wall,
        "prompt_tokens_per_s": tokens / wall,
        "failed": failed,
    }
    print(
        f"offline ceiling: {len(prompts) * repeat} prompts, {tokens} tokens, "
        f"{wall:.1f} s, {tokens / wall:.0f} prompt tok/s",
        flush=True,
    )
    return row
