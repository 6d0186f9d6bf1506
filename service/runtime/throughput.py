"""The engine's measured prompt-token throughput, for deadline-aware admission (issue 44).

Admission needs one number to answer "would this request finish before its deadline?": how
many prompt tokens per second the engine gets through. It is measured here from the calls
admission already sees, whatever the backend (transformers, vLLM, a remote engine): while at
least one call is in flight the engine is busy, and each call that completes adds its tokens
and the busy time since the previous completion. Both sums decay with a half-life in busy
seconds, so the estimate follows a change of load mix (longer prompts, generation) within a
minute or two and one odd call moves it little.

With calls served oldest first (the transformers scheduler), the busy time between two
completions is the later call's own service time, so the estimate is exact for a stream of
similar calls; where an engine runs calls side by side (vLLM) it is the throughput of the mix.
A call that fails or is cancelled adds no tokens. While other calls are still in flight the
busy time since the last completion stays on the clock and goes to the next completion (the
engine may have spent it on them: counting it makes the rate lower, never higher); once the
engine is idle, that time is dropped. Restarting the clock at a failure instead made the rate
many times too high under overload (issue 54): with deadlines cancelling calls, the next
completion's tokens were divided by the seconds since the cancellation, not by the time the
engine spent on them, and admission let in work that then missed its deadline.

Before any call has completed there is no measurement; ``seed`` takes one from outside
admission (the warm-up probe), counted like a completed call's until a real one completes.

Decode is measured apart from prefill (issue 62): a generation's answer tokens each cost a
forward step, so counting them as prompt tokens, as admission did before, made
generation-heavy requests (``self_consistency``, ``lore``) look tens of times cheaper than
they are. A generation that completes adds its prompt tokens' share of its busy time at the
prefill rate measured so far, and the rest of that time, per answer-budget token, to a second
pair of decayed sums: ``decode_tokens_per_s``. Budget tokens, not the tokens generated, since
admission knows only the budget when it estimates; an answer that stops early makes the rate
higher, which the estimate of the next similar request then uses. Before the prefill rate is
known a generation adds to neither (its time cannot be split).

Estimates heal (issue 70). One slow first call (a throttled quota, a busy neighbour, a cold
page cache) once seeded a rate that refused every later large request with a 422 for good,
since only admitted calls re-measured it. Now:

- the sums also decay in wall time (``WALL_HALF_LIFE_S``): an estimate nobody re-measured for
  minutes weighs little against the next measurement;
- the meter says how much the estimate rests on (``calls``: measurements within
  ``FRESH_S``; ``age_s``) and whether it may refuse work for good (``confirmed``): enough
  recent calls, and not contradicted by the newest call that ran alone on the engine (its
  rate, ``idle_rate``, more than twice the estimate);
- a call that ran alone on an idle engine is the best evidence of what the engine can do;
  refusals use the faster of the estimate and that call's rate (``best_rate``).

Before decode is measured, an answer token is priced at ``DECODE_PRIOR`` prompt tokens (a
step of greedy decoding is a forward of one token per sequence: its cost is the weights'
read, not the token), not at one: the first generation is no longer admitted at a fraction
of its cost (issue 77).

Plain arithmetic on the event loop thread: no locks, no clock of its own (callers pass
``time.monotonic()``), so the tests drive it with made-up times.
"""

from __future__ import annotations

import math
from collections import deque

HALF_LIFE_S = 60.0
"""Busy seconds after which a measurement weighs half as much."""
WALL_HALF_LIFE_S = 300.0
"""Seconds without a new measurement after which the old ones weigh half as much: a rate
measured under other load fades once that load may be gone."""
FRESH_S = 300.0
"""Measurements younger than this count toward ``calls`` and ``confirmed``."""
MIN_CALLS = 4
"""Recent measurements a rate needs before it may refuse work for good (a 422)."""
CONTRADICTION = 2.0
"""A newest call alone on the engine this many times faster than the estimate contradicts
it: the estimate is not ``confirmed`` until it has caught up."""
PLAUSIBLE_SPEEDUP = 100.0
"""How many times faster than the fastest rate it has shown an engine may plausibly run a
request (issue 90): work over its deadline even at that is refused for good at once, whether
or not the rate is ``confirmed``. A rate is wrong by the fixed costs of the small calls that
measured it: the warm-up probe ran at 15 prompt tokens/s against 450 for real work on this
project's CPU (30x, serving/canaries.py), and the paced H100 profile's 2-prompt canary at 1,938
against 86,302 (44.5x, issue 90 item 2); 100 is over twice the widest of those. A request
estimated 36,000x over its deadline (issue 90 item 11) got 503 "rate not yet confirmed" on
every retry, as no re-measurement could explain that estimate away."""
DECODE_PRIOR = 8.0
"""Prompt tokens' worth of engine time one answer token costs before decode is measured
(docs/operations.md, "Admission's estimates"; measured by bench/estimates.py)."""
RECENT_BUCKET_S = 1.0
"""The recent measurements are counted per bucket of this many seconds, dated by the bucket's
first: at most ``FRESH_S / RECENT_BUCKET_S + 1`` buckets whatever the call rate, so the meter
and the copy of it the engine process sends every worker stay small (issue 90); a
measurement leaves ``calls`` at most this much early, never late."""


