"""The app factory and its lifespan: load the engine, warm it up, watch it, close it.

``create_app`` does no I/O. The lifespan starts a supervisor task and returns at once, so the
server answers probes while the model loads (``/health`` 200, ``/ready`` 503). The supervisor
loads the backend in a worker thread, runs one real scoring request (warm-up) before
``/ready`` turns 200, then runs a tiny canary whenever no real request has proved the engine
alive for ``canary_interval_s``, or at once when a request saw the engine fail. A dead engine,
or ``canary_failures_fatal`` failures in a row, makes ``/health`` 503 and calls
``Lifecycle.on_fatal``: ``app.server`` then stops the process with a non-zero status so
Kubernetes restarts it (an in-process engine cannot be revived, vLLM's cannot either).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import anyio
import anyio.to_thread
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import SecretStr

from app import response_cache
from app.admission import Admission, MeteredBackend
from app.errors import install_error_handlers
from app.metrics import ServiceMetrics
from app.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from app.routes import batch, feedback, info, probes, profiles, reorder, rerank
from app.schemas.reorder import ReorderOptions
from app.state import AppContext, Engine, Lifecycle
from service.backends.base import LogprobBackend
from service.backends.engine_client import EngineClient
from service.backends.engine_load import EngineLoad
from service.backends.engine_socket import SocketBackend, unmetered
from service.backends.factory import create_backend, size_threads
from service.backends.remote_backend import RemoteBackend
from service.backends.scheduler import ForwardScheduler, ForwardStats
from service.config.settings import Settings
from service.errors import (
    BackendUnavailable,
    ClientError,
    EngineMismatch,
    EngineTimeout,
    EngineUnavailable,
)
from service.learning.answer_likelihood import AnswerLikelihood, TieBreakLimits
from service.learning.generator_online import GeneratorSampler
from service.learning.learner import (
    ProfileLearner,
    allowed_to_learn,
    generator_rules_of,
)
from service.learning.outcomes import OutcomeMonitor
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.prompting.templates import get_template
from service.runtime import tracing
from service.runtime.cpus import process_budget
from service.runtime.processes import close_shared
from service.runtime.shared_counts import SharedCounts
from service.runtime.throughput import FRESH_S, ThroughputMeter
from service.state.state_store import open_state
from service.state.traffic import TrafficSampler

log = logging.getLogger(__name__)

# Longest wait between two attempts to reach a remote engine that is down.
_ENGINE_RETRY_MAX_S = 5.0
_LOCAL_ENGINE_RETRY_S = 0.25
_JOIN_POLL_S = 0.02

# The warm-up and canary request: two short passages, the default design (two prompts of one
# passage each), so it costs two tiny forwards and still runs tokenizer, model and solver.
PROBE_QUERY = "What is the capital of France?"
PROBE_PASSAGES = (
    Passage(text="Paris is the capital and largest city of France."),
    Passage(text="Berlin is the capital of Germany."),
)


# A canary that timed out (a failure only if nothing else progressed meanwhile).
_NO_ANSWER = "no answer within the canary's deadline (canary_timeout_s)"

# The rate canary (issue 70): four passages of a few sentences, each prompt two of them, so a
# few hundred prompt tokens a prompt: large enough that fixed costs do not dominate the rate,
# a few seconds on a CPU and milliseconds on a GPU.
RATE_QUERY = "Which river flows through the capital of the country described here?"
RATE_PASSAGES = tuple(
    Passage(text=" ".join([text] * 4))
    for text in (
        "Paris is the capital and largest city of France, on the river Seine.",
        "Berlin is the capital of Germany; the Spree and the Havel flow through it.",
        "Madrid, the capital of Spain, lies on the Manzanares in the centre of the country.",
        "Rome, the capital of Italy, was built on seven hills beside the river Tiber.",
    )
)
# At most one rate canary this often, however many refusals ask for one.
_REMEASURE_MIN_S = 10.0
# How often the rate canary's loop looks at the estimate's age.
_REMEASURE_POLL_S = 30.0
# The rate canary starts only once the engine has been idle this long: a refused caller, or
# a client sending one request after another, sends its next request within milliseconds of
# the last answer, and a canary started then had its forward (about 1.5 s on a 2-core CPU)
# sit in front of that request. It is preempted when a request arrives either way.
_REMEASURE_IDLE_S = 1.0


def _version() -> str:
    try:
        return version("rag-reorder")
    except PackageNotFoundError:  # running from a checkout that was not pip-installed
        return "0+unknown"


def create_app(
    settings: Settings,
    backend: LogprobBackend | None = None,
    *,
    shared: SharedCounts | None = None,
    meter: ThroughputMeter | None = None,
) -> FastAPI:
    """Build the HTTP app.

    Args:
        settings: the service configuration.
        backend: a ready backend (tests pass ``FakeBackend``); default: the lifespan builds
            one with ``service.backends.factory.create_backend``. Either way the lifespan
            closes it on shutdown.
        shared: one of several worker processes on one engine (``app.workers``): the
            in-flight counts admission shares with the others.
        meter: with ``shared``, the engine process's meter (``SocketBackend.meter``).

    Returns:
        The FastAPI app; its context is ``app.state.ctx`` (``app.state.AppContext``).

    Raises:
        ValueError: ``api_key`` or ``admin_api_key`` is set but blank.
    """
    metrics = ServiceMetrics()
    # Off unless an endpoint is set (docs/tracing.md); per process, so each worker its own.
    tracing.configure(
        settings.otel_endpoint,
        service_version=_version(),
        export_timeout_s=settings.otel_export_timeout_s,
        max_queue_spans=settings.otel_max_queue_spans,
    )
    # What the process may use (affinity, cgroup quota, the `cpus` setting): torch's threads
    # and the solver pool are sized from it, not from the host's count (issue 70).
    cpus = process_budget(settings.cpus)
    # The folder, or Redis (`state_url`): nothing connects before the lifespan starts it.
    state = open_state(settings)
    store = state.profiles
    ctx = AppContext(
        settings=settings,
        version=_version(),
        lifecycle=Lifecycle(metrics),
        engine=Engine(
            store,
            TrafficSampler(
                settings.traffic_sample_rate,
                settings.traffic_sample_max_runs,
                spool=state.spool("sample", settings.traffic_sample_max_runs, None)
                if settings.traffic_sample_rate > 0
                else None,
            ),
            ProfileLearner(
                settings,
                store,
                allowed=allowed_to_learn(settings),
                prepare=_ranker_loader(settings),
                state=state,
            ),
            state,
        ),
        admission=Admission(settings, metrics, shared, meter),
        metrics=metrics,
        cpus=cpus,
    )
    app = FastAPI(
        title="rag-reorder",
        version=ctx.version,
        summary="Debiased passage ordering for RAG: native reorder API and Cohere-style rerank.",
        lifespan=_lifespan(ctx, backend, join_when_ready=shared is not None),
        redoc_url=None,
    )
    if settings.generator_url is not None or settings.feedback_max_requests > 0:
        # auto learns the generator's own profile from its answers (docs/generator-profile.md):
        # its sampled calls, and the answers fed back to POST /v1/feedback.
        spool = state.spool("auto/generator", settings.generator_max_answers, None)
        assert spool is not None  # every store keeps auto's spools
        served = (
            state.records(
                "served",
                max_records=settings.feedback_max_requests,
                max_bytes=settings.feedback_max_bytes,
                ttl_s=settings.feedback_ttl_s,
            )
            if settings.feedback_max_requests > 0
            else None
        )
        ctx.engine.learner.generator = GeneratorSampler(
            settings, store, spool, generator_rules_of(settings), served=served
        )
        metrics.track_generator(ctx.engine.learner.generator)
        if settings.holdout_rate > 0 and settings.feedback_max_requests > 0:
            # The randomized holdout and the uplift (docs/outcomes.md): the outcomes in the
            # state store, read by every worker and replica.
            outcomes = state.spool("auto/outcomes", settings.outcome_max_outcomes, None)
            assert outcomes is not None  # every store keeps auto's spools
            ctx.engine.learner.outcomes = OutcomeMonitor(settings, outcomes)
            metrics.track_outcomes(ctx.engine.learner.outcomes)
    metrics.track_traffic(ctx.engine.traffic)
    metrics.track_auto(ctx.engine.learner)
    metrics.track_state(state)
    metrics.track_capacity(lambda: ctx.admission.estimated_wait_s, ctx.admission.meter)
    app.state.ctx = ctx
    app.state.response_cache = response_cache.build(settings, state, metrics)
    install_error_handlers(app)
    for module in (reorder, batch, rerank, profiles, feedback, info, probes):
        app.include_router(module.router)
    # add_middleware wraps: the last added runs first. Order on the way in:
    # request context -> CORS (if configured) -> body limit (413) -> API key (401, 403) -> routes.
    keys = {
        name: _key(name, secret)
        for name, secret in (
            ("API_KEY", settings.api_key),
            ("ADMIN_API_KEY", settings.admin_api_key),
        )
        if secret is not None
    }
    if keys or not settings.open_writes:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=keys.get("API_KEY"),
            admin_key=keys.get("ADMIN_API_KEY"),
            open_writes=settings.open_writes,
        )
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RequestContextMiddleware)
    return app


def _key(name: str, secret: SecretStr) -> str:
    key = secret.get_secret_value()
    if not key.strip():
        # Fail closed and loudly: an empty secret is a deployment mistake, not "no auth".
        raise ValueError(f"RAG_REORDER_{name} is set but empty; unset it to disable it")
    return key


def _lifespan(
    ctx: AppContext, given: LogprobBackend | None, *, join_when_ready: bool = False
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Args:
    join_when_ready: one of several workers on a shared socket (``app.workers``): the
        lifespan returns, and uvicorn starts accepting, only once this worker can serve.
    """

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.lifecycle.wake = anyio.Event()
        state = ctx.engine.state
        state.start()
        # A restarted replica places by what Redis holds from its first request when Redis
        # answers at once; one that does not answer delays the start by this much only.
        await anyio.to_thread.run_sync(state.wait_loaded, 2 * ctx.settings.state_timeout_s)
        # A plain task rather than a task group held across the yield: a task group would wrap
        # every exception thrown into the lifespan (test failures, shutdown) in a group.
        loop = asyncio.get_running_loop()
        supervisor = loop.create_task(_supervise(ctx, given))
        # auto's learning and drift checks: beside the requests, never in their path.
        learner = loop.create_task(ctx.engine.learner.run_forever())
        shadows = loop.create_task(ctx.engine.learner.run_shadows())
        tasks = {supervisor, learner, shadows}
        # One of several workers: its scrape-time counters reach the others' scrapes (in one
        # process this returns at once).
        tasks.add(loop.create_task(ctx.metrics.sync_forever()))
        sampler = ctx.engine.learner.generator
        if sampler is not None:
            # The generator's sampled calls: in the background, never awaited by a request.
            tasks.add(loop.create_task(sampler.run_forever()))
        if ctx.engine.learner.outcomes is not None:
            tasks.add(loop.create_task(ctx.engine.learner.outcomes.run_forever()))
        _say_who_places(ctx.settings)
        if join_when_ready:
            await _until_serving(ctx.lifecycle)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            if sampler is not None:
                await sampler.aclose()
        backend = ctx.engine.backend
        ctx.engine.backend = None
        if backend is not None:
            # Shielded: shutdown may itself be a cancellation, and the engine must be released.
            with anyio.move_on_after(30, shield=True):
                await backend.aclose()
            log.info("backend closed")
        # The last sampled runs still on their way to the shared traffic folder.
        await anyio.to_thread.run_sync(ctx.engine.traffic.close)
        await anyio.to_thread.run_sync(ctx.engine.learner.close)
        # Then what is still queued for Redis (a bounded wait).
        await anyio.to_thread.run_sync(ctx.engine.state.close)
        await anyio.to_thread.run_sync(close_shared)
        if ctx.settings.otel_endpoint is not None:
            # The spans still queued: one bounded flush, after the requests have drained.
            await anyio.to_thread.run_sync(tracing.shutdown, ctx.settings.otel_export_timeout_s)

    return lifespan


