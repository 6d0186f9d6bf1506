"""Admission control: concurrent requests, prompt tokens in flight, and each request's deadline.

Scoring with prompt log-probs prefills every permutation in full and cannot share a prefix
cache (docs/operations.md), so the cost of a request is the sum of its prompts' tokens, known only
after tokenising. The per-request check (422) and the shared checks (503 + Retry-After) are
applied at that point, by wrapping the backend the request's ``Reorderer`` scores with.

Deadline-aware (issue 44): once the engine's throughput is measured (``ThroughputMeter``, from
the calls admitted here), a call is admitted only if the prompt tokens already admitted ahead
of it plus its own, at that rate, fit in 90% of what is left of its request's deadline. Otherwise it
is refused at once with 503 and a ``Retry-After`` from the same estimate, instead of queueing
for a 504 after the engine has spent its time on it. The rate is seeded by the warm-up probe
(``Admission.seed``); until it is measured, ``unmeasured_inflight_prompt_tokens`` caps the
tokens in flight, so a queue waiting at start is not all admitted at once (issue 54). One call
is always admitted when none is in flight (a wrong estimate cannot starve an idle engine).
``max_inflight_prompt_tokens``, when set, stays as a hard cap beside it.

A request's size is bounded before its prompts exist (issue 54): the characters it has
rendered into prompts, summed over them, are charged to ``max_prompt_chars_x_prompts`` as
each prompt is about to be rendered (``AdmittedBackend.tokenizer``), so a request that could
never fit is refused before it is tokenised, not after its gigabytes of token ids exist.
Admission runs on the event loop thread: plain counters, no locks. A request's characters
are counted where its prompts are built, in worker threads, under a lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from app.exceptions import Overloaded
from app.metrics import ServiceMetrics
from service.backends.base import (
    ChatMessage,
    Encoding,
    GenerateResult,
    GenerationRequest,
    LogprobBackend,
    PromptTokenizer,
    ScoreResult,
    SpanRequest,
)
from service.capacity import ThroughputMeter
from service.errors import LimitExceeded
from service.settings import Settings

# Admit only what the estimate says ends within 90% of the time left: under overload the engine
# runs a little slower than when its rate was measured (shedding, HTTP and tokenising share
# its cores), and without the margin 2 of the 19 requests admitted at 3x capacity missed their
# deadline by that little (bench/results/overload_no_headroom.md).
_HEADROOM = 0.9


class Admission:
    """Counts admitted requests and their prompt tokens against the budgets and deadlines."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._requests = 0
        self._tokens = 0
        self.meter = ThroughputMeter()
        """The engine's prompt tokens per second, measured from the calls admitted here."""

    @property
    def in_flight(self) -> int:
        return self._requests

    @property
    def tokens_in_flight(self) -> int:
        return self._tokens

    def seed(self, tokens: int, seconds: float) -> None:
        """Seed the engine's rate with a call made outside admission (the warm-up probe: its
        prompt tokens and seconds in the model), so deadline-aware admission works from the
        first request; ignored once an admitted call has completed (``ThroughputMeter.seed``)."""
        self.meter.seed(tokens, seconds)

    @property
    def estimated_wait_s(self) -> float | None:
        """Seconds the engine needs for the tokens admitted now (``None``: rate not yet
        measured): what a new request would queue behind."""
        return self.meter.seconds_for(self._tokens)

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
    def tokens(self, n: int, deadline: float | None = None) -> Iterator[None]:
        """Reserve ``n`` prompt tokens while they are scored, or raise ``Overloaded``.

        Args:
            n: the call's prompt tokens (generation: prefilled plus answer budget).
            deadline: ``time.monotonic()`` by which the call's request must be answered;
                ``None``: no deadline check.

        A call is always admitted when nothing else is in flight: its own size is bounded by
        ``max_prompt_tokens_x_prompts``, so no budget or estimate can starve it.
        """
        now = time.monotonic()
        if self._tokens:
            self._check_deadline(n, deadline, now)
            budget = self._settings.max_inflight_prompt_tokens
            if budget is not None and self._tokens + n > budget:
                self._metrics.admission_rejections.labels("token_budget").inc()
                raise Overloaded(
                    f"{n} prompt tokens do not fit the in-flight budget ({self._tokens} of "
                    f"{budget} in use)"
                )
            unmeasured = self._settings.unmeasured_inflight_prompt_tokens
            if self.meter.tokens_per_s is None and self._tokens + n > unmeasured:
                self._metrics.admission_rejections.labels("token_budget").inc()
                raise Overloaded(
                    f"{n} prompt tokens do not fit the in-flight budget while the engine's "
                    f"rate is not yet measured ({self._tokens} of {unmeasured} in use)"
                )
        self._tokens += n
        self.meter.begin(now)
        self._metrics.inflight_prompt_tokens.set(self._tokens)
        done: int | None = None
        try:
            yield
            done = n
        finally:
            self._tokens -= n
            self.meter.end(time.monotonic(), done)
            self._metrics.inflight_prompt_tokens.set(self._tokens)

    def _check_deadline(self, n: int, deadline: float | None, now: float) -> None:
        """``Overloaded`` (reason ``deadline``) if the tokens ahead plus ``n`` cannot be done
        by ``deadline`` at the measured rate; its Retry-After is when they could be."""
        rate = self.meter.tokens_per_s
        if deadline is None or rate is None:
            return
        wait_s = self._tokens / rate
        own_s = n / rate
        left_s = deadline - now
        if wait_s + own_s <= _HEADROOM * left_s:
            return
        self._metrics.admission_rejections.labels("deadline").inc()
        # Retried, it fits once the queue ahead has shrunk to what a fresh deadline leaves
        # beside its own work; a call longer than a deadline only once the engine is idle.
        timeout = _HEADROOM * self._settings.request_timeout_s
        ahead_s = wait_s + own_s - timeout if own_s < timeout else wait_s
        retry = max(1, math.ceil(ahead_s))
        raise Overloaded(
            f"the {self._tokens} prompt tokens queued ahead (about {wait_s:.1f} s at the "
            f"measured {rate:.0f} tokens/s) and this request's {n} (about {own_s:.1f} s) "
            f"would not finish within its deadline ({max(left_s, 0.0):.1f} s left)",
            retry_after_s=retry,
        )


