"""``Admission``: the counts (requests, tokens in flight, answer budgets) and the decisions
made on them: a request slot, a whole request's estimate against its deadline, a call's
tokens against the queue ahead and the budgets (the package docstring says what and why).

Runs on the event loop thread: plain counters, no locks. With several worker processes the
counts are summed over all of them (``service.runtime.shared_counts``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from service.config.settings import Settings
from service.errors import DeadlineUnreachable
from service.runtime.shared_counts import SharedCounts
from service.runtime.throughput import FRESH_S, MIN_CALLS, PLAUSIBLE_SPEEDUP, ThroughputMeter
from service.strategies.request import Estimate
from serving.admission.deadline import Deadline
from serving.admission.errors import Overloaded
from serving.metrics import ServiceMetrics

# Admit only what the estimate says ends within 90% of the time left: under overload the engine
# runs a little slower than when its rate was measured (shedding, HTTP and tokenising share
# its cores), and without the margin 2 of the 19 requests admitted at 3x capacity missed their
# deadline by that little (results/bench/overload_no_headroom.md).
_HEADROOM = 0.9
_LONG_MARGIN = 1.2
"""A request's own work is admitted only if its estimate times this fits the usable time.
Work estimated near its deadline ran over it by the estimate's own error: split into parts
(``_in_parts``), it was stopped early by its pace after 25-53 s with a 503 (2 of 20
``self_consistency`` requests estimated just under 108 s, quiet,
results/bench/estimates/quiet_20_after). The long requests' model seconds over their
estimates: at most 1.18 quiet and 1.12 after the yield changes, p90 1.10 with a competing
process (results/bench/estimates); such work is now refused at once (422 on a confirmed
rate), saying how much of it would fit."""
_REMEASURE_GUESS_S = 10.0
"""Retry-After's share for the rate canary before one has run (a few seconds on this CPU)."""
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
        canary (``serving.canaries``) once it has run, or by a completed call; but an ask stays
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
        deadline: Deadline | None,
    ) -> Reservation:
        """Admit a request's whole estimated work, reserving it in the tokens in flight, or
        raise (the package docstring). Release what is left with ``release``.

        Args:
            estimate: the request's prompt tokens and answer budget.
            deadline: the request's; ``None``: no deadline is checked.

        Raises:
            DeadlineUnreachable: it cannot finish by its deadline even on an idle engine.
            Overloaded: the queue ahead, the token budget or the unmeasured cap.
        """
        n = estimate.prompt_tokens + estimate.new_tokens
        now = time.monotonic()
        own_s = self.meter.seconds_for(estimate.prompt_tokens, estimate.new_tokens)
        usable = _HEADROOM * deadline.length_s if deadline is not None else math.inf
        # The estimate's own error: work estimated near the deadline is over it (_LONG_MARGIN).
        allowed = usable / _LONG_MARGIN
        doubted = False
        if own_s is not None and deadline is not None and own_s > allowed:
            least_s = self.meter.least_seconds_for(estimate.prompt_tokens, estimate.new_tokens)
            if least_s is not None and least_s > allowed:
                # Over the deadline even at far more than the engine has ever shown: no error
                # in a rate explains that, so no re-measurement can admit it (issue 90).
                self._metrics.admission_rejections.labels("unreachable").inc()
                raise _implausible(estimate, own_s, least_s, allowed, deadline)
            # Over the deadline alone. For good (422) only on a confirmed rate, and only if
            # even the fastest the engine has recently shown cannot fit it; else it is the
            # estimate that is in doubt: admitted on an idle engine (its calls re-measure),
            # 503 behind others, and either way a re-measurement is asked for.
            best_s = self.meter.best_seconds_for(now, estimate.prompt_tokens, estimate.new_tokens)
            decode_ok = estimate.new_tokens == 0 or self.meter.decode_completed >= _MIN_DECODE
            if self.meter.confirmed(now) and decode_ok and best_s is not None and best_s > allowed:
                self._metrics.admission_rejections.labels("unreachable").inc()
                self.remeasure("refused")
                raise _unreachable(estimate, best_s, self.meter, now, deadline)
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
            self._check_deadline(n, estimate.new_tokens, deadline, now)
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
        deadline: Deadline | None = None,
        *,
        new_tokens: int = 0,
        reservation: Reservation | None = None,
    ) -> Iterator[None]:
        """Hold ``n`` tokens while a call runs, or raise ``Overloaded``.

        Args:
            n: the call's prompt tokens plus its answer budget (generation).
            new_tokens: the answer-budget part of ``n``.
            deadline: the call's request's (a refusal's Retry-After is priced against its
                length: a calibration's is ``calibration_timeout_s``); ``None``: no deadline
                check.
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
        elif self.tokens_in_flight:
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
        deadline: Deadline | None,
        now: float,
    ) -> None:
        """``Overloaded`` (reason ``deadline``) if the work ahead plus ``n`` tokens (of which
        ``new_tokens`` answer budget) cannot be done by ``deadline`` at the measured rates;
        its Retry-After is when they could be, for a retry with a fresh deadline of the same
        length (a calibration's is ``calibration_timeout_s``, issue 90)."""
        wait_s = self.estimated_wait_s
        own_s = self.meter.seconds_for(n - new_tokens, new_tokens)
        if deadline is None or wait_s is None or own_s is None:
            return
        left_s = deadline.left_s(now)
        if wait_s + own_s <= _HEADROOM * left_s:
            return
        self._metrics.admission_rejections.labels("deadline").inc()
        # Retried, it fits once the queue ahead has shrunk to what a fresh deadline leaves
        # beside its own work; a call longer than a deadline only once the engine is idle.
        timeout = _HEADROOM * deadline.length_s
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
    deadline: Deadline,
) -> DeadlineUnreachable:
    """The 422 for work over its deadline even at ``PLAUSIBLE_SPEEDUP`` times the fastest rate
    the engine has shown: refused for good whether or not the rate is confirmed."""
    return DeadlineUnreachable(
        estimate.param,
        round(allowed, 3),
        round(own_s, 3),
        f"this request's {estimate.prompts} model calls ({estimate.prompt_tokens} prompt "
        f"tokens, {estimate.new_tokens} answer tokens) are estimated at {own_s:.0f} s, "
        f"{own_s / allowed:.0f}x the {allowed:.1f} s its deadline allows ({deadline.named}: "
        f"90% usable, less a {_LONG_MARGIN - 1:.0%} margin); even at "
        f"{PLAUSIBLE_SPEEDUP:g}x the fastest rate this engine has shown it would take "
        f"{least_s:.1f} s, so no re-measurement of the rate can admit it: send fewer "
        f"passages, prompts or samples ({estimate.param}), or raise {deadline.setting}",
    )


def _unreachable(
    estimate: Estimate,
    own_s: float,
    meter: ThroughputMeter,
    now: float,
    deadline: Deadline,
) -> DeadlineUnreachable:
    """The 422 for work that cannot finish by its deadline even alone: the estimate, how it
    was made (the rate, and the calls it rests on), the deadline, and what would fit."""
    allowed = _HEADROOM * deadline.length_s / _LONG_MARGIN
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
        f"({deadline.named}: 90% usable, less a {_LONG_MARGIN - 1:.0%} margin for the "
        f"estimate's error); about {share:.0%} of this work would fit: "
        f"send fewer passages, prompts or samples ({estimate.param}), or raise {deadline.setting}",
    )