def _ranker_loader(settings: Settings) -> Callable[[], object] | None:
    """What loads ``auto``'s cheap-path ranker (the dense encoder, about a second), so the
    learner can load it before it places the first request by a trusted profile."""
    if settings.auto_ranker != "dense":
        return None

    def load() -> object:
        from service.backends.embedding import encoder

        return encoder(settings)

    return load


def _say_who_places(settings: Settings) -> None:
    """Log, at start, whose position profile ``auto`` will place by (the scoring model's
    learned one describes the generator only when they are the same model)."""
    gen = settings.generator_model
    if gen is None or gen == settings.model:
        return
    if settings.generator_url is not None and settings.placement_profile is None:
        log.info(
            "the scoring model %s is not the generator %s: auto learns the generator's profile "
            "from its answers to %g of its requests (at most %d calls an hour) and places by "
            "it once trusted", settings.model, gen, settings.generator_sample_rate,
            settings.generator_max_calls_per_hour,
        )  # fmt: skip
        return
    if settings.placement_profile is not None:
        log.info(
            "the scoring model %s is not the generator %s: auto places by the named profile %s",
            settings.model, gen, settings.placement_profile,
        )  # fmt: skip
    elif settings.auto_learn_from_scorer:
        log.warning(
            "the scoring model %s is not the generator %s: auto places by the profile it "
            "learns from the scorer (RAG_REORDER_AUTO_LEARN_FROM_SCORER)", settings.model, gen,
        )  # fmt: skip
    else:
        log.warning(
            "the scoring model %s is not the generator %s and no generator profile is named: "
            "auto runs MoI on every request; name the generator's profile "
            "(RAG_REORDER_PLACEMENT_PROFILE, from `rag-reorder profile-generator`) or allow "
            "the scorer's (RAG_REORDER_AUTO_LEARN_FROM_SCORER)", settings.model, gen,
        )  # fmt: skip


