"""Continuous micro-batching: the prompts of every in-flight call share the engine's forwards.

Callers ``await scheduler.score(requests)``; one worker task per event loop takes the engine,
packs a forward from the prompts pending at that moment under the token and row budgets
(``BatchFill``, the rule ``plan_batches`` uses for one call), runs it through the backend's
blocking batch function, and hands each caller its results. In the manner of vLLM's and TEI's
schedulers, with no collection window: a lone request never waits, concurrent ones fill the
forwards.

- Oldest first, then fill: every forward takes the oldest caller's prompts first (longest
  first, as ``plan_batches`` sorts them) while they fit, then fills what is left of the budgets
  from the other callers, one prompt per caller per pass, the offers that pad least first
  (each caller offers its longest prompt that does not widen the forward, else its shortest).
  So calls complete in arrival order and a call's latency is its own work plus the queue ahead
  of it: under overload the head of the queue still finishes within its deadline, where
  round-robin turns (the rule before issue 44) made every caller finish together, late. A call
  alone batches exactly as ``plan_batches``.
- Packed at the engine: the worker takes the engine lock (shared with generation and
  ``aclose``) before it packs, so a forward is never packed behind a generation batch and run
  stale: a caller cancelled while the engine was busy never reaches a forward.
- Cancellation: a caller cancelled (client gone, deadline) drops its prompts not yet in a
  forward; the results of a forward already running for it are discarded. Its ``score`` returns
  at once: the forward runs in the worker's task, not the caller's.
- Failures: the batch function isolates failed prompts itself (``PromptFailure`` per prompt).
  An exception from it for a shared forward is retried caller by caller, so only the call whose
  prompts make the engine raise fails (with that exception) and its neighbours are served.
- The service's own work yields (``service.backends.base.background_work``: ``auto``'s
  background learning and explore runs): callers' calls are packed before it whatever
  their age, never beside it, and a forward of its prompts alone is kept to about
  ``BACKGROUND_FORWARD_S`` at the pace the forwards so far ran (one prompt at least). A
  background forward cannot be stopped once started, so this bounds what a caller arriving
  during one waits: a full budget of 4096 padded tokens is about 10 s on a 2-core CPU, and
  admission's progress check once read that wait as a slow engine and stopped the caller's
  request (a 503 at 36.9 s of a ``query_likelihood`` request that follows an ``auto`` cold
  start, ``results/bench/estimates/quiet_20``).
- The worker cannot strand a caller: whatever ends it (an exception in the packing, a
  cancellation, even one before it first ran), a done-callback fails every caller still waiting
  with ``BackendUnavailable``, and the next call starts a new worker.

No torch here: the backend passes the forward in, so the packing can be tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.backends.base import ScoreResult, SpanRequest, in_background
from service.backends.scheduling.batching import BatchFill, HeadMode, longest_first
from service.errors import BackendUnavailable

logger = logging.getLogger(__name__)

RunBatch = Callable[[list[SpanRequest]], Awaitable[list[ScoreResult]]]

BACKGROUND_FORWARD_S = 0.25
"""About how long a forward of the service's own work alone may take (module docstring)."""

_PACE_WEIGHT = 0.3
"""Weight of the newest forward in the seconds-per-padded-token average (it heals within a few
forwards when the engine's speed changes)."""


@dataclass(frozen=True, slots=True)
class ForwardStats:
    """One forward as the scheduler packed it (what the batch metrics observe)."""

    prompts: int
    """Prompts in the forward."""
    callers: int
    """Distinct ``score`` calls (HTTP requests) sharing it."""
    padded_tokens: int
    """``prompts * longest prompt``: tokens computed, padding included."""
    token_budget: int
    """The budget ``padded_tokens`` is packed against (a lone prompt may exceed it)."""
    waits_s: tuple[float, ...]
    """Per prompt, seconds from its ``score`` call to the start of this forward."""
    queue_waits_s: tuple[float, ...] = ()
    """Per call whose first forward this is, seconds from its ``score`` call to this forward's
    start: the time it queued behind other work."""
    seconds: float = 0.0
    """Wall time of the forward."""


ForwardObserver = Callable[[ForwardStats], None]


@dataclass(eq=False, slots=True)
class _Caller:
    """One ``score`` call: its prompts not yet in a forward and the results received."""

    pending: deque[tuple[int, SpanRequest]]
    results: list[ScoreResult | None]
    enqueued: float
    done: asyncio.Future[None]
    background: bool = False
    """The service's own work (``background_work``): packed after callers, in short forwards."""
    remaining: int = field(init=False)
    started: bool = False

    def __post_init__(self) -> None:
        self.remaining = len(self.pending)

    def fail(self, exc: BaseException) -> None:
        self.pending.clear()
        if not self.done.done():
            self.done.set_exception(exc)


