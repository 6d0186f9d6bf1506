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
checked against the queue again: admitted means expected to finish (only its own pace, below,
can stop it early). Calls of work not admitted as a whole are
checked one by one, as before.

Estimates heal (issue 70): a refusal for good needs a confirmed rate
(``ThroughputMeter.confirmed``: several recent calls, not contradicted by the newest call that
ran alone) and work over the deadline even at the fastest rate the engine recently showed.
Work over its deadline on a rate in doubt is admitted when the engine is idle (its calls
re-measure: the rule single calls always had), and gets 503 + Retry-After behind others.
With the rate canary on (issue 77), work over twice its deadline even at the fastest rate
the engine has recently shown is not admitted on the doubt (admitted, it ran into a 504): it
gets 503 + Retry-After while the canary re-measures, and its retry is decided on that rate.

No 504 for admitted work (issue 77): a rate measured quiet is wrong once a busy neighbour
arrives, and a request admitted on it burnt its whole deadline before its 504. A call of a
request admitted as a whole that is estimated over a fifth of its deadline is sent in parts
of about that size (``AdmittedBackend._in_parts``); after each, the rest is projected at the
pace the request's own parts ran, and one that would end after its deadline is stopped at
once with 503 + Retry-After (reason ``progress``). Its parts re-measured the engine, so the
retry is priced at the slower rate.
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

import itertools
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, TypeVar

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
    generation_tokens,
    prompt_tokens,
)
from service.config.settings import Settings
from service.errors import DeadlineUnreachable, LimitExceeded
from service.runtime.shared_counts import SharedCounts
from service.runtime.throughput import FRESH_S, MIN_CALLS, PLAUSIBLE_SPEEDUP, ThroughputMeter
from service.strategies.request import Estimate

# Admit only what the estimate says ends within 90% of the time left: under overload the engine
# runs a little slower than when its rate was measured (shedding, HTTP and tokenising share
# its cores), and without the margin 2 of the 19 requests admitted at 3x capacity missed their
# deadline by that little (bench/results/overload_no_headroom.md).
_HEADROOM = 0.9
_LONG_MARGIN = 1.2
"""A request's own work is admitted only if its estimate times this fits the usable time.
Work estimated near its deadline ran over it by the estimate's own error: split into parts
(``_in_parts``), it was stopped early by its pace after 25-53 s with a 503 (2 of 20
``self_consistency`` requests estimated just under 108 s, quiet,
bench/results/estimates/quiet_20_after). The long requests' model seconds over their
estimates: at most 1.18 quiet and 1.12 after the yield changes, p90 1.10 with a competing
process (bench/results/estimates); such work is now refused at once (422 on a confirmed
rate), saying how much of it would fit."""
_REMEASURE_GUESS_S = 10.0
"""Retry-After's share for the rate canary before one has run (a few seconds on this CPU)."""
_MIN_DECODE = 2
"""Generations measured before an answer budget may be refused for good (a 422)."""
_PART_SHARE = 0.2
"""A call of an admitted request estimated over this share of its deadline is sent in parts
of about this share each, its progress checked between them (``AdmittedBackend._in_parts``):
four checks for a request that fills its deadline; on a GPU, where a request takes a fraction
of a second, no call is split."""

_R = TypeVar("_R")
_T = TypeVar("_T")


@dataclass
class Reservation:
    """What is left of an admitted request's estimate: tokens its calls have not yet taken."""

    tokens: int
    """Prompt tokens plus answer budget, as the in-flight budget counts them."""
    new_tokens: int
    """The answer-budget part of ``tokens``."""
    estimated_s: float | None
    """The request's own seconds on an idle engine, at the rates when it was admitted."""
    doubted: bool = False
    """Admitted over its deadline on a rate in doubt, to re-measure the engine: its own pace
    then decides for good (``AdmittedBackend._check_progress``: 422, not a 503 to retry)."""
    param: str = "passages"
    """The request's field to turn down, named in a refusal."""


