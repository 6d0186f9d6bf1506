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

Whole requests (issue 62): before its first prompt is built, a request's strategy states its
model calls (``Cost``) and ``Work.admit`` estimates their prompt tokens and answer budget;
``Admission.reserve`` checks the whole estimate at the measured prefill and decode rates. A
request whose own work does not fit its deadline even on an idle engine is refused at once
with 422 ``deadline_unreachable`` naming the estimate, the deadline and what would fit, once
the rates come from real calls (a warm-up seed alone is too rough to refuse for good: such a
request is admitted when the engine idles, as before). One that does not fit behind the queue
gets 503 + Retry-After. An admitted request's estimate stays reserved in the tokens in flight,
so newer arrivals queue behind it, and its calls draw on the reservation without being
checked again: admitted means expected to finish. Calls of work not admitted as a whole are
checked one by one, as before.

Estimates heal (issue 70): a refusal for good needs a confirmed rate
(``ThroughputMeter.confirmed``: several recent calls, not contradicted by the newest call that
ran alone) and work over the deadline even at the fastest rate the engine recently showed.
Work over its deadline on a rate in doubt is admitted when the engine is idle (its calls
re-measure: the rule single calls always had), and gets 503 + Retry-After behind others.
Every refusal or doubt asks for a re-measurement (``remeasure``): the server's rate canary
then scores a small batch as soon as the engine is idle. Calls the service makes for itself
(that canary, ``auto``'s background runs) are timed into the meter (``measured``) without
holding a place in the queue.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from service.config.settings import Settings
from service.errors import DeadlineUnreachable, LimitExceeded
from service.runtime.throughput import FRESH_S, ThroughputMeter
from service.strategies.request import Estimate

# Admit only what the estimate says ends within 90% of the time left: under overload the engine
# runs a little slower than when its rate was measured (shedding, HTTP and tokenising share
# its cores), and without the margin 2 of the 19 requests admitted at 3x capacity missed their
# deadline by that little (bench/results/overload_no_headroom.md).
_HEADROOM = 0.9
_MIN_DECODE = 2
"""Generations measured before an answer budget may be refused for good (a 422)."""


@dataclass
class Reservation:
    """What is left of an admitted request's estimate: tokens its calls have not yet taken."""

    tokens: int
    """Prompt tokens plus answer budget, as the in-flight budget counts them."""
    new_tokens: int
    """The answer-budget part of ``tokens``."""
    estimated_s: float | None
    """The request's own seconds on an idle engine, at the rates when it was admitted."""


class Admission:
    """Counts admitted requests and their prompt tokens against the budgets and deadlines."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._requests = 0
        self._tokens = 0
        self._new_tokens = 0  # the answer-budget part of ``_tokens`` (decode, not prefill)
        self.meter = ThroughputMeter()
        """The engine's prompt tokens per second, measured from the calls admitted here."""
        self.remeasure_wanted: str | None = None
        """Why the rate should be measured again (``None``: it need not); cleared by the
        rate canary (``app.main``) once it has run."""
        self.on_remeasure: Callable[[], None] | None = None
        """Set by the server: wakes the rate canary."""

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
        self.meter.seed(tokens, seconds, time.monotonic())

    @property
    def estimated_wait_s(self) -> float | None:
        """Seconds the engine needs for the tokens admitted now (``None``: rate not yet
        measured): what a new request would queue behind."""
        return self.meter.seconds_for(self._tokens - self._new_tokens, self._new_tokens)

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

    def reserve(
        self,
        estimate: Estimate,
        deadline: float | None,
        *,
        timeout_s: float,
        timeout_name: str = "request_timeout_s",
    ) -> Reservation:
        """Admit a request's whole estimated work, reserving it in the tokens in flight, or
        raise (module docstring). Release what is left with ``release``.

        Args:
            estimate: the request's prompt tokens and answer budget.
            deadline: ``time.monotonic()`` by which it must be answered; ``None``: the
                deadline is not checked.
            timeout_s: the whole deadline's length (what an idle engine would have).
            timeout_name: the setting that sets it, named in a refusal.

        Raises:
            DeadlineUnreachable: it cannot finish by its deadline even on an idle engine.
            Overloaded: the queue ahead, the token budget or the unmeasured cap.
        """
        n = estimate.prompt_tokens + estimate.new_tokens
        now = time.monotonic()
        own_s = self.meter.seconds_for(estimate.prompt_tokens, estimate.new_tokens)
        usable = _HEADROOM * timeout_s
        if own_s is not None and deadline is not None and own_s > usable:
            # Over the deadline alone. For good (422) only on a confirmed rate, and only if
            # even the fastest the engine has recently shown cannot fit it; else it is the
            # estimate that is in doubt: admitted on an idle engine (its calls re-measure),
            # 503 behind others, and either way a re-measurement is asked for.
            best_s = self.meter.best_seconds_for(now, estimate.prompt_tokens, estimate.new_tokens)
            decode_ok = estimate.new_tokens == 0 or self.meter.decode_completed >= _MIN_DECODE
            if self.meter.confirmed(now) and decode_ok and best_s is not None and best_s > usable:
                self._metrics.admission_rejections.labels("unreachable").inc()
                self.remeasure("refused")
                raise _unreachable(estimate, best_s, self.meter, now, timeout_s, timeout_name)
            self.remeasure("doubted")
            if self._tokens:
                self._metrics.admission_rejections.labels("deadline").inc()
                wait_s = self.estimated_wait_s or 0.0
                raise Overloaded(
                    f"this request's {estimate.prompts} model calls are estimated at "
                    f"{own_s:.1f} s, over the {usable:.1f} s its deadline allows, on a rate "
                    f"not yet confirmed ({self._rate_basis(now)}); it is admitted when the "
                    f"engine is idle (about {wait_s:.0f} s of work is queued ahead)",
                    retry_after_s=max(1, math.ceil(wait_s)),
                )
        elif self._tokens:
            self._check_deadline(n, estimate.new_tokens, deadline, now)
        if self._tokens:
            self._check_budgets(n)
        self._add(n, estimate.new_tokens)
        return Reservation(tokens=n, new_tokens=estimate.new_tokens, estimated_s=own_s)

    def estimate_s(self, estimate: Estimate) -> float | None:
        """Seconds until ``estimate``'s work would be done if admitted now: the queue ahead
        plus its own, at the measured rates (``None``: no rate yet). Admits nothing."""
        own_s = self.meter.seconds_for(estimate.prompt_tokens, estimate.new_tokens)
        wait_s = self.estimated_wait_s
        if own_s is None or wait_s is None:
            return None
        return wait_s + own_s

    def remeasure(self, why: str) -> None:
        """Ask for a re-measurement of the engine's rate (the server's rate canary runs it
        when the engine is next idle): an estimate was doubted or refused work."""
        self.remeasure_wanted = why
        if self.on_remeasure is not None:
            self.on_remeasure()

    def _rate_basis(self, now: float) -> str:
        """What the prefill estimate rests on, for messages."""
        age = self.meter.age_s(now)
        return (
            f"{self.meter.calls(now)} call(s) in the last {FRESH_S:.0f} s, the newest "
            f"{'never' if age is None else f'{age:.0f} s ago'}"
        )

    def release(self, reservation: Reservation) -> None:
        """Give back what an admitted request's calls did not take (it has finished)."""
        self._add(-reservation.tokens, -reservation.new_tokens)
        reservation.tokens = reservation.new_tokens = 0

    @contextmanager
    def tokens(
        self,
        n: int,
        deadline: float | None = None,
        *,
        new_tokens: int = 0,
        reservation: Reservation | None = None,
    ) -> Iterator[None]:
        """Hold ``n`` tokens while a call runs, or raise ``Overloaded``.

        Args:
            n: the call's prompt tokens plus its answer budget (generation).
            new_tokens: the answer-budget part of ``n``.
            deadline: ``time.monotonic()`` by which the call's request must be answered;
                ``None``: no deadline check.
            reservation: the call's request was admitted as a whole: the call takes its
                tokens from that reservation and is not checked again.

        A call is always admitted when nothing else is in flight: its own size is bounded by
        ``max_prompt_tokens_x_prompts``, so no budget or estimate can starve it.
        """
        now = time.monotonic()
        if reservation is not None:
            took = min(n, reservation.tokens)
            took_new = min(new_tokens, reservation.new_tokens, took)
            reservation.tokens -= took
            reservation.new_tokens -= took_new
            self._add(-took, -took_new)
        elif self._tokens:
            self._check_deadline(n, new_tokens, deadline, now)
            self._check_budgets(n)
        self._add(n, new_tokens)
        self.meter.begin(now)
        done: int | None = None
        try:
            yield
            done = n - new_tokens
        finally:
            self._add(-n, -new_tokens)
            self._ended(done, new_tokens)

    @contextmanager
    def measured(self, n: int, *, new_tokens: int = 0) -> Iterator[None]:
        """Time a call the service makes for itself (a rate canary, ``auto``'s background
        runs) into the meter without admitting it: it holds no place in the queue, so a
        request arriving meanwhile sees an idle engine and preempts it."""
        self.meter.begin(time.monotonic())
        done: int | None = None
        try:
            yield
            done = n - new_tokens
        finally:
            self._ended(done, new_tokens)

    def _ended(self, done: int | None, new_tokens: int) -> None:
        """A call left the engine: time it; a completed one is the re-measurement any doubt
        asked for."""
        self.meter.end(time.monotonic(), done, new_tokens)
        if done is not None and done > 0:
            self.remeasure_wanted = None

    def _add(self, tokens: int, new_tokens: int) -> None:
        self._tokens += tokens
        self._new_tokens += new_tokens
        self._metrics.inflight_prompt_tokens.set(self._tokens)

    def _check_budgets(self, n: int) -> None:
        """``Overloaded`` (reason ``token_budget``) if ``n`` more tokens exceed the fixed
        in-flight budget, or the cap while the engine's rate is not yet measured."""
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

    def _check_deadline(self, n: int, new_tokens: int, deadline: float | None, now: float) -> None:
        """``Overloaded`` (reason ``deadline``) if the work ahead plus ``n`` tokens (of which
        ``new_tokens`` answer budget) cannot be done by ``deadline`` at the measured rates;
        its Retry-After is when they could be."""
        wait_s = self.estimated_wait_s
        own_s = self.meter.seconds_for(n - new_tokens, new_tokens)
        if deadline is None or wait_s is None or own_s is None:
            return
        left_s = deadline - now
        if wait_s + own_s <= _HEADROOM * left_s:
            return
        self._metrics.admission_rejections.labels("deadline").inc()
        # Retried, it fits once the queue ahead has shrunk to what a fresh deadline leaves
        # beside its own work; a call longer than a deadline only once the engine is idle.
        timeout = _HEADROOM * self._settings.request_timeout_s
        ahead_s = wait_s + own_s - timeout if own_s < timeout else wait_s
        retry = max(1, math.ceil(ahead_s - 1e-6))  # not a second more for a rounding error
        rate = self.meter.tokens_per_s
        raise Overloaded(
            f"the {self._tokens} tokens queued ahead (about {wait_s:.1f} s at the measured "
            f"{rate:.0f} prompt tokens/s) and this request's {n} (about {own_s:.1f} s) "
            f"would not finish within its deadline ({max(left_s, 0.0):.1f} s left)",
            retry_after_s=retry,
        )


def _unreachable(
    estimate: Estimate,
    own_s: float,
    meter: ThroughputMeter,
    now: float,
    timeout_s: float,
    name: str,
) -> DeadlineUnreachable:
    """The 422 for work that cannot finish by its deadline even alone: the estimate, how it
    was made (the rate, and the calls it rests on), the deadline, and what would fit."""
    usable = _HEADROOM * timeout_s
    rate = meter.best_rate(now) or 0.0
    parts = [
        f"{estimate.prompt_tokens} prompt tokens at the measured {rate:.0f}/s "
        f"({meter.calls(now)} recent calls)"
    ]
    decode = meter.decode_tokens_per_s
    if estimate.new_tokens and decode is not None:
        parts.append(f"{estimate.new_tokens} answer tokens at {decode:.0f}/s")
    share = usable / own_s
    return DeadlineUnreachable(
        estimate.param,
        round(usable, 3),
        round(own_s, 3),
        f"this request's {estimate.prompts} model calls are estimated at {own_s:.1f} s on an "
        f"idle engine ({'; '.join(parts)}), over the {usable:.1f} s its deadline allows "
        f"({name} = {timeout_s:g} s, 90% usable); about {share:.0%} of this work would fit: "
        f"send fewer passages, prompts or samples ({estimate.param}), or raise {name}",
    )


def _prompt_tokens(requests: Sequence[SpanRequest]) -> int:
    """A scoring call's prompt tokens, as admission and the meter count them."""
    return sum(len(r.token_ids) for r in requests)


def _generation_tokens(requests: Sequence[GenerationRequest]) -> tuple[int, int]:
    """A generation call's prefilled tokens (a prompt's score ids are prefilled with it) and
    its answer budget."""
    prefilled = sum(len(r.token_ids) + len(r.score_ids) for r in requests)
    return prefilled, sum(r.max_new_tokens for r in requests)


class MeteredBackend:
    """The shared backend as the service's own work sees it (the rate canary, ``auto``'s
    background runs): no admission, no request limits, but every call timed into the meter
    (``Admission.measured``), so what the service learns about itself also re-measures the
    engine's rate."""

    def __init__(self, inner: LogprobBackend, admission: Admission) -> None:
        self._inner = inner
        self._admission = admission

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
        with self._admission.measured(_prompt_tokens(requests)):
            return await self._inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        prefilled, budget = _generation_tokens(requests)
        with self._admission.measured(prefilled + budget, new_tokens=budget):
            return await self._inner.generate(requests)

    async def aclose(self) -> None:
        """Nothing: the lifespan owns and closes the shared backend."""


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
        timeout_s: float | None = None,
        timeout_name: str = "request_timeout_s",
    ) -> None:
        """Args:
        inner: the shared backend.
        admission: the service's admission.
        settings: the limits.
        deadline: ``time.monotonic()`` by which the request must be answered (admission
            refuses work that would not finish by then); ``None``: not checked.
        timeout_s: the deadline's whole length (default ``request_timeout_s``).
        timeout_name: the setting that sets it, named in a refusal.
        """
        self._inner = inner
        self._admission = admission
        self._settings = settings
        self._deadline = deadline
        self._timeout_s = settings.request_timeout_s if timeout_s is None else timeout_s
        self._timeout_name = timeout_name
        self._reservation: Reservation | None = None
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

    def admit(self, estimate: Estimate) -> float | None:
        """Admit the request's whole estimated work (``Admission.reserve``); its calls then
        draw on the reservation. Returns its estimated seconds on an idle engine.

        Raises:
            DeadlineUnreachable, Overloaded: as ``Admission.reserve``.
        """
        self.release()
        self._reservation = self._admission.reserve(
            estimate, self._deadline, timeout_s=self._timeout_s, timeout_name=self._timeout_name
        )
        return self._reservation.estimated_s

    def estimate_s(self, estimate: Estimate) -> float | None:
        """``Admission.estimate_s``: when the work would be done if admitted now."""
        return self._admission.estimate_s(estimate)

    def release(self) -> None:
        """Give back what the request's calls did not take (when it ends, however)."""
        if self._reservation is not None:
            self._admission.release(self._reservation)
            self._reservation = None

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
        tokens = _prompt_tokens(requests)
        self._count_prompt_tokens(tokens, n)
        with self._admission.tokens(tokens, self._deadline, reservation=self._reservation):
            return await self._inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Check the request's prompts x tokens limit (422), admit the prompts' tokens plus
        their answer budgets (503), then generate. A prompt's score ids are prefilled with
        it, so they count as its tokens.

        Raises:
            LimitExceeded: prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full.
        """
        prefilled, budget = _generation_tokens(requests)
        self._count_prompt_tokens(prefilled, len(requests))
        with self._admission.tokens(
            prefilled + budget, self._deadline, new_tokens=budget, reservation=self._reservation
        ):
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
        """Release the request's reservation; the lifespan owns and closes the shared
        backend."""
        self.release()


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
