"""The engine's supervision: load it, warm it up, watch it, and stop the process when it dies.

The app's lifespan starts ``supervise`` as a task and returns at once, so the server answers
probes while the model loads (``/health`` 200, ``/ready`` 503). The supervisor loads the
backend in a worker thread, runs one real scoring request (warm-up, ``serving.canaries``)
before ``/ready`` turns 200, then runs a tiny canary whenever no real request has proved the
engine alive for ``canary_interval_s``, or at once when a request saw the engine fail. A dead
engine, or ``canary_failures_fatal`` failures in a row, makes ``/health`` 503 and calls
``Lifecycle.on_fatal``: ``entrypoints.server`` then stops the process with a non-zero status
so Kubernetes restarts it (an in-process engine cannot be revived, vLLM's cannot either). A
remote engine that is down makes ``/ready`` 503 only: it recovers on its own, and what comes
back is checked again before it scores.
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.to_thread

from service.backends.base import LogprobBackend
from service.backends.engines.engine_socket import SocketBackend
from service.backends.engines.remote_backend import RemoteBackend
from service.backends.factory import create_backend, size_threads
from service.backends.scheduling.scheduler import ForwardScheduler, ForwardStats
from service.backends.transport.engine_client import EngineClient
from service.backends.transport.engine_load import EngineLoad
from service.errors import (
    BackendUnavailable,
    EngineMismatch,
    EngineTimeout,
    EngineUnavailable,
)
from service.learning.answer_likelihood import AnswerLikelihood, TieBreakLimits
from service.prompting.templates import get_template
from serving.admission.backends import MeteredBackend
from serving.canaries import NO_ANSWER, DefaultRequest, measure_rates, probe, remeasure_loop
from serving.context import AppContext, Lifecycle

log = logging.getLogger(__name__)

# Longest wait between two attempts to reach a remote engine that is down.
_ENGINE_RETRY_MAX_S = 5.0
_LOCAL_ENGINE_RETRY_S = 0.25
_JOIN_POLL_S = 0.02


async def supervise(
    ctx: AppContext, given: LogprobBackend | None, default_request: DefaultRequest
) -> None:
    """Load, warm up, then watch the engine (``default_request``: what the routes make of a
    request naming no strategy, run once in the warm-up). Never raises: failures go to
    ``Lifecycle.fail`` (an unexpected exception too: logged with its traceback, ``/health``
    503, the process restarted by its orchestrator, never a supervisor that died silently)."""
    try:
        await _load_and_watch(ctx, given, default_request)
    except Exception as exc:
        log.exception("the engine supervisor failed")
        ctx.lifecycle.fail(f"the engine supervisor failed ({type(exc).__name__})")


async def until_serving(lc: Lifecycle) -> None:
    """Wait until the worker is ready, failed or told to stop.

    The kernel hands each new connection on a shared socket to any worker accepting on it. A
    worker still loading or warming up would answer its share 503 while the others serve (one
    restarted after a crash; the slower one at start, after ``/ready`` already said 200), so
    it accepts only once it can serve, as vLLM's API servers start serving only once the
    engine core is up. Until the first worker is ready nothing accepts: connections wait in
    the socket's backlog and probes time out (the chart's startup probe allows for it).
    """
    while not (lc.ready or lc.fatal is not None or lc.draining):
        await anyio.sleep(_JOIN_POLL_S)


async def _load_and_watch(
    ctx: AppContext, given: LogprobBackend | None, default_request: DefaultRequest
) -> None:
    lc = ctx.lifecycle
    log.info("CPUs: %s", ctx.cpus.describe(ctx.settings.solver_processes))
    try:
        if given is not None:
            backend = given
        else:
            # abandon_on_cancel: a SIGTERM during a long load must not wait for it to finish.
            await anyio.to_thread.run_sync(size_threads, ctx.settings, ctx.cpus)
            backend = await anyio.to_thread.run_sync(
                create_backend, ctx.settings, abandon_on_cancel=True
            )
    except Exception as exc:
        log.exception("loading the scoring backend failed")
        lc.fail(f"loading the model failed ({type(exc).__name__})")
        return
    ctx.engine.backend = backend
    # auto's background runs go to the engine directly, only while no request uses it, and
    # are timed into admission's rate: the service's own work re-measures the engine.
    ctx.engine.learner.shadow_backend = MeteredBackend(backend, ctx.admission)
    ctx.engine.learner.idle = lambda: ctx.admission.tokens_in_flight == 0
    load = _engine_load(ctx, backend)
    if load is not None:
        # A remote engine may serve other replicas and applications too: their work counts
        # as well, as far as the engine's own queue tells (read in the background).
        ctx.engine.learner.idle = lambda: ctx.admission.tokens_in_flight == 0 and not load.busy()
    if ctx.engine.learner.generator is not None:
        # The generator's answers held by several passages go to the likeliest under the
        # scorer (service.learning.answer_likelihood), scored as the service's own work,
        # held to a request's limits and deadline, and only while no caller's work is on
        # the engine (issue 90: vLLM and a remote engine give it no background priority).
        ctx.engine.learner.generator.likelihood = AnswerLikelihood(
            ctx.engine.learner.shadow_backend,
            TieBreakLimits.from_settings(ctx.settings),
            idle=ctx.engine.learner.idle,
        )
    scheduler = getattr(backend, "scheduler", None)
    if isinstance(scheduler, ForwardScheduler):
        ctx.metrics.track_scheduler(scheduler)

        def forwarded(_stats: ForwardStats) -> None:
            lc.progressed()

        scheduler.add_observer(forwarded)
    client = getattr(backend, "client", None)
    if isinstance(client, EngineClient):
        ctx.metrics.track_engine(client)
    ctx.metrics.build_info.labels(ctx.version, backend.model_id, type(backend).__name__).set(1)
    lc.mark(loaded=True)
    log.info("backend %s loaded: %s", type(backend).__name__, backend.model_id)
    if isinstance(backend, RemoteBackend) and not await _connect(ctx, backend):
        return
    if isinstance(backend, SocketBackend):
        backend.on_lost = lc.suspect
        await _reach_engine_process(ctx)
    check_score_mode = getattr(backend, "check_score_mode", None)
    if check_score_mode is not None:
        # vLLM's fast score path earns its place before /ready
        # (service.backends.engines.score_mode_check).
        try:
            check = await check_score_mode()
        except BackendUnavailable as exc:
            lc.fail(f"score mode check failed: {exc}")
            return
        if check is not None:  # None: an engine process without vLLM's check
            ctx.engine.score_mode_check = check
            ctx.metrics.score_mode.labels(check.mode, check.outcome).set(1)
    if ctx.settings.warmup:
        error, _ = await probe(ctx, backend, "warmup")
        if error is None and ctx.settings.strategy not in ("moi", "auto"):
            # The server's default strategy once, as a request naming none gets it: loads what
            # it loads on first use (the dense encoder) and refuses a default that cannot run
            # (bias_matched with no profile to place by) before ready, not on every request.
            # (auto runs MoI, as the probe above did, until it trusts a profile; its ranker
            # is loaded after ready.)
            error, _ = await probe(ctx, backend, "warmup", default_request=default_request)
        if error is not None:
            lc.fail(f"warm-up failed: {error}")
            return
        if get_template(ctx.settings.chat_template).completion:
            # Its answers stop at line breaks, found by decoding the whole vocabulary (2.4 s
            # for Gemma-3's 262k ids): here, not in the first request that answers.
            await anyio.to_thread.run_sync(lambda: backend.tokenizer.line_break_ids)
    if ctx.settings.rate_canary and not (
        # The warm-up's rate is a tiny probe's (fixed costs dominate: 15 tokens/s against 450
        # on this CPU) and it measures no decode: with warm-up on, the rate canary measures
        # both before ready, so the first request, a generating one too, is priced by this
        # machine's rates (issue 77: a first lore priced by a prior, then a 504). Without
        # warm-up, or if it fails, as soon as the engine is idle after ready.
        ctx.settings.warmup and await measure_rates(ctx, backend, "start")
    ):
        ctx.admission.remeasure("start")
    lc.mark(warmed=True)
    log.info("ready")
    await ctx.engine.learner.ready_if_trusted()
    async with anyio.create_task_group() as tg:
        if ctx.settings.rate_canary:
            tg.start_soon(remeasure_loop, ctx, backend)
        if load is not None:
            tg.start_soon(load.run)
        await _watch(ctx, backend)
        tg.cancel_scope.cancel()


def _engine_load(ctx: AppContext, backend: LogprobBackend) -> EngineLoad | None:
    """The remote engine's queue for ``auto``'s background runs; ``None`` for an engine
    only this process uses, or with ``engine_idle_poll_s`` 0."""
    if not isinstance(backend, RemoteBackend) or ctx.settings.engine_idle_poll_s <= 0:
        return None
    load = EngineLoad(
        backend.client,
        lambda: backend.prompts_in_flight,
        poll_s=ctx.settings.engine_idle_poll_s,
        grace_s=ctx.settings.engine_metrics_grace_s,
    )
    ctx.engine.engine_load = load
    ctx.metrics.track_engine_load(load)
    return load


async def _connect(ctx: AppContext, backend: RemoteBackend) -> bool:
    """Reach the remote engine and check it (model, context, tokenizer probe), retrying while
    it is down or answers oddly (``/ready`` 503 with the reason meanwhile); ``False`` (and a
    fatal lifecycle) only when it provably serves another model or tokenizer."""
    delay = 0.5
    while True:
        ok = await _check_engine(ctx, backend)
        if ok is not None:
            return ok
        await anyio.sleep(delay)
        delay = min(2 * delay, _ENGINE_RETRY_MAX_S)


async def _reach_engine_process(ctx: AppContext) -> None:
    """Wait for the shared engine process (``entrypoints.workers``; it may still be loading the
    model), ``/ready`` 503 with the reason meanwhile."""
    delay = 0.1
    while not await ctx.reach_engine_process():
        await anyio.sleep(delay)
        delay = min(2 * delay, _ENGINE_RETRY_MAX_S)


async def _check_engine(ctx: AppContext, backend: RemoteBackend) -> bool | None:
    """One connect: ``True`` checked, ``False`` a proven mismatch (fatal), ``None`` not now."""
    lc = ctx.lifecycle
    try:
        await backend.connect()
    except EngineMismatch as exc:
        lc.fail(f"the remote engine does not match the configuration: {exc.message}")
        return False
    except (EngineUnavailable, EngineTimeout) as exc:
        lc.engine(exc.message)
        return None
    except Exception as exc:
        # Whatever else a proxy or a half-deployed engine answers: not ready, retried, logged.
        log.exception("checking the remote engine failed")
        lc.engine(f"checking the engine failed ({type(exc).__name__})")
        return None
    lc.engine(None)
    return True


async def _watch(ctx: AppContext, backend: LogprobBackend) -> None:
    lc = ctx.lifecycle
    while lc.alive:
        wake = lc.wake
        assert wake is not None
        # While a remote engine is down, look again every few seconds: it recovers on its own.
        interval = ctx.settings.canary_interval_s
        if lc.engine_down is not None:
            # The engine process on this host: a failed connect costs nothing, and its restart
            # should be noticed as soon as it serves.
            retry = (
                _LOCAL_ENGINE_RETRY_S if isinstance(backend, SocketBackend) else _ENGINE_RETRY_MAX_S
            )
            interval = min(interval, retry) if interval > 0 else retry
        if interval > 0:
            with anyio.move_on_after(interval):
                await wake.wait()
        else:
            await wake.wait()
        suspected = wake.is_set()
        lc.wake = anyio.Event()
        recent = lc.last_success is not None and time.monotonic() - lc.last_success < interval
        if lc.draining or (recent and not suspected and lc.engine_down is None):
            continue  # real traffic is proving the engine alive; don't compete with it
        if lc.engine_down is not None and isinstance(backend, SocketBackend):
            # The engine process restarting: a failed connect is not a failed canary.
            if not await ctx.reach_engine_process():
                continue
        elif lc.engine_down is not None and isinstance(backend, RemoteBackend):
            # The engine was down: what comes back may be a redeploy (other weights under the
            # same name, a smaller context). Check it all again before scoring on it.
            checked = await _check_engine(ctx, backend)
            if checked is False:
                return
            if checked is None:
                continue
            if backend.weights_changed_at_reconnect:
                # Profiles learned on the old weights may no longer describe it; auto's
                # explore runs and drift test find out, this says when it started.
                ctx.metrics.engine_weight_changes.inc()
        started = time.monotonic()
        error, dead = await probe(ctx, backend, "canary")
        if error is None or lc.engine_down is not None:
            continue  # a remote engine that is down is not a reason to restart this process
        if error == NO_ANSWER and _progressing(ctx, started):
            # Queued behind admitted work that is progressing (oldest first: the canary waits
            # its turn): the engine is busy, not dead. Only no progress on any call counts.
            ctx.metrics.canary_deferred.inc()
            log.info(
                "canary waited %.0f s behind work that is progressing: not a failure",
                time.monotonic() - started,
            )
            continue
        lc.canary_failures += 1
        log.warning("canary failed (%d in a row): %s", lc.canary_failures, error)
        if dead or lc.canary_failures >= ctx.settings.canary_failures_fatal:
            lc.fail(f"canary failed {lc.canary_failures} time(s): {error}")


def _progressing(ctx: AppContext, since: float) -> bool:
    """Whether the engine shows progress: a forward or a call finished after ``since``, or,
    while admitted work is in flight, a call finished within the last request deadline (a
    single call may hold the engine longer than the canary's deadline; an engine that
    finishes nothing for a whole ``request_timeout_s`` while work waits is stuck)."""
    lc = ctx.lifecycle
    marks = [
        t for t in (lc.progress_at, lc.last_success, ctx.admission.meter.last_end) if t is not None
    ]
    if not marks:
        return False
    last = max(marks)
    if last > since:
        return True
    window = max(ctx.settings.request_timeout_s, ctx.settings.canary_timeout_s)
    return ctx.admission.tokens_in_flight > 0 and time.monotonic() - last < window