async def _supervise(ctx: AppContext, given: LogprobBackend | None) -> None:
    """Load, warm up, then watch the engine. Never raises: failures go to ``Lifecycle.fail``
    (an unexpected exception too: logged with its traceback, ``/health`` 503, the process
    restarted by its orchestrator, never a supervisor that died silently)."""
    try:
        await _load_and_watch(ctx, given)
    except Exception as exc:
        log.exception("the engine supervisor failed")
        ctx.lifecycle.fail(f"the engine supervisor failed ({type(exc).__name__})")


async def _until_serving(lc: Lifecycle) -> None:
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


async def _load_and_watch(ctx: AppContext, given: LogprobBackend | None) -> None:
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
        # vLLM's fast score path earns its place before /ready (service.backends.score_mode_check).
        try:
            check = await check_score_mode()
        except BackendUnavailable as exc:
            lc.fail(f"score mode check failed: {exc}")
            return
        if check is not None:  # None: an engine process without vLLM's check
            ctx.engine.score_mode_check = check
            ctx.metrics.score_mode.labels(check.mode, check.outcome).set(1)
    if ctx.settings.warmup:
        error, _ = await _probe(ctx, backend, "warmup")
        if error is None and ctx.settings.strategy not in ("moi", "auto"):
            # The server's default strategy once, as a request naming none gets it: loads what
            # it loads on first use (the dense encoder) and refuses a default that cannot run
            # (bias_matched with no profile to place by) before ready, not on every request.
            # (auto runs MoI, as the probe above did, until it trusts a profile; its ranker
            # is loaded after ready.)
            error, _ = await _probe(ctx, backend, "warmup", default_strategy=True)
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
        ctx.settings.warmup and await _measure_rates(ctx, backend, "start")
    ):
        ctx.admission.remeasure("start")
    lc.mark(warmed=True)
    log.info("ready")
    await ctx.engine.learner.ready_if_trusted()
    async with anyio.create_task_group() as tg:
        if ctx.settings.rate_canary:
            tg.start_soon(_remeasure, ctx, backend)
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
    """Wait for the shared engine process (``app.workers``; it may still be loading the
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
        error, dead = await _probe(ctx, backend, "canary")
        if error is None or lc.engine_down is not None:
            continue  # a remote engine that is down is not a reason to restart this process
        if error == _NO_ANSWER and _progressing(ctx, started):
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


async def _remeasure(ctx: AppContext, backend: LogprobBackend) -> None:
    """Re-measure the engine's rate when it is in doubt (issue 70): asked for by admission
    (a refusal, or work over its deadline on an unconfirmed rate), or stale (no measurement
    for ``FRESH_S``). Waits for an idle engine, scores the rate canary timed into the meter,
    and is preempted like ``auto``'s background runs when a request arrives. Never raises."""
    admission = ctx.admission
    wake = anyio.Event()
    admission.on_remeasure = wake.set
    last = -_REMEASURE_MIN_S
    while True:
        now = time.monotonic()
        age = admission.meter.age_s(now)
        why = admission.remeasure_wanted or ("stale" if age is not None and age > FRESH_S else None)
        if why is None or now - last < _REMEASURE_MIN_S or not ctx.lifecycle.ready:
            # Nothing asked (or asked too soon after the last): until asked, or the next look.
            wait_s = _REMEASURE_POLL_S if why is None else _REMEASURE_MIN_S - (now - last)
            with anyio.move_on_after(max(0.05, wait_s)):
                await wake.wait()
            wake = anyio.Event()
            admission.on_remeasure = wake.set
            continue
        await _idle_for(admission, _REMEASURE_IDLE_S)
        last = time.monotonic()
        # Not measured (failed, or preempted by a request whose own calls measure the engine):
        # asked again later.
        await _measure_rates(ctx, backend, why)


