"""Whether a remote engine is busy with other clients' work, as far as its own metrics tell.

``auto``'s background runs (``service.learning.learner``) run only while the engine is idle and are
cancelled as soon as it is not. This replica's admission sees only its own requests: with
several replicas (or other applications) on one vLLM server, their work is invisible to it,
and a background run would take their generator capacity unpreempted. vLLM publishes its
queue in Prometheus text at ``/metrics``: ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` (each prompt of a completion call is one request; summed over
engines and models), and its token counters ``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total``.

``EngineLoad`` reads them in the background, at most every ``poll_s`` and only while asked
within the last ``WANTED_S`` (a background run waits or runs), never in a request's path. The
engine is busy with others when its queue holds more requests than this replica's own prompts
in flight *and* its token counters moved since the previous read: vLLM leaves the gauges at
their last values when every request is aborted (vllm-project/vllm#22545, #29928), which is
what cancelling a background run does, and a queue that does not move is costing no one. A
read that fails (no ``/metrics``, a gateway that hides it, no vLLM queue in it) counts as busy
for ``grace_s`` from the first failure; after that this replica's own requests alone decide,
until a read succeeds again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import anyio

from service.backends.transport.engine_client import EngineClient

log = logging.getLogger(__name__)

METRICS_PATH: Final = "/metrics"
_RUNNING: Final = "vllm:num_requests_running"
_WAITING: Final = "vllm:num_requests_waiting"
_TOKENS: Final = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
WANTED_S: Final = 5.0
"""Reads go on this long after the last question (the learner asks every 0.1 s)."""
_READ_TIMEOUT_S: Final = 2.0
_FRESH_POLLS: Final = 3
"""A reading older than this many polls says nothing about the engine now."""


@dataclass(frozen=True, slots=True)
class EngineQueue:
    """One read of a vLLM engine's ``/metrics``."""

    running: float
    waiting: float
    tokens: float | None
    """Prompt and generated tokens so far (``None``: the engine publishes no counters)."""


def parse_queue(text: str) -> EngineQueue | None:
    """vLLM's queue from Prometheus text, each series summed over its labels (engines,
    models); ``None`` when either queue gauge is missing (not a vLLM server)."""
    wanted = {_RUNNING, _WAITING, *_TOKENS}
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cut = len(line)
        for mark in ("{", " ", "\t"):
            at = line.find(mark)
            if at != -1:
                cut = min(cut, at)
        name = line[:cut]
        if name not in wanted:
            continue
        rest = line[line.rindex("}") + 1 :] if line[cut : cut + 1] == "{" else line[cut:]
        fields = rest.split()
        try:
            value = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    if _RUNNING not in sums or _WAITING not in sums:
        return None
    counters = [sums[n] for n in _TOKENS if n in sums]
    return EngineQueue(sums[_RUNNING], sums[_WAITING], sum(counters) if counters else None)


class EngineLoad:
    """The remote engine's queue, read in the background (module docstring)."""

    def __init__(
        self,
        client: EngineClient,
        own: Callable[[], int],
        *,
        poll_s: float = 1.0,
        grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        client: the engine's client (its ``/metrics`` is read with it).
        own: this replica's prompts in flight to the engine (``RemoteBackend``).
        poll_s: seconds between two reads (``engine_idle_poll_s``).
        grace_s: seconds a failed read counts as busy (``engine_metrics_grace_s``).
        clock: monotonic seconds (tests).
        """
        self._client = client
        self._own = own
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._clock = clock
        self._wake: anyio.Event | None = None
        self._wanted_at = -math.inf
        self._read_at: float | None = None
        self._blind_since: float | None = None
        self._fell_back = False
        self._tokens: float | None = None
        self._busy = False
        self.others = 0.0
        """Requests of other clients in the engine's queue at the last good read."""
        self.failure: str | None = None
        """Why the last read failed (``None``: it succeeded, or none was made)."""

    @property
    def read(self) -> bool:
        """Whether a read has succeeded (``others`` is a reading, not the default)."""
        return self._read_at is not None

    def busy(self) -> bool:
        """Whether the engine works for other clients now, as far as it can tell: the last
        read (if recent) said so, or reads have failed for less than ``grace_s``. Asks the
        background reads to go on; no I/O."""
        now = self._clock()
        self._wanted_at = now
        if self._wake is not None:
            self._wake.set()
        fresh_s = _FRESH_POLLS * self.poll_s + _READ_TIMEOUT_S
        if self._read_at is not None and now - self._read_at <= fresh_s:
            return self._busy
        if self._blind_since is None:
            return True  # the first read since the engine was last asked about is under way
        if now - self._blind_since < self.grace_s:
            return True
        if not self._fell_back:
            self._fell_back = True
            log.warning(
                "the remote engine's queue is unread for %.0f s (%s): background runs now "
                "watch this replica's own requests only",
                now - self._blind_since,
                self.failure,
            )
        return False

    async def run(self) -> None:
        """Read the engine's queue every ``poll_s`` while ``busy`` was asked within
        ``WANTED_S``, until cancelled; never raises."""
        self._wake = anyio.Event()
        while True:
            if self._clock() - self._wanted_at > WANTED_S:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            await self.read_once()
            await anyio.sleep(self.poll_s)

    async def read_once(self) -> None:
        """One read of ``/metrics``; a failure is kept (``failure``), never raised."""
        before = self._own()
        try:
            text = await self._client.read_text(METRICS_PATH, timeout_s=_READ_TIMEOUT_S)
            queue = parse_queue(text)
            if queue is None:
                raise ValueError(f"no {_RUNNING} and {_WAITING} in it (not vLLM's metrics)")
        except Exception as exc:  # any failure is "not known": busy for grace_s only
            self._failed(f"{type(exc).__name__}: {exc}"[:200])
            return
        # Prompts of ours that started or ended during the read may or may not be counted
        # by the engine: counting them as ours errs toward running the background work.
        own = max(before, self._own())
        others = queue.running + queue.waiting - own
        moved = queue.tokens is None or self._tokens is None or queue.tokens != self._tokens
        self._tokens = queue.tokens
        self._busy = others > 0 and moved
        self.others = max(0.0, others)
        self._read_at = self._clock()
        if self.failure is not None:
            log.info("the remote engine's queue is read again (%s before)", self.failure)
        self.failure = None
        self._blind_since = None
        self._fell_back = False

    def _failed(self, why: str) -> None:
        if self.failure is None:
            log.warning(
                "reading the remote engine's queue (%s) failed: %s; counted busy for %g s",
                METRICS_PATH,
                why,
                self.grace_s,
            )
        self.failure = why
        if self._blind_since is None:
            self._blind_since = self._clock()
