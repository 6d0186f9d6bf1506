"""The app factory and its lifespan: the context, routes and middleware; the lifespan starts the
engine's supervision (``serving.supervisor``: load, warm up, watch) and the background tasks,
and closes them all on shutdown.

``create_app`` does no I/O. The lifespan starts the supervisor as a task and returns at once,
so the server answers probes while the model loads (``/health`` 200, ``/ready`` 503).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import anyio
import anyio.to_thread
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import SecretStr

from app import response_cache
from app.errors import install_error_handlers
from app.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from app.routes import batch, feedback, info, probes, profiles, reorder, rerank
from app.schemas.reorder import ReorderOptions
from service.backends.base import LogprobBackend
from service.config.settings import Settings
from service.learning.generator_online import GeneratorSampler
from service.learning.learner import (
    ProfileLearner,
    allowed_to_learn,
    generator_rules_of,
)
from service.learning.outcomes import OutcomeMonitor
from service.passage import Passage
from service.pipeline import DesignSpec, ReorderRequest
from service.runtime import tracing
from service.runtime.cpus import process_budget
from service.runtime.processes import close_shared
from service.runtime.shared_counts import SharedCounts
from service.runtime.throughput import ThroughputMeter
from service.state.state_store import open_state
from service.state.traffic import TrafficSampler
from serving.admission.control import Admission
from serving.canaries import DefaultRequest
from serving.context import AppContext, Engine, Lifecycle
from serving.metrics import ServiceMetrics
from serving.supervisor import supervise, until_serving

log = logging.getLogger(__name__)


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
        backend: a ready backend (tests pass ``FakeBackend``); default: the engine's
            supervisor (``serving.supervisor``) builds one with
            ``service.backends.factory.create_backend``. Either way the lifespan closes it on
            shutdown.
        shared: one of several worker processes on one engine (``entrypoints.workers``): the
            in-flight counts admission shares with the others.
        meter: with ``shared``, the engine process's meter (``SocketBackend.meter``).

    Returns:
        The FastAPI app; its context is ``app.state.ctx`` (``serving.context.AppContext``).

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
    join_when_ready: one of several workers on a shared socket (``entrypoints.workers``): the
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
        supervisor = loop.create_task(supervise(ctx, given, _default_request(ctx.settings)))
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
            await until_serving(ctx.lifecycle)
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
        from service.backends.encoders.embedding import encoder

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


def _default_request(settings: Settings) -> DefaultRequest:
    """What the routes make of a body naming no strategy: the warm-up runs it once."""

    def build(query: str, passages: Sequence[Passage], request_id: str) -> ReorderRequest:
        return ReorderOptions().request(query, passages, DesignSpec(), request_id, settings)

    return build