async def _idle_for(admission: Admission, seconds: float, poll_s: float = 0.05) -> None:
    """Return once no request has used the engine for ``seconds`` on end."""
    idle_since: float | None = None
    while True:
        now = time.monotonic()
        if admission.tokens_in_flight:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= seconds:
            return
        await anyio.sleep(poll_s)


async def _measure_rates(ctx: AppContext, backend: LogprobBackend, why: str) -> bool:
    """Run the rate canary, count and log how it ended; whether it measured. Never raises."""
    admission = ctx.admission
    meter = admission.meter
    before = meter.tokens_per_s, meter.decode_tokens_per_s
    try:
        measured = await _rate_probe(ctx, backend)
    except Exception as exc:
        log.warning("rate canary failed: %s", exc)
        ctx.metrics.rate_probes.labels(why, "failed").inc()
        return False
    if not measured:
        ctx.metrics.rate_probes.labels(why, "preempted").inc()
        return False
    admission.remeasure_wanted = None
    ctx.metrics.rate_probes.labels(why, "measured").inc()
    log.info(
        "engine rate measured (%s) in %.1f s: %s prompt tokens/s, %s answer tokens/s of "
        "decode (was %s, %s)",
        why,
        admission.remeasure_s,
        *(_rate(r) for r in (meter.tokens_per_s, meter.decode_tokens_per_s, *before)),
    )
    return True


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0f}"


