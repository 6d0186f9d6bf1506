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

Plain arithmetic on the event loop thread: no locks, no clock of its own (callers pass
``time.monotonic()``), so the tests drive it with made-up times.
"""

from __future__ import annotations

import math

HALF_LIFE_S = 60.0
"""Busy seconds after which a measurement weighs half as much."""


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
        self.completed = 0
        """Calls whose tokens are in the estimate (a ``seed`` is not one)."""
        self.decode_completed = 0
        """Generations whose answer budget is in the decode estimate."""

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

    def begin(self, now: float) -> None:
        """A call was admitted; the engine is busy from now if it was idle."""
        if self._in_flight == 0:
            self._mark = now
        self._in_flight += 1

    def end(self, now: float, tokens: int | None, new_tokens: int = 0) -> None:
        """A call left: the prompt ``tokens`` it completed and, for a generation, its answer
        budget ``new_tokens``; or ``tokens=None`` (failed, cancelled: it adds no tokens; the
        busy time since the last completion goes to the next one while others are in flight,
        and is dropped once the engine is idle)."""
        if self._in_flight == 0:
            raise RuntimeError("end() without begin()")
        self._in_flight -= 1
        if tokens is None or tokens <= 0:
            if self._in_flight == 0:
                self._mark = None  # idle: the next begin() starts the clock again
            return
        mark = self._mark if self._mark is not None else now
        self._mark = now
        if new_tokens > 0:
            self._add_generation(tokens, new_tokens, now - mark)
        elif self._add(tokens, now - mark):
            self.completed += 1

    def _add_generation(self, tokens: int, new_tokens: int, elapsed: float) -> None:
        """Split a generation's busy time: its prompt at the prefill rate, the rest decode."""
        rate = self.tokens_per_s
        if rate is None or not elapsed > 0 or not math.isfinite(elapsed):
            return
        decode_s = elapsed - tokens / rate
        if decode_s <= 0:
            return  # faster than its prefill alone: nothing to learn about decode
        decay = math.pow(0.5, elapsed / self._half_life_s)
        self._decode_tokens = self._decode_tokens * decay + new_tokens
        self._decode_seconds = self._decode_seconds * decay + decode_s
        self.decode_completed += 1

    def seed(self, tokens: int, seconds: float) -> None:
        """A measurement from outside admission (the warm-up probe's prompt tokens and its
        seconds in the model), counted like a completed call's while no admitted call has
        completed; ignored afterwards.

        A probe is small, so its rate is lower than the engine's (fixed costs weigh more): it
        errs on the side of refusing, and weighs only its few seconds once real calls come.
        """
        if self.completed == 0:
            self._add(tokens, seconds)

    def _add(self, tokens: int, elapsed: float) -> bool:
        """Decay the sums by ``elapsed`` busy seconds and add the measurement; ``False`` (and
        nothing added) for one without tokens or time."""
        if tokens <= 0 or not elapsed > 0 or not math.isfinite(elapsed):
            return False
        decay = math.pow(0.5, elapsed / self._half_life_s)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + elapsed
        return True

    def seconds_for(self, tokens: int, new_tokens: int = 0) -> float | None:
        """Estimated engine seconds for ``tokens`` prompt tokens and ``new_tokens`` of answer
        budget (``None`` before the first measurement). Before decode is measured, an answer
        token counts as a prompt token: a low estimate, the one admission made before issue 62.
        """
        rate = self.tokens_per_s
        if rate is None:
            return None
        decode = self.decode_tokens_per_s
        if decode is None:
            return (tokens + new_tokens) / rate
        return tokens / rate + new_tokens / decode