class ThroughputMeter:
    """Decayed tokens-per-busy-second of completed calls (module docstring)."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self._half_life_s = half_life_s
        self._tokens = 0.0
        self._seconds = 0.0
        self._decode_tokens = 0.0
        self._decode_seconds = 0.0
        self._in_flight = 0
        self._mark: float | None = None
        self._alone = False  # the current busy period has held one call only
        # Measurements within FRESH_S: (time of a bucket's first, how many in the bucket).
        self._recent: deque[tuple[float, int]] = deque()
        self.updated_at: float | None = None
        """Monotonic time of the newest measurement (``None``: none yet)."""
        self.idle_rate: float | None = None
        """Prompt tokens per second of the newest scoring call that ran alone on the engine
        (``None``: none yet): what the engine does unshared."""
        self.idle_at: float | None = None
        """When ``idle_rate`` was measured."""
        self.last_end: float | None = None
        """When a call last completed: the engine was making progress then."""
        self.completed = 0
        """Calls whose tokens are in the estimate (a ``seed`` is not one)."""
        self.decode_completed = 0
        """Generations whose answer budget is in the decode estimate."""
        self.peak_rate: float | None = None
        """The fastest prompt tokens per second this engine has shown (``None``: nothing
        measured): the estimate's highest value, seeds included, or a call alone on it; never
        decays (``least_seconds_for``)."""

    @property
    def tokens_per_s(self) -> float | None:
        """The estimate, or ``None`` before the first completed call or ``seed``."""
        if self._tokens <= 0 or self._seconds <= 0:
            return None
        return self._tokens / self._seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Answer-budget tokens per second of decode, or ``None`` before the first generation
        measured after the prefill rate."""
        if self._decode_tokens <= 0 or self._decode_seconds <= 0:
            return None
        return self._decode_tokens / self._decode_seconds

    def calls(self, now: float) -> int:
        """Measurements (completed calls, seeds) within the last ``FRESH_S`` seconds."""
        while self._recent and now - self._recent[0][0] > FRESH_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent)

    def age_s(self, now: float) -> float | None:
        """Seconds since the newest measurement (``None``: none yet)."""
        return None if self.updated_at is None else max(0.0, now - self.updated_at)

    def best_rate(self, now: float) -> float | None:
        """The faster of the estimate and the newest recent call alone on the engine: the
        most the engine has recently shown it can do (``None``: nothing measured)."""
        rate = self.tokens_per_s
        idle = self.idle_rate
        if idle is not None and self.idle_at is not None and now - self.idle_at <= FRESH_S:
            return idle if rate is None else max(rate, idle)
        return rate

    def confirmed(self, now: float) -> bool:
        """Whether the prefill estimate may refuse work for good: at least ``MIN_CALLS``
        recent measurements from real calls, and no newer call alone on the engine that ran
        ``CONTRADICTION`` times faster."""
        rate = self.tokens_per_s
        if rate is None or self.completed == 0 or self.calls(now) < MIN_CALLS:
            return False
        best = self.best_rate(now)
        return best is None or best <= CONTRADICTION * rate

    def unconfirmed_because(self, now: float) -> str | None:
        """Why the prefill estimate is not ``confirmed`` (``None``: it is), for messages."""
        rate = self.tokens_per_s
        if rate is None:
            return "no rate measured yet"
        calls = self.calls(now)
        if self.completed == 0 or calls < MIN_CALLS:
            real = "" if self.completed else ", none of them a real call"
            return f"{calls} of the {MIN_CALLS} recent calls it needs{real}"
        best = self.best_rate(now)
        if best is not None and best > CONTRADICTION * rate:
            return (
                f"the newest call alone on the engine ran at {best:.0f} prompt tokens/s, over "
                f"{CONTRADICTION:g}x the estimate's {rate:.0f}"
            )
        return None

    def least_seconds_for(self, tokens: int, new_tokens: int = 0) -> float | None:
        """The least the work may plausibly take: at ``PLAUSIBLE_SPEEDUP`` times the rates it
        is priced at, from the fastest rate the engine has shown (``None``: nothing
        measured)."""
        seconds = self._seconds_at(self.peak_rate, tokens, new_tokens)
        return None if seconds is None else seconds / PLAUSIBLE_SPEEDUP

    def begin(self, now: float) -> None:
        """A call was admitted; the engine is busy from now if it was idle."""
        if self._in_flight == 0:
            self._mark = now
            self._alone = True
        else:
            self._alone = False
        self._in_flight += 1

    def end(self, now: float, tokens: int | None, new_tokens: int = 0) -> None:
        """A call left: the prompt ``tokens`` it completed and, for a generation, its answer
        budget ``new_tokens``; or ``tokens=None`` (failed, cancelled: it adds no tokens; the
        busy time since the last completion goes to the next one while others are in flight,
        and is dropped once the engine is idle)."""
        if self._in_flight == 0:
            raise RuntimeError("end() without begin()")
        self._in_flight -= 1
        if tokens is not None and tokens > 0:
            self.last_end = now
        if tokens is None or tokens <= 0:
            if self._in_flight == 0:
                self._mark = None  # idle: the next begin() starts the clock again
            return
        mark = self._mark if self._mark is not None else now
        self._mark = now
        alone = self._alone and self._in_flight == 0
        if new_tokens > 0:
            self._add_generation(tokens, new_tokens, now - mark, now)
        elif self._add(tokens, now - mark, now):
            self.completed += 1
            if alone:
                self.idle_rate, self.idle_at = tokens / (now - mark), now
                self._note_peak(self.idle_rate)

    def _add_generation(self, tokens: int, new_tokens: int, elapsed: float, now: float) -> None:
        """Split a generation's busy time: its prompt at the prefill rate, the rest decode."""
        rate = self.tokens_per_s
        if rate is None or not elapsed > 0 or not math.isfinite(elapsed):
            return
        decode_s = elapsed - tokens / rate
        if decode_s <= 0:
            return  # faster than its prefill alone: nothing to learn about decode
        decay = self._decay(elapsed, now)
        self._decode_tokens = self._decode_tokens * decay + new_tokens
        self._decode_seconds = self._decode_seconds * decay + decode_s
        self.decode_completed += 1

    def seed(self, tokens: int, seconds: float, now: float | None = None) -> None:
        """A measurement from outside admission (the warm-up probe's prompt tokens and its
        seconds in the model), counted like a completed call's while no admitted call has
        completed; ignored afterwards.

        A probe is small, so its rate is lower than the engine's (fixed costs weigh more): it
        errs on the side of refusing, and weighs only its few seconds once real calls come.
        """
        if self.completed == 0:
            self._add(tokens, seconds, seconds if now is None else now)

    def _decay(self, elapsed: float, now: float) -> float:
        """How much the sums keep: ``elapsed`` busy seconds at ``HALF_LIFE_S``, and the wall
        time since the newest measurement beyond them at ``WALL_HALF_LIFE_S``."""
        decay = math.pow(0.5, elapsed / self._half_life_s)
        if self.updated_at is not None:
            quiet = now - self.updated_at - elapsed
            if quiet > 0:
                decay *= math.pow(0.5, quiet / WALL_HALF_LIFE_S)
        return decay

    def _add(self, tokens: int, elapsed: float, now: float) -> bool:
        """Decay the sums by ``elapsed`` busy seconds (and the quiet wall time before them)
        and add the measurement; ``False`` (and nothing added) for one without tokens or
        time."""
        if tokens <= 0 or not elapsed > 0 or not math.isfinite(elapsed):
            return False
        decay = self._decay(elapsed, now)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + elapsed
        self.updated_at = now
        if self._recent and now - self._recent[-1][0] < RECENT_BUCKET_S:
            first, n = self._recent[-1]
            self._recent[-1] = (first, n + 1)
        else:
            self._recent.append((now, 1))
        self.calls(now)
        self._note_peak(self._tokens / self._seconds)
        return True

    def snapshot(self) -> dict[str, object]:
        """The meter's state, for a copy of it in another process (the engine process's
        meter in every worker: ``service.backends.engines.engine_socket``). A few numbers and at
        most ``FRESH_S / RECENT_BUCKET_S + 1`` buckets of recent times: 4.2 KiB
        pickled at 200 calls a second for 300 s (the times themselves were 540 KiB)."""
        state = dict(vars(self))
        state["_recent"] = deque(self._recent)
        return state

    def _note_peak(self, rate: float) -> None:
        if self.peak_rate is None or rate > self.peak_rate:
            self.peak_rate = rate

    def seconds_for(self, tokens: int, new_tokens: int = 0) -> float | None:
        """Estimated engine seconds for ``tokens`` prompt tokens and ``new_tokens`` of answer
        budget (``None`` before the first measurement). Before decode is measured, an answer
        token counts as ``DECODE_PRIOR`` prompt tokens.
        """
        return self._seconds_at(self.tokens_per_s, tokens, new_tokens)

    def best_seconds_for(self, now: float, tokens: int, new_tokens: int = 0) -> float | None:
        """As ``seconds_for``, at ``best_rate``: the least the work may take."""
        return self._seconds_at(self.best_rate(now), tokens, new_tokens)

    def _seconds_at(self, rate: float | None, tokens: int, new_tokens: int) -> float | None:
        if rate is None:
            return None
        decode = self.decode_tokens_per_s
        if decode is None:
            return (tokens + DECODE_PRIOR * new_tokens) / rate
        return tokens / rate + new_tokens / decode