class ForwardScheduler:
    """Packs the span requests of all concurrent callers into shared forwards."""

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        token_budget: int,
        row_budget: int,
        head_mode: HeadMode,
        engine_lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> None:
        """Args:
        run_batch: scores one packed forward, one result per request, in order; it runs the
            blocking forward off the event loop.
        token_budget: padded tokens per forward.
        row_budget: LM-head rows per forward, as ``head_mode`` counts them.
        head_mode: how ``BatchFill`` counts rows.
        engine_lock: held from packing a forward to its end (the backend's lock that also
            serialises generation and ``aclose``); ``run_batch`` must not take it itself.
        """
        self._run_batch = run_batch
        self._token_budget = token_budget
        self._row_budget = row_budget
        self._head_mode: HeadMode = head_mode
        self._engine_lock = engine_lock or contextlib.nullcontext()
        # Callers with prompts not yet in a forward, oldest first.
        self._queue: list[_Caller] = []
        # Callers with a prompt in the forward now running (the worker's, for its exit).
        self._running: list[_Caller] = []
        self._worker: asyncio.Task[None] | None = None
        self._observers: list[ForwardObserver] = []
        # Seconds per padded token of the forwards so far (``None`` before the first), which
        # sizes the service's own forwards (``_background_budget``).
        self._s_per_token: float | None = None

    @property
    def queue_depth(self) -> int:
        """Prompts waiting for a forward, across all callers."""
        return sum(len(c.pending) for c in self._queue)

    @property
    def worker(self) -> asyncio.Task[None] | None:
        """The task running the forwards (``None`` before the first call); for tests."""
        return self._worker

    def add_observer(self, observer: ForwardObserver) -> None:
        """Call ``observer`` after every forward (from the event loop; keep it cheap)."""
        self._observers.append(observer)

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Score ``requests`` in forwards shared with every other in-flight call.

        Returns:
            One result per request, in order.

        Raises:
            Whatever the batch function raised for this call's prompts (tried without the
            other callers' prompts); ``BackendUnavailable`` if the worker stopped.
        """
        reqs = list(requests)
        if not reqs:
            return []
        loop = asyncio.get_running_loop()
        caller = _Caller(
            pending=deque((i, reqs[i]) for i in longest_first(reqs)),
            results=[None] * len(reqs),
            enqueued=time.perf_counter(),
            done=loop.create_future(),
            background=in_background(),
        )
        self._queue.append(caller)
        self._ensure_worker(loop)
        try:
            await caller.done
        finally:
            # Cancelled (or failed): prompts not yet in a forward are dropped; a running
            # forward's results for this caller are discarded when they arrive.
            if caller in self._queue:
                self._queue.remove(caller)
            caller.pending.clear()
        return [r for r in caller.results if r is not None]

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        # One worker per event loop, alive while there is work: a backend outlives the loops
        # of tests and of a CLI run, so none is started at construction.
        worker = self._worker
        if worker is None or worker.done() or worker.get_loop() is not loop:
            worker = loop.create_task(self._drain(), name="forward-scheduler")
            worker.add_done_callback(self._worker_exited)
            self._worker = worker

    def _worker_exited(self, task: asyncio.Task[None]) -> None:
        """Fail every caller the worker leaves behind, whatever ended it.

        Runs before a newer worker's first step (both are scheduled with ``call_soon``, this one
        first), so ``_running`` is still the exited worker's forward.
        """
        if task.cancelled():
            reason = "it was cancelled"
        elif (exc := task.exception()) is not None:
            logger.error("forward scheduler stopped", exc_info=exc)
            reason = f"it failed ({type(exc).__name__})"
        else:
            reason = ""
        stranded = list(self._running)
        self._running = []
        if task is self._worker:
            # No newer worker owns the queue: nobody would serve it.
            stranded += self._queue
            self._queue = []
        message = "the scoring worker stopped before this call finished" + (
            f": {reason}" if reason else ""
        )
        for caller in stranded:
            caller.fail(BackendUnavailable(message))

    async def _drain(self) -> None:
        while self._queue:
            async with self._engine_lock:
                # Packed now, with the engine free: callers that left while it was busy (a
                # generation batch, another scheduler's forward) are not in it.
                if not self._queue:
                    return
                batch, callers = self._take()
                if not batch:
                    continue
                self._running = callers
                started = time.perf_counter()
                outcome = await self._forward(batch, callers)
                seconds = time.perf_counter() - started
            self._running = []
            # A caller failed by its part of the forward leaves the queue with its prompts.
            self._queue = [c for c in self._queue if c.pending]
            for (index, _, caller), result in zip(batch, outcome, strict=True):
                if result is None:
                    continue  # its caller's part of the forward raised; it has the error
                caller.results[index] = result
                caller.remaining -= 1
                if caller.remaining == 0 and not caller.done.done():
                    caller.done.set_result(None)
            self._observe(batch, callers, started, seconds)

    async def _forward(
        self, batch: list[tuple[int, SpanRequest, _Caller]], callers: list[_Caller]
    ) -> list[ScoreResult | None]:
        """The forward's results in batch order; ``None`` for a caller whose prompts made the
        batch function raise (that caller has been failed with the exception)."""
        try:
            return list(await self._run_batch([req for _, req, _ in batch]))
        except Exception as exc:
            if len(callers) == 1:
                callers[0].fail(exc)
                return [None] * len(batch)
            logger.warning(
                "a forward shared by %d calls failed (%s); retrying call by call",
                len(callers),
                type(exc).__name__,
            )
        out: list[ScoreResult | None] = [None] * len(batch)
        for caller in callers:
            at = [k for k, (_, _, c) in enumerate(batch) if c is caller]
            try:
                part = await self._run_batch([batch[k][1] for k in at])
            except Exception as exc:
                caller.fail(exc)
                continue
            for k, result in zip(at, part, strict=True):
                out[k] = result
        return out

    def _observe(
        self,
        batch: list[tuple[int, SpanRequest, _Caller]],
        callers: list[_Caller],
        started: float,
        seconds: float,
    ) -> None:
        first = [c for c in callers if not c.started]
        for caller in first:
            caller.started = True
        padded = len(batch) * max(len(req.token_ids) for _, req, _ in batch)
        if padded and seconds > 0:
            pace = seconds / padded
            old = self._s_per_token
            self._s_per_token = pace if old is None else old + _PACE_WEIGHT * (pace - old)
        stats = ForwardStats(
            prompts=len(batch),
            callers=len(callers),
            padded_tokens=padded,
            token_budget=self._token_budget,
            waits_s=tuple(started - c.enqueued for _, _, c in batch),
            queue_waits_s=tuple(started - c.enqueued for c in first),
            seconds=seconds,
        )
        for observer in self._observers:
            try:
                observer(stats)
            except Exception:  # a metrics bug must not stop the engine
                logger.exception("forward observer failed")

    def _take(self) -> tuple[list[tuple[int, SpanRequest, _Caller]], list[_Caller]]:
        """The next forward: the oldest caller's prompts while they fit, then one prompt per
        other caller per pass (``_offer``), the offers that pad least first, while the budgets
        allow."""
        batch: list[tuple[int, SpanRequest, _Caller]] = []
        self._queue = [c for c in self._queue if c.pending]
        if not self._queue:
            return batch, []
        # Callers' calls first, oldest first; the service's own only when no caller waits,
        # alone and in short forwards (module docstring).
        callers_first = [c for c in self._queue if not c.background]
        background = not callers_first
        fill = BatchFill(
            token_budget=self._background_budget() if background else self._token_budget,
            row_budget=self._row_budget,
            head_mode=self._head_mode,
        )
        eligible = self._queue if background else callers_first
        oldest = eligible[0]
        while oldest.pending:
            at = _offer(oldest.pending, fill.width)
            index, req = oldest.pending[at]
            if not fill.fits(req):
                break
            fill.add(req)
            del oldest.pending[at]
            batch.append((index, req, oldest))
        active = [c for c in eligible[1:] if c.pending]
        while active:
            # Each pass: one prompt per caller, the offers that pad least first.
            width = fill.width
            offers = sorted(
                ((c, _offer(c.pending, width)) for c in active),
                key=lambda o: abs(len(o[0].pending[o[1]][1].token_ids) - width),
            )
            active = []
            for caller, at in offers:
                index, req = caller.pending[at]
                if not fill.fits(req):
                    continue  # out of this forward; its prompts stay queued
                fill.add(req)
                del caller.pending[at]
                batch.append((index, req, caller))
                if caller.pending:
                    active.append(caller)
        callers = list(dict.fromkeys(c for _, _, c in batch))
        # Arrival order is kept: callers with nothing left to pack leave the queue.
        self._queue = [c for c in self._queue if c.pending]
        return batch, callers

    def _background_budget(self) -> int:
        """Padded tokens a forward of the service's own work alone may take: about
        ``BACKGROUND_FORWARD_S`` at the measured pace, within the normal budget; before any
        forward was timed, 0 (one prompt a forward: ``BatchFill`` takes one whatever its size).
        """
        if self._s_per_token is None:
            return 0
        return min(self._token_budget, int(BACKGROUND_FORWARD_S / self._s_per_token))


def _offer(pending: deque[tuple[int, SpanRequest]], width: int) -> int:
    """Which of a caller's queued prompts (longest first) joins a forward ``width`` wide: the
    longest that does not widen it, else the shortest, which widens it least. With an empty
    forward (``width`` 0) that is the longest, so a call alone batches as ``plan_batches``."""
    if width == 0:
        return 0
    for at, (_, req) in enumerate(pending):
        if len(req.token_ids) <= width:
            return at
    return len(pending) - 1