async def _rate_probe(ctx: AppContext, backend: LogprobBackend) -> bool:
    """Score the rate canary on the metered backend, then generate its short answers (issue
    77: decode is measured on this machine, not priced by ``DECODE_PRIOR``); ``False`` if a
    request arrived first (cancelled at once: the service's own work never delays a caller).
    """
    reorderer = Reorderer(MeteredBackend(backend, ctx.admission), ctx.settings, ctx.engine.profiles)
    rid = f"rate-{time.monotonic_ns():x}"
    scoring = ReorderRequest(
        RATE_QUERY, RATE_PASSAGES, request_id=rid, design=DesignSpec(kind="pruned_random")
    )
    # Then one greedy answer per passage (a lockstep batch of four) with the default answer
    # budget, as lore generates: the decode rate is per answer-budget token, so the canary's
    # answers must stop where real ones do. After the scoring half, so its prompts' share is
    # priced at the prefill rate just measured and the rest is decode.
    generating = ReorderRequest(RATE_QUERY, RATE_PASSAGES, strategy="lore", request_id=f"{rid}-g")
    t0 = time.monotonic()
    done = False
    async with anyio.create_task_group() as tg:

        async def preempt() -> None:
            while ctx.admission.tokens_in_flight == 0:
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

        async def run() -> None:
            nonlocal done
            with anyio.fail_after(ctx.settings.canary_timeout_s):
                await reorderer.reorder(scoring)
                try:
                    await reorderer.reorder(generating)
                except Exception as exc:
                    # An engine or template that cannot generate still has its prefill rate
                    # measured; generating requests keep the decode prior.
                    log.warning("rate canary: the generation half failed: %s", exc)
            done = True
            tg.cancel_scope.cancel()

        tg.start_soon(preempt)
        tg.start_soon(run)
    if done:
        ctx.admission.remeasure_s = time.monotonic() - t0
    return done


