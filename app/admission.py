"""Admission control: concurrent requests and prompt tokens in flight (prompts x tokens).

Scoring with prompt log-probs prefills every permutation in full and cannot share a prefix
cache (RELIABILITY.md), so the cost of a request is the sum of its prompts' tokens, known only
after tokenising. The per-request check (422) and the shared budget (503 + Retry-After) are
applied at that point, by wrapping the backend the request's ``Reorderer`` scores with.
Everything here runs on the event loop thread: plain counters, no locks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from app.exceptions import Overloaded
from app.metrics import ServiceMetrics
from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    LogprobBackend,
    PromptTokenizer,
    ScoreResult,
    SpanRequest,
)
from service.errors import LimitExceeded
from service.settings import Settings


class Admission:
    """Counts admitted requests and their prompt tokens against the configured budgets."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._requests = 0
        self._tokens = 0

    @property
    def in_flight(self) -> int:
        return self._requests

    @property
    def tokens_in_flight(self) -> int:
        return self._tokens

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request slot, or ``Overloaded`` when ``max_concurrent_requests`` are taken."""
        limit = self._settings.max_concurrent_requests
        if self._requests >= limit:
            self._metrics.admission_rejections.labels("concurrency").inc()
            raise Overloaded(f"{self._requests} requests in flight, the limit is {limit}")
        self._requests += 1
        self._metrics.in_flight.set(self._requests)
        try:
            yield
        finally:
            self._requests -= 1
            self._metrics.in_flight.set(self._requests)

    @contextmanager
    def tokens(self, n: int) -> Iterator[None]:
        """Reserve ``n`` prompt tokens while they are scored, or raise ``Overloaded``.

        A request is always admitted when nothing else is being scored: its own size is
        bounded by ``max_prompt_tokens_x_prompts``, so a budget set below that cannot starve it.
        """
        budget = self._settings.max_inflight_prompt_tokens
        if self._tokens and self._tokens + n > budget:
            self._metrics.admission_rejections.labels("token_budget").inc()
            raise Overloaded(
                f"{n} prompt tokens do not fit the in-flight budget ({self._tokens} of {budget} "
                "in use)"
            )
        self._tokens += n
        self._metrics.inflight_prompt_tokens.set(self._tokens)
        try:
            yield
        finally:
            self._tokens -= n
            self._metrics.inflight_prompt_tokens.set(self._tokens)


class AdmittedBackend:
    """The process's backend as one request sees it: its limits checked, its tokens admitted.

    Built per request (cheap); closing it does not close the shared backend.
    """

    def __init__(self, inner: LogprobBackend, admission: Admission, settings: Settings) -> None:
        self._inner = inner
        self._admission = admission
        self._settings = settings
        self._sent_tokens = 0  # prompt tokens this request sent so far, scored or generated

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def max_model_len(self) -> int:
        return self._inner.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._inner.tokenizer

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Check the request's limits (422), admit its tokens (503), then score.

        Raises:
            LimitExceeded: too many distinct prompts, or prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full.
        """
        n = len(requests)
        max_prompts = self._settings.max_prompts_per_request
        if n > max_prompts:
            raise LimitExceeded(
                "design.num_prompts", max_prompts, n, what="distinct prompts to score"
            )
        tokens = sum(len(r.token_ids) for r in requests)
        self._count_prompt_tokens(tokens, n)
        with self._admission.tokens(tokens):
            return await self._inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Check the request's prompts x tokens limit (422), admit the prompts' tokens plus
        their answer budgets (503), then generate. A prompt's score ids are prefilled with
        it, so they count as its tokens.

        Raises:
            LimitExceeded: prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full.
        """
        prefilled = sum(len(r.token_ids) + len(r.score_ids) for r in requests)
        self._count_prompt_tokens(prefilled, len(requests))
        tokens = prefilled + sum(r.max_new_tokens for r in requests)
        with self._admission.tokens(tokens):
            return await self._inner.generate(requests)

    def _count_prompt_tokens(self, tokens: int, n: int) -> None:
        """Add a call's prompt tokens to the request's total; 422 over the limit.

        The limit is per request, not per call: generating prompts (lore, self_consistency)
        prefill like scored ones, and a strategy with several model calls must not get the
        limit once per call.
        """
        total = self._sent_tokens + tokens
        max_tokens = self._settings.max_prompt_tokens_x_prompts
        if total > max_tokens:
            raise LimitExceeded(
                "prompt_tokens_x_prompts",
                max_tokens,
                total,
                what=f"summed over the request's prompts ({n} in this call); send fewer or "
                "shorter passages or fewer prompts",
            )
        self._sent_tokens = total

    async def aclose(self) -> None:
        """Nothing to do: the lifespan owns and closes the shared backend."""