class Admission:
    """Counts admitted requests and their prompt tokens against the budgets and deadlines."""

    def __init__(
        self,
        settings: Settings,
        metrics: ServiceMetrics,
        shared: SharedCounts | None = None,
        meter: ThroughputMeter | None = None,
    ) -> None:
        """Args:
        shared: with several worker processes (``workers`` > 1), the counts of all of them:
            the budgets and the queue ahead are the engine's, summed over the workers
            (``service.runtime.shared_counts``); ``None``: this process's alone.
        meter: the engine's rates measured elsewhere (with several workers, the engine
            process's: ``service.backends.engines.engine_socket.EngineMeter``); ``None``: measured
            here, from the calls this admission sees.
        """
        self._settings = settings
        self._metrics = metrics
        self._shared = shared
        self._requests = 0
        self._tokens = 0
        self._new_tokens = 0  # the answer-budget part of ``_tokens`` (decode, not prefill)
        self.meter = meter if meter is not None else ThroughputMeter()
        """The engine's prompt tokens per second, measured from the calls admitted here (or
        the engine process's, ``meter``)."""
        self._remeasure_why: str | None = None
        self._asked_at: float | None = None  # when a re-measurement was last asked for
        self.on_remeasure: Callable[[], None] | None = None
        """Set by the server: wakes the rate canary."""
        self.remeasure_s: float | None = None
        """Seconds the newest rate canary took (``None``: none ran yet), set by the server:
        the Retry-After of work refused while the rates are re-measured."""

    @property
    def remeasure_wanted(self) -> str | None:
        """Why the rate should be measured again (``None``: it need not). Cleared by the rate
        canary (``app.main``) once it has run, or by a completed call; but an ask stays
        wanted (``"unconfirmed"``) while the rate lacks the ``MIN_CALLS`` recent calls a
        confirmation needs, for up to ``FRESH_S`` after it (issue 90): one canary is one
        of them, and a caller told "retry while the rate is re-measured" was refused on
        the same unconfirmed rate at every retry ("3 calls in the last 300 s")."""
        if self._remeasure_why is not None:
            return self._remeasure_why
        now = time.monotonic()
        if (
            self._asked_at is not None
            and now - self._asked_at <= FRESH_S
            and (self.meter.completed == 0 or self.meter.calls(now) < MIN_CALLS)
        ):
            # What canaries can supply: recent calls. A rate contradicted by a faster call
            # alone (the other reason it may be unconfirmed) is not one more canary away (a
            # small call barely moves the estimate's sums): the work it doubts is admitted on
            # an idle engine, and its calls re-measure.
            return "unconfirmed"
        return None

    @remeasure_wanted.setter
    def remeasure_wanted(self, why: str | None) -> None:
        self._remeasure_why = why

    @property
    def in_flight(self) -> int:
        """This process's requests in flight (what its drain waits for)."""
        return self._requests

    @property
    def tokens_in_flight(self) -> int:
        """Tokens admitted to the engine, by every worker process sharing it."""
        return self._totals()[1]

    def _totals(self) -> tuple[int, int, int]:
        """Requests, tokens and answer-budget tokens in flight on the engine."""
        if self._shared is None:
            return self._requests, self._tokens, self._new_tokens
        return self._shared.totals()

    def _publish(self) -> None:
        if self._shared is not None:
            self._shared.set(self._requests, self._tokens, self._new_tokens)

    def seed(self, tokens: int, seconds: float) -> None:
        """Seed the engine's rate with a call made outside admission (the warm-up probe: its
        prompt tokens and seconds in the model), so deadline-aware admission works from the
        first request; ignored once an admitted call has completed (``ThroughputMeter.seed``)."""
        self.meter.seed(tokens, seconds, time.monotonic())

    @property
    def estimated_wait_s(self) -> float | None:
        """Seconds the engine needs for the tokens admitted now (``None``: rate not yet
        measured): what a new request would queue behind."""
        _, tokens, new_tokens = self._totals()
        return self.meter.seconds_for(tokens - new_tokens, new_tokens)

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request slot, or ``Overloaded`` when ``max_concurrent_requests`` are taken."""
        limit = self._settings.max_concurrent_requests
        requests = self._totals()[0]
        if requests >= limit:
            self._metrics.admission_rejections.labels("concurrency").inc()
            raise Overloaded(f"{requests} requests in flight, the limit is {limit}")
        self._requests += 1
        self._publish()
        self._metrics.in_flight.set(self._requests)
        try:
            yield
        finally:
            self._requests -= 1
            self._publish()
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
        # The estimate's own error: work estimated near the deadline is over it (_LONG_MARGIN).
        allowed = usable / _LONG_MARGIN
        doubted = False
        if own_s is not None and deadline is not None and own_s > allowed:
            least_s = self.meter.least_seconds_for(estimate.prompt_tokens, estimate.new_tokens)
            if least_s is not None and least_s > allowed:
                # Over the deadline even at far more than the engine has ever shown: no error
                # in a rate explains that, so no re-measurement can admit it (issue 90).
                self._metrics.admission_rejections.labels("unreachable").inc()
                raise _implausible(estimate, own_s, least_s, allowed, timeout_s, timeout_name)
            # Over the deadline alone. For good (422) only on a confirmed rate, and only if
            # even the fastest the engine has recently shown cannot fit it; else it is the
            # estimate that is in doubt: admitted on an idle engine (its calls re-measure),
            # 503 behind others, and either way a re-measurement is asked for.
            best_s = self.meter.best_seconds_for(now, estimate.prompt_tokens, estimate.new_tokens)
            decode_ok = estimate.new_tokens == 0 or self.meter.decode_completed >= _MIN_DECODE
            if self.meter.confirmed(now) and decode_ok and best_s is not None and best_s > allowed:
                self._metrics.admission_rejections.labels("unreachable").inc()
                self.remeasure("refused")
                raise _unreachable(estimate, best_s, self.meter, now, timeout_s, timeout_name)
            self.remeasure("doubted")
            wait_s = self.estimated_wait_s or 0.0
            if self.tokens_in_flight:
                self._metrics.admission_rejections.labels("deadline").inc()
                raise Overloaded(
                    f"this request's {estimate.prompts} model calls are estimated at "
                    f"{own_s:.1f} s, over the {allowed:.1f} s its deadline allows, on a rate "
                    f"not yet confirmed ({self._rate_basis(now)}); it is admitted when the "
                    f"engine is idle (about {wait_s:.0f} s of work is queued ahead)",
                    retry_after_s=max(1, math.ceil(wait_s)),
                )
            if self._settings.rate_canary and best_s is not None and best_s > 2 * usable:
                # Over twice the deadline even at the fastest rate the engine has recently
                # shown (a small call's, slower than big work by its fixed costs, hence the
                # margin): admitted on an idle engine, such work ran into a 504 at its deadline
                # (issue 77). The rate canary re-measures instead, within seconds, and the
                # retry is decided on its rate: 422 once confirmed, admitted if it was the
                # estimate that was wrong. Work within the margin is admitted, in parts whose
                # pace stops it early if it will miss (``AdmittedBackend._in_parts``). Without
                # the canary only requests re-measure, so the old rule stays.
                self._metrics.admission_rejections.labels("deadline").inc()
                retry_s = wait_s + (self.remeasure_s or _REMEASURE_GUESS_S)
                raise Overloaded(
                    f"this request's {estimate.prompts} model calls are estimated at "
                    f"{own_s:.1f} s ({best_s:.1f} s even at the fastest rate the engine has "
                    f"recently shown), over twice the {usable:.1f} s its deadline allows, on a "
                    f"rate not yet confirmed ({self._rate_basis(now)}); the engine's rates are "
                    f"being re-measured: retry after {math.ceil(retry_s)} s",
                    retry_after_s=max(1, math.ceil(retry_s)),
                )
            doubted = True
        elif self.tokens_in_flight:
            self._check_deadline(n, estimate.new_tokens, deadline, now, timeout_s)
        if self.tokens_in_flight:
            self._check_budgets(n)
        self._add(n, estimate.new_tokens)
        return Reservation(
            tokens=n,
            new_tokens=estimate.new_tokens,
            estimated_s=own_s,
            doubted=doubted,
            param=estimate.param,
        )

    def estimate_s(self, estimate: Estimate) -> float | None:
        """Seconds until ``estimate``'s work would be done if admitted now: the queue ahead
        plus its own, at the measured rates (``None``: no rate yet). Admits nothing."""
        own_s = self.meter.seconds_for(estimate.prompt_tokens, estimate.new_tokens)
        wait_s = self.estimated_wait_s
        if own_s is None or wait_s is None:
            return None
        return wait_s + own_s

    def progress_refused(self) -> None:
        """Count an admitted request stopped early by its own progress (``AdmittedBackend``)
        and ask for a re-measurement: the engine is slower than its rates say."""
        self._metrics.admission_rejections.labels("progress").inc()
        self.remeasure("progress")

    def remeasure(self, why: str) -> None:
        """Ask for a re-measurement of the engine's rate (the server's rate canary runs it
        when the engine is next idle): an estimate was doubted or refused work."""
        self.remeasure_wanted = why
        self._asked_at = time.monotonic()
        if self.on_remeasure is not None:
            self.on_remeasure()

    def _rate_basis(self, now: float) -> str:
        """What the prefill estimate rests on, for messages."""
        age = self.meter.age_s(now)
        why = self.meter.unconfirmed_because(now)
        return (
            f"{self.meter.calls(now)} call(s) in the last {FRESH_S:.0f} s, the newest "
            f"{'never' if age is None else f'{age:.0f} s ago'}"
            + ("" if why is None else f"; not confirmed: {why}")
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
        timeout_s: float | None = None,
    ) -> Iterator[None]:
        """Hold ``n`` tokens while a call runs, or raise ``Overloaded``.

        Args:
            n: the call's prompt tokens plus its answer budget (generation).
            new_tokens: the answer-budget part of ``n``.
            deadline: ``time.monotonic()`` by which the call's request must be answered;
                ``None``: no deadline check.
            reservation: the call's request was admitted as a whole: the call takes its
                tokens from that reservation and is not checked again.
            timeout_s: the length of the request's deadline, which a refusal's Retry-After
                is priced against (default ``request_timeout_s``; a calibration's is
                ``calibration_timeout_s``).

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
        elif self.tokens_in_flight:
            self._check_deadline(n, new_tokens, deadline, now, timeout_s)
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
        self._publish()
        self._metrics.inflight_prompt_tokens.set(self._tokens)

    def _check_budgets(self, n: int) -> None:
        """``Overloaded`` (reason ``token_budget``) if ``n`` more tokens exceed the fixed
        in-flight budget, or the cap while the engine's rate is not yet measured."""
        budget = self._settings.max_inflight_prompt_tokens
        tokens = self.tokens_in_flight
        if budget is not None and tokens + n > budget:
            self._metrics.admission_rejections.labels("token_budget").inc()
            raise Overloaded(
                f"{n} prompt tokens do not fit the in-flight budget ({tokens} of {budget} in use)"
            )
        unmeasured = self._settings.unmeasured_inflight_prompt_tokens
        if self.meter.tokens_per_s is None and tokens + n > unmeasured:
            self._metrics.admission_rejections.labels("token_budget").inc()
            raise Overloaded(
                f"{n} prompt tokens do not fit the in-flight budget while the engine's "
                f"rate is not yet measured ({tokens} of {unmeasured} in use)"
            )

    def _check_deadline(
        self,
        n: int,
        new_tokens: int,
        deadline: float | None,
        now: float,
        timeout_s: float | None = None,
    ) -> None:
        """``Overloaded`` (reason ``deadline``) if the work ahead plus ``n`` tokens (of which
        ``new_tokens`` answer budget) cannot be done by ``deadline`` at the measured rates;
        its Retry-After is when they could be, for a retry with a fresh deadline of
        ``timeout_s`` (default ``request_timeout_s``: a calibration's is
        ``calibration_timeout_s``, issue 90)."""
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
        timeout = _HEADROOM * (self._settings.request_timeout_s if timeout_s is None else timeout_s)
        ahead_s = wait_s + own_s - timeout if own_s < timeout else wait_s
        retry = max(1, math.ceil(ahead_s - 1e-6))  # not a second more for a rounding error
        rate = self.meter.tokens_per_s
        raise Overloaded(
            f"the {self.tokens_in_flight} tokens queued ahead (about {wait_s:.1f} s at the "
            f"measured {rate:.0f} prompt tokens/s) and this request's {n} (about {own_s:.1f} s) "
            f"would not finish within its deadline ({max(left_s, 0.0):.1f} s left)",
            retry_after_s=retry,
        )