class AdmittedBackend:
    """The process's backend as one request sees it: its limits checked, its tokens admitted.

    Built per request (cheap); closing it does not close the shared backend.
    """

    def __init__(
        self,
        inner: LogprobBackend,
        admission: Admission,
        settings: Settings,
        *,
        deadline: float | None = None,
    ) -> None:
        """Args:
        inner: the shared backend.
        admission: the service's admission.
        settings: the limits.
        deadline: ``time.monotonic()`` by which the request must be answered (admission
            refuses a call that would not finish by then); ``None``: not checked.
        """
        self._inner = inner
        self._admission = admission
        self._settings = settings
        self._deadline = deadline
        self._sent_tokens = 0  # prompt tokens this request sent so far, scored or generated
        self._tokenizer: _ChargedTokenizer | None = None

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def max_model_len(self) -> int:
        return self._inner.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        """The backend's tokenizer, charging what this request renders into prompts to its
        ``max_prompt_chars_x_prompts`` before each prompt is rendered (422 over it)."""
        if self._tokenizer is None:
            self._tokenizer = _ChargedTokenizer(
                self._inner.tokenizer, self._settings.max_prompt_chars_x_prompts
            )
        return self._tokenizer

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Check the request's limits (422), admit its tokens (503), then score.

        Raises:
            LimitExceeded: too many distinct prompts, or prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full, or the call would not finish
                before the request's deadline.
        """
        n = len(requests)
        max_prompts = self._settings.max_prompts_per_request
        if n > max_prompts:
            raise LimitExceeded(
                "design.num_prompts", max_prompts, n, what="distinct prompts to score"
            )
        tokens = sum(len(r.token_ids) for r in requests)
        self._count_prompt_tokens(tokens, n)
        with self._admission.tokens(tokens, self._deadline):
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
        with self._admission.tokens(tokens, self._deadline):
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


class _ChargedTokenizer:
    """A backend's tokenizer as one request sees it: the characters of each prompt it is asked
    to render are added to the request's total, and a total over ``limit`` is refused
    (``LimitExceeded``, 422) before that prompt is rendered or anything is tokenised.

    Characters, not tokens: tokens exist only after tokenising, which is what costs the memory
    (about 300 bytes a token while a batch is encoded, up to 3 tokens a character), so the
    prompts x tokens check comes too late to bound it. Prompt building runs in worker
    threads, hence the lock.
    """

    def __init__(self, inner: PromptTokenizer, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        self._chars = 0
        self._lock = threading.Lock()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._inner.eos_token_ids

    @property
    def line_break_ids(self) -> frozenset[int]:
        return self._inner.line_break_ids

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        self._charge(sum(len(m.content) for m in messages))
        return self._inner.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def render_completion(self, text: str) -> str:
        self._charge(len(text))
        return self._inner.render_completion(text)

    def encode(self, text: str) -> Encoding:
        return self._inner.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        return self._inner.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)

    def _charge(self, chars: int) -> None:
        with self._lock:
            total = self._chars + chars
            if total > self._limit:
                raise LimitExceeded(
                    "prompt_chars_x_prompts",
                    self._limit,
                    total,
                    what=_CHARS_WHAT,
                )
            self._chars = total


_CHARS_WHAT: Final = (
    "characters of passages, titles, query and template text summed over the request's "
    "prompts so far; send fewer or shorter passages or fewer prompts"
)