async def _probe(
    ctx: AppContext, backend: LogprobBackend, what: str, *, default_strategy: bool = False
) -> tuple[str | None, bool]:
    """Run the tiny probe request: ``(None, False)`` if it scored, else (why, engine dead).

    The probe is MoI's (it scores, so it proves the engine), or with ``default_strategy`` a
    request naming no strategy, resolved as the routes resolve one.
    """
    reorderer = Reorderer(backend, ctx.settings, ctx.engine.profiles)
    request_id = f"{what}-{time.monotonic_ns():x}"
    if default_strategy:
        req = ReorderOptions().request(
            PROBE_QUERY, PROBE_PASSAGES, DesignSpec(), request_id, ctx.settings
        )
    else:
        req = ReorderRequest(PROBE_QUERY, PROBE_PASSAGES, request_id=request_id)
    error: str | None = None
    dead = False
    try:
        # Not timed into the engine process's meter (several workers): admission's rate is
        # of real work, as in one process, where this probe bypasses admission (issue 90).
        with unmetered(), anyio.fail_after(ctx.settings.canary_timeout_s):
            try:
                result = await reorderer.reorder(req)
            except EngineUnavailable as exc:
                if what != "canary":
                    raise
                # One connection cut mid-call (a keep-alive the engine or a proxy between was
                # closing) is not an engine down: every caller would get 503 until the next
                # check. The probe is the service's own and tiny, so it asks once more; an
                # engine really gone fails this too and is called down.
                log.info("canary: %s; asking the engine once more", exc.message)
                result = await reorderer.reorder(req)
        if result.usage.prompts_failed:
            error = f"{result.usage.prompts_failed} of {result.usage.prompts} prompts failed"
        else:
            # The engine's rate for deadline-aware admission from the first request: a low
            # estimate (the probe is tiny), so it errs toward refusing, and it counts only
            # until an admitted call completes.
            ctx.admission.seed(result.usage.prompt_tokens, result.timing.scoring_s)
    except TimeoutError:
        error = _NO_ANSWER
    except (EngineUnavailable, EngineTimeout) as exc:
        # A remote engine: down or slow now, not dead for good (readiness only).
        error = f"remote engine: {exc.message}"
        ctx.lifecycle.engine(exc.message)
        if isinstance(backend, RemoteBackend):
            # What answers next may be another deployment: no scoring until checked again.
            backend.mark_down(exc.message)
    except BackendUnavailable as exc:
        error, dead = f"engine unavailable: {exc.message}", True
    except ClientError as exc:
        # Only the configured defaults shape the probe: its refusal is a configuration error.
        error = f"the default {req.strategy!r} request is refused: {exc.message}"
    except Exception as exc:
        log.exception("%s request failed", what)
        error = f"{type(exc).__name__}"
    if error is None:
        ctx.lifecycle.succeeded()
        if ctx.lifecycle.engine_down is not None:
            ctx.lifecycle.engine(None)
    else:
        ctx.metrics.canary_failures.inc()
    return error, dead