def _implausible(
    estimate: Estimate,
    own_s: float,
    least_s: float,
    allowed: float,
    timeout_s: float,
    name: str,
) -> DeadlineUnreachable:
    """The 422 for work over its deadline even at ``PLAUSIBLE_SPEEDUP`` times the fastest rate
    the engine has shown: refused for good whether or not the rate is confirmed."""
    return DeadlineUnreachable(
        estimate.param,
        round(allowed, 3),
        round(own_s, 3),
        f"this request's {estimate.prompts} model calls ({estimate.prompt_tokens} prompt "
        f"tokens, {estimate.new_tokens} answer tokens) are estimated at {own_s:.0f} s, "
        f"{own_s / allowed:.0f}x the {allowed:.1f} s its deadline allows ({name} = "
        f"{timeout_s:g} s: 90% usable, less a {_LONG_MARGIN - 1:.0%} margin); even at "
        f"{PLAUSIBLE_SPEEDUP:g}x the fastest rate this engine has shown it would take "
        f"{least_s:.1f} s, so no re-measurement of the rate can admit it: send fewer "
        f"passages, prompts or samples ({estimate.param}), or raise {name}",
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
    allowed = _HEADROOM * timeout_s / _LONG_MARGIN
    rate = meter.best_rate(now) or 0.0
    parts = [
        f"{estimate.prompt_tokens} prompt tokens at the measured {rate:.0f}/s "
        f"({meter.calls(now)} recent calls)"
    ]
    decode = meter.decode_tokens_per_s
    if estimate.new_tokens and decode is not None:
        parts.append(f"{estimate.new_tokens} answer tokens at {decode:.0f}/s")
    share = allowed / own_s
    return DeadlineUnreachable(
        estimate.param,
        round(allowed, 3),
        round(own_s, 3),
        f"this request's {estimate.prompts} model calls are estimated at {own_s:.1f} s on an "
        f"idle engine ({'; '.join(parts)}), over the {allowed:.1f} s its deadline allows "
        f"({name} = {timeout_s:g} s: 90% usable, less a {_LONG_MARGIN - 1:.0%} margin for the "
        f"estimate's error); about {share:.0%} of this work would fit: "
        f"send fewer passages, prompts or samples ({estimate.param}), or raise {name}",
    )


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
        with self._admission.measured(prompt_tokens(requests)):
            return await self._inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        prefilled, budget = generation_tokens(requests)
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
        self.estimated_s: float | None = None
        """The request's estimate when it was admitted as a whole (``None``: not, or no
        rate), kept after it is released: a 504's message gives it."""
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
        self.estimated_s = self._reservation.estimated_s
        return self.estimated_s

    def estimate_s(self, estimate: Estimate) -> float | None:
        """``Admission.estimate_s``: when the work would be done if admitted now."""
        return self._admission.estimate_s(estimate)

    def release(self) -> None:
        """Give back what the request's calls did not take (when it ends, however)."""
        if self._reservation is not None:
            self._admission.release(self._reservation)
            self._reservation = None

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Check the request's limits (422), admit its tokens (503), then score (in parts,
        ``_in_parts``, when the request is long).

        Raises:
            LimitExceeded: too many distinct prompts, or prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full, the call would not finish
                before the request's deadline, or its first parts show it will not.
        """
        n = len(requests)
        max_prompts = self._settings.max_prompts_per_request
        if n > max_prompts:
            raise LimitExceeded(
                "design.num_prompts", max_prompts, n, what="distinct prompts to score"
            )
        tokens = prompt_tokens(requests)
        self._count_prompt_tokens(tokens, n)

        async def part(reqs: Sequence[SpanRequest]) -> list[ScoreResult]:
            with self._admission.tokens(
                prompt_tokens(reqs),
                self._deadline,
                reservation=self._reservation,
                timeout_s=self._timeout_s,
            ):
                return await self._inner.score(reqs)

        return await self._in_parts(requests, [len(r.token_ids) for r in requests], None, part)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Check the request's prompts x tokens limit (422), admit the prompts' tokens plus
        their answer budgets (503), then generate (in parts, ``_in_parts``, when the request
        is long). A prompt's score ids are prefilled with it, so they count as its tokens.

        Raises:
            LimitExceeded: prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full, or the first parts of a long
                request show it will not finish before its deadline.
        """
        prefilled, _ = generation_tokens(requests)
        self._count_prompt_tokens(prefilled, len(requests))

        async def part(reqs: Sequence[GenerationRequest]) -> list[GenerateResult]:
            tokens, budget = generation_tokens(reqs)
            with self._admission.tokens(
                tokens + budget,
                self._deadline,
                new_tokens=budget,
                reservation=self._reservation,
                timeout_s=self._timeout_s,
            ):
                return await self._inner.generate(reqs)

        return await self._in_parts(
            requests,
            [len(r.token_ids) + len(r.score_ids) for r in requests],
            [r.max_new_tokens for r in requests],
            part,
        )

    async def _in_parts(
        self,
        requests: Sequence[_R],
        tokens: Sequence[int],
        new_tokens: Sequence[int] | None,
        call: Callable[[Sequence[_R]], Awaitable[list[_T]]],
    ) -> list[_T]:
        """Send a call of a request admitted as a whole in parts of about ``_PART_SHARE`` of
        its deadline each, at the measured rates, and stop it early once its own parts show
        it would end after its deadline (issue 77): a rate measured quiet, then a busy
        neighbour, admitted work that then ran into a 504 after burning the whole deadline.
        One part (the call as it is) for a request not admitted as a whole, one estimated
        within a part, or without a deadline or a rate: a GPU's calls are never split.

        Raises:
            Overloaded: the parts so far ran slower than estimated by so much that the rest,
                at that pace, would end after the request's deadline.
        """
        parts = self._parts(tokens, new_tokens)
        if len(parts) == 1:
            return await call(requests)
        meter = self._admission.meter
        estimates = [
            meter.seconds_for(sum(tokens[p]), sum(new_tokens[p]) if new_tokens else 0) or 0.0
            for p in parts
        ]
        out: list[_T] = []
        spent_s = 0.0
        for k, p in enumerate(parts):
            if k:
                self._check_progress(k, len(parts), spent_s, sum(estimates[:k]), estimates[k:])
            t0 = time.monotonic()
            out.extend(await call(requests[p]))
            spent_s += time.monotonic() - t0
        return out

    def _parts(self, tokens: Sequence[int], new_tokens: Sequence[int] | None) -> list[slice]:
        """Contiguous parts of a call of about ``_PART_SHARE`` of the deadline each, at the
        measured rates (module docstring); ``[everything]`` where it is not split."""
        whole = [slice(0, len(tokens))]
        if self._reservation is None or self._deadline is None or len(tokens) < 2:
            return whole
        budget = sum(new_tokens) if new_tokens else 0
        total_s = self._admission.meter.seconds_for(sum(tokens), budget)
        part_s = _PART_SHARE * self._timeout_s
        if total_s is None or total_s <= part_s:
            return whole
        n = min(len(tokens), math.ceil(total_s / part_s))
        # Cut where the running estimate passes each n-th of the whole: parts of about equal
        # seconds.
        meter = self._admission.meter
        budgets = new_tokens or [0] * len(tokens)
        seconds = [meter.seconds_for(t, b) or 0.0 for t, b in zip(tokens, budgets, strict=True)]
        cuts = [0]
        run = 0.0
        for i, sec in enumerate(seconds[:-1]):
            run += sec
            if run >= total_s * len(cuts) / n:
                cuts.append(i + 1)
        cuts.append(len(tokens))
        return [slice(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def _check_progress(
        self, done: int, parts: int, spent_s: float, estimated_s: float, rest: Sequence[float]
    ) -> None:
        """``Overloaded`` if the rest of a call, at the pace its first ``done`` parts ran
        (``spent_s`` against ``estimated_s``), would end after the request's deadline."""
        assert self._deadline is not None
        if estimated_s <= 0:
            return
        pace = spent_s / estimated_s
        rest_s = pace * sum(rest)
        left_s = self._deadline - time.monotonic()
        if rest_s <= left_s:
            return
        self._admission.progress_refused()
        reservation = self._reservation
        if reservation is not None and reservation.doubted:
            # Admitted over its deadline on a rate in doubt, on an idle engine, to re-measure
            # it: its own parts are that re-measurement, and they say it cannot finish. A 503
            # to retry was refused at once the next time (issue 90: self_consistency on a
            # fresh server, after 26 s of work), so this is the answer for good.
            meter = self._admission.meter
            now = time.monotonic()
            why = meter.unconfirmed_because(now)
            total_s = spent_s + rest_s
            raise DeadlineUnreachable(
                reservation.param,
                round(self._timeout_s, 3),
                round(total_s, 3),
                f"this request was admitted on an idle engine to re-measure its rate (it was "
                f"estimated over its deadline on a rate not yet confirmed); the first {done} "
                f"of {parts} parts of its model calls took {spent_s:.1f} s against "
                f"{estimated_s:.1f} s estimated ({pace:.1f}x), so all of them would take about "
                f"{total_s:.0f} s, past its deadline ({self._timeout_name} = "
                f"{self._timeout_s:g} s, {max(left_s, 0):.0f} s left); the rate is now "
                + ("confirmed" if why is None else f"not confirmed ({why})")
                + f" at {meter.tokens_per_s or 0:.0f} prompt tokens/s: send fewer passages, "
                f"prompts or samples ({reservation.param}), or raise {self._timeout_name}",
            )
        wait_s = self._admission.estimated_wait_s or 0.0
        raise Overloaded(
            f"stopped early: the first {done} of {parts} parts of this request's model calls "
            f"took {spent_s:.1f} s against {estimated_s:.1f} s estimated ({pace:.1f}x: the "
            f"engine is slower than when its rate was measured), and the other {parts - done} "
            f"would take about {rest_s:.0f} s more, past its deadline ({max(left_s, 0):.0f} s "
            f"left); the engine's rates are re-measured from these parts",
            retry_after_s=max(1, math.ceil(wait_s)),
        )

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
