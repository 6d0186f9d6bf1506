"""``GET /v1/models`` (OpenAI shape) and ``GET /info`` (version, model and its distilled
adapter, limits, options)."""

from __future__ import annotations

import sys
import time
from typing import get_args

from fastapi import APIRouter

from app.conversions import trust_out
from app.dependencies import Ctx
from app.errors import GET_ERRORS
from app.routes.feedback import uplift_out
from app.schemas.base import PlacementName
from app.schemas.info import (
    AdapterOut,
    AgreementOut,
    AutoInfoOut,
    AutoProfileOut,
    CapacityOut,
    CpusOut,
    DenseOut,
    GeneratorOnlineOut,
    GeneratorProfileOut,
    InfoOut,
    LimitsOut,
    ModelCard,
    ModelList,
    OutcomesOut,
    ScoreModeOut,
)
from service.backends.engines.remote_backend import RemoteBackend
from service.errors import BackendUnavailable
from service.learning.generator_online import GeneratorSampler
from service.learning.outcomes import OutcomeMonitor
from service.model_assets.adapter import AdapterManifest, adapted_model_id, read_manifest
from service.prompting.templates import template_names
from service.strategies import ranking_strategy_names, strategy_names
from service.strategies.request import DesignKind
from serving.context import AppContext

router = APIRouter(tags=["info"])


def _model(ctx: AppContext, adapter: AdapterManifest | None) -> tuple[str, int | None]:
    backend = ctx.engine.backend
    if backend is None:
        # The id the backend will report once loaded, so a client reading it during the
        # load does not see the base model's id for a distilled scorer.
        return adapted_model_id(ctx.settings.model, adapter), None
    return backend.model_id, backend.max_model_len


def _adapter(ctx: AppContext) -> AdapterManifest | None:
    """The configured adapter's manifest; the backend checked it at load, so a file gone since
    only drops it from /info (the weights in memory are still the adapted ones)."""
    if ctx.settings.adapter is None:
        return None
    try:
        return read_manifest(ctx.settings.adapter)
    except BackendUnavailable:
        return None


def _adapter_out(m: AdapterManifest) -> AdapterOut:
    return AdapterOut(
        name=m.name,
        base_model=m.base_model,
        teacher=m.teacher,
        data=m.data,
        lora_r=m.lora_r,
        before=AgreementOut(**vars(m.before)),
        after=AgreementOut(**vars(m.after)),
    )


@router.get("/v1/models", response_model=ModelList, responses=GET_ERRORS, summary="Models")
async def models(ctx: Ctx) -> ModelList:
    """The scoring model (with its distilled adapter, if any) and its context length (null
    until loaded)."""
    adapter = _adapter(ctx)
    model, max_len = _model(ctx, adapter)
    parent = adapter.base_model if adapter is not None else None
    return ModelList(data=[ModelCard(id=model, max_model_len=max_len, parent=parent)])


@router.get("/info", response_model=InfoOut, responses=GET_ERRORS, summary="Service info")
async def info(ctx: Ctx) -> InfoOut:
    """Version, model, limits and the accepted option values."""
    s = ctx.settings
    adapter = _adapter(ctx)
    model, max_len = _model(ctx, adapter)
    backend = ctx.engine.backend
    sampler = ctx.engine.learner.generator
    # The served requests kept for feedback: a read of the state store (in a thread).
    kept = await sampler.served.held() if sampler is not None else None
    return InfoOut(
        name="rag-reorder",
        version=ctx.version,
        model=model,
        adapter=None if adapter is None else _adapter_out(adapter),
        backend=type(backend).__name__ if backend is not None else None,
        ready=ctx.lifecycle.ready,
        engine=_engine_state(ctx, backend),
        score_mode=_score_mode(ctx),
        auth=s.api_key is not None,
        admin_auth=s.admin_api_key is not None,
        open_writes=s.admin_api_key is None and s.open_writes,
        limits=LimitsOut(
            max_body_bytes=s.max_body_bytes,
            max_passages=s.max_passages,
            max_passage_chars=s.max_passage_chars,
            max_passage_tokens=s.max_passage_tokens,
            max_query_chars=s.max_query_chars,
            max_prompts_per_request=s.max_prompts_per_request,
            max_prompt_tokens_x_prompts=s.max_prompt_tokens_x_prompts,
            max_inflight_prompt_tokens=s.max_inflight_prompt_tokens,
            max_concurrent_requests=s.max_concurrent_requests,
            request_timeout_s=s.request_timeout_s,
            max_model_len=max_len,
            max_calibration_queries=s.max_calibration_queries,
            calibration_timeout_s=s.calibration_timeout_s,
            traffic_sample_rate=s.traffic_sample_rate,
        ),
        strategies=list(strategy_names()),
        design_kinds=list(get_args(DesignKind)),
        placements=list(get_args(PlacementName)),
        ranking_strategies=list(ranking_strategy_names()),
        default_strategy=s.strategy,
        default_placement=s.placement,
        placement_profile=s.placement_profile,
        default_results_order=s.rerank_results_order,
        templates=list(template_names()),
        auto=_auto(ctx, model, kept),
        capacity=_capacity(ctx),
        cpus=CpusOut.model_validate(ctx.cpus.describe(s.solver_processes)),
        dense=_dense(ctx),
    )


