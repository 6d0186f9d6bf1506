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
A call that fails or is cancelled adds no tokens and its interval is dropped: how much of it
the engine ran is unknown, and counting it either way would bias the rate.

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
        self._in_flight = 0
        self._mark: float | None = None
        self.completed = 0
        """Calls whose tokens are in the estimate."""

    @property
    def tokens_per_s(self) -> float | None:
        """The estimate, or ``None`` before the first completed call."""
        if self._tokens <= 0 or self._seconds <= 0:
            return None
        return self._tokens / self._seconds

    def begin(self, now: float) -> None:
        """A call was admitted; the engine is busy from now if it was idle."""
        if self._in_flight == 0:
            self._mark = now
        self._in_flight += 1

    def end(self, now: float, tokens: int | None) -> None:
        """A call left: ``tokens`` it completed, or ``None`` (failed, cancelled: its interval
        is dropped)."""
        if self._in_flight == 0:
            raise RuntimeError("end() without begin()")
        self._in_flight -= 1
        mark = self._mark if self._mark is not None else now
        self._mark = now
        elapsed = max(0.0, now - mark)
        if tokens is None or tokens <= 0 or elapsed <= 0:
            return
        decay = math.pow(0.5, elapsed / self._half_life_s)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + elapsed
        self.completed += 1

    def seconds_for(self, tokens: int) -> float | None:
        """Estimated engine seconds for ``tokens`` prompt tokens (``None`` before the first
        measurement)."""
        rate = self.tokens_per_s
        return None if rate is None else tokens / rate