def _dense(ctx: AppContext) -> DenseOut | None:
    # Looked up, not imported: importing the encoder's module loads torch, which a server
    # whose requests never used `dense` has no reason to pay for on /info.
    module = sys.modules.get("service.backends.encoders.embedding")
    stats = None if module is None else module.loaded(ctx.settings)
    return None if stats is None else DenseOut.model_validate(stats)


def _capacity(ctx: AppContext) -> CapacityOut:
    meter = ctx.admission.meter
    now = time.monotonic()
    return CapacityOut(
        prefill_tokens_per_s=meter.tokens_per_s,
        decode_tokens_per_s=meter.decode_tokens_per_s,
        best_tokens_per_s=meter.best_rate(now),
        calls=meter.calls(now),
        age_s=meter.age_s(now),
        confirmed=meter.confirmed(now),
        estimated_wait_s=ctx.admission.estimated_wait_s,
        remeasure=ctx.admission.remeasure_wanted,
    )


def _score_mode(ctx: AppContext) -> ScoreModeOut | None:
    check = ctx.engine.score_mode_check
    if check is None:
        return None
    return ScoreModeOut(
        mode=check.mode,
        check=check.outcome,
        tolerance_nats=check.tolerance,
        max_abs_diff_nats=check.max_abs_diff,
        detail=check.detail,
    )


def _auto(ctx: AppContext, model: str, kept: tuple[int, int] | None) -> AutoInfoOut:
    s = ctx.settings
    learner = ctx.engine.learner
    c = learner.counters
    generator = s.generator_model or model
    return AutoInfoOut(
        scorer=model,
        generator=generator,
        scorer_is_generator=s.generator_model is None or s.generator_model == s.model,
        learned_profile_allowed=learner.allowed,
        ranker=s.auto_ranker,
        explore_rate=s.auto_explore_rate,
        cold_max_s=s.auto_cold_max_s,
        background={
            "explore": {**c.shadow_runs, "skipped": c.explore_skipped},
            "learning": dict(c.learning_runs),
        },
        profiles=[
            AutoProfileOut(
                template=st.key.template,
                slots=st.key.slots,
                trusted=st.trusted,
                profile=st.stored.id if st.stored is not None else None,
                learning_runs=st.pooled_runs,
                last=trust_out(st.last or (st.stored.trust if st.stored else None)),
            )
            for st in learner.status()
        ],
        generator_online=(
            None if learner.generator is None else _generator(learner.generator, kept)
        ),
        outcomes=None if learner.outcomes is None else _outcomes(learner.outcomes),
    )


def _outcomes(monitor: OutcomeMonitor) -> OutcomesOut:
    s = monitor.settings
    return OutcomesOut(
        holdout_rate=s.holdout_rate,
        holdout_order=s.holdout_order,
        policy=s.outcome_policy,
        alpha=s.outcome_alpha,
        margin=s.outcome_margin,
        placed_share=s.outcome_placed_share,
        keys=[uplift_out(u) for u in monitor.status()],
    )


def _generator(sampler: GeneratorSampler, kept: tuple[int, int] | None) -> GeneratorOnlineOut:
    c = sampler.counters
    rows = []
    for st in sampler.status():
        fit = st.fit
        rows.append(
            GeneratorProfileOut(
                passages=st.slots,
                answers=fit.questions if fit else 0,
                attributed=fit.attributed if fit else 0.0,
                unattributed=fit.questions - fit.single - fit.multiple if fit else 0,
                verdict=fit.verdict if fit else None,
                reason=fit.reason if fit else "no answer yet",
                flat_p=fit.flat_p if fit else None,
                share=list(fit.share) if fit else [],
                low=list(fit.low) if fit else [],
                high=list(fit.high) if fit else [],
                profile=st.stored.id if st.stored is not None else None,
                placing=st.placing is not None,
                kept=st.kept,
            )
        )
    return GeneratorOnlineOut(
        url=sampler.where,
        model=sampler.model,
        template=sampler.template.name,
        sample_rate=sampler.rate,
        max_calls_per_hour=sampler.settings.generator_max_calls_per_hour,
        calls=sampler.calls,
        queued=sampler.queued,
        samples=dict(c.samples),
        failures=dict(c.failures),
        answers=dict(c.answers),
        ties=dict(c.ties),
        feedback=dict(c.feedback),
        kept_for_feedback=kept[0] if kept is not None else None,
        kept_for_feedback_bytes=kept[1] if kept is not None else None,
        kept_for_feedback_scope=sampler.served.scope,
        profiles=rows,
    )


def _engine_state(ctx: AppContext, backend: object) -> str | None:
    if not isinstance(backend, RemoteBackend):
        return None
    down = ctx.lifecycle.engine_down
    if down is None and not backend.connected:
        down = "not reached yet"
    return "ok" if down is None else f"unavailable: {down}"
