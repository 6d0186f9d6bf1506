"""Bias profiles over HTTP (docs/api.md, "Around them"): list, read, and calibrate from a query set.

A profile is what cyclic designs need and what orients full-length random ones (docs/method.md;
docs/operations.md, "Bias profiles and calibration"). ``POST /v1/bias-profiles/calibrate`` runs
the same calibration as ``rag-reorder calibrate`` on the serving engine: it takes a request
slot, each query is held to the per-request limits and its prompts are admitted into the shared
token budget like a request's, so a calibration shares the engine with live traffic instead of
starving it. With ``from_traffic`` it pools the runs live MoI requests already scored
(``service.state.traffic``), at no model cost. The profile is written to the profile folder
(atomically) and the next request finds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio.to_thread
from fastapi import APIRouter, Request

from app.conversions import profile_out, to_passages
from app.dependencies import Ctx, RequestId
from app.errors import GET_ERRORS, POST_ERRORS, error_responses
from app.limits import check_inputs
from app.schemas.profiles import (
    CalibrateBody,
    CalibrationOut,
    ProfileList,
    ProfileOut,
    TrafficSampleOut,
)
from service.batch.calibration import (
    CalibrationReport,
    calibrate_from_traffic,
    calibrate_profile,
    prompts_per_query,
)
from service.batch.dataset import Example
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded, NotFound
from service.pipeline import DesignSpec, Reorderer
from service.strategies.work import Work
from serving.admission.deadline import Deadline
from serving.execution import run_admitted

log = logging.getLogger(__name__)

router = APIRouter(tags=["bias profiles"])


@router.get(
    "/v1/bias-profiles",
    response_model=ProfileList,
    responses=GET_ERRORS | error_responses(422),
    summary="List the stored bias profiles",
)
async def list_profiles(
    ctx: Ctx, model: str | None = None, template: str | None = None
) -> ProfileList:
    """Every stored profile (all models sharing the folder), sorted by model, template and
    slot count; `model` and `template` filter exactly."""

    def wanted(m: str, t: str) -> bool:
        return (model is None or m == model) and (template is None or t == template)

    # Blocking with a shared traffic folder (every replica's files): off the event loop.
    counts = await anyio.to_thread.run_sync(ctx.engine.traffic.pooled_counts)
    return ProfileList(
        data=[profile_out(p) for p in ctx.engine.profiles.list() if wanted(p.model, p.template)],
        traffic_samples=[
            TrafficSampleOut(
                model=c.key.model,
                template=c.key.template,
                design=c.key.design,
                slots=c.key.slots,
                runs=c.runs,
            )
            for c in counts
            if wanted(c.key.model, c.key.template)
        ],
    )


@router.get(
    "/v1/bias-profiles/{profile_id}",
    response_model=ProfileOut,
    responses=GET_ERRORS | error_responses(404, 422),
    summary="Read one bias profile",
)
async def read_profile(profile_id: str, ctx: Ctx) -> ProfileOut:
    """The profile with this `id` (as listed), or 404."""
    found = ctx.engine.profiles.by_id(profile_id)
    if found is None:
        raise NotFound(
            f"no bias profile with id {profile_id[:200]!r}; GET /v1/bias-profiles lists them",
            param="profile_id",
        )
    return profile_out(found)


@router.post(
    "/v1/bias-profiles/calibrate",
    response_model=CalibrationOut,
    responses=POST_ERRORS | error_responses(403),
    summary="Calibrate and store a bias profile from a set of queries",
)
async def calibrate(
    body: CalibrateBody, request: Request, ctx: Ctx, request_id: RequestId
) -> CalibrationOut:
    """Score every query under `design`, fit one bias shared by all of them (each query keeps
    its own utilities) and store it for (model, template, slots), replacing an earlier one.
    With `from_traffic`, pool the live runs this replica sampled instead (no model calls).
    Deadline: `calibration_timeout_s`; nothing is stored when it fails."""
    t0 = time.perf_counter()
    work = _from_traffic(body, ctx) if body.from_traffic else _from_queries(body, ctx, request_id)
    report = await run_admitted(ctx, request, work, deadline_of=Deadline.of_calibration)
    ctx.metrics.calibrations.labels(
        body.design, "traffic" if body.from_traffic else "queries"
    ).inc()
    total_s = time.perf_counter() - t0
    log.info(
        "request %s: calibrated %s (%d %s, %d prompts, %d failed) in %.3f s",
        request_id,
        report.profile.id,
        report.queries,
        "sampled runs" if body.from_traffic else "queries",
        report.prompts,
        report.prompts_failed,
        total_s,
    )
    return CalibrationOut(
        id=report.profile.id,
        profile=profile_out(report.profile),
        orienting_profile=profile_out(report.orienting) if report.orienting else None,
        queries=report.queries,
        prompts=report.prompts,
        prompts_failed=report.prompts_failed,
        prompt_tokens=report.prompt_tokens,
        warnings=list(report.warnings),
        total_s=total_s,
    )


Calibration = Callable[[Callable[[], Reorderer]], Awaitable[CalibrationReport]]
"""A calibration's work, given a factory of per-request ``Reorderer``s (``run_admitted``)."""


def _from_traffic(body: CalibrateBody, ctx: Ctx) -> Calibration:
    """The work of a calibration from sampled live runs, its options checked first."""
    for name in ("queries", "num_prompts", "prompt_passages", "seed"):
        if getattr(body, name) is not None:
            raise InvalidRequest(
                f"{name} does not apply to from_traffic (the sampled runs are already scored)",
                param=name,
            )
    slots = body.slots
    if slots is None:
        raise InvalidRequest("from_traffic needs slots, the profile's slot count", param="slots")
    if not ctx.engine.traffic.enabled:
        raise InvalidRequest(
            "traffic_sample_rate is 0, so no live runs are sampled; set "
            "RAG_REORDER_TRAFFIC_SAMPLE_RATE (e.g. 0.05) and let traffic accumulate",
            param="from_traffic",
        )
    traffic = ctx.engine.traffic

    async def work(new_reorderer: Callable[[], Reorderer]) -> CalibrationReport:
        return await calibrate_from_traffic(
            new_reorderer(),
            traffic,
            design=body.design,
            slots=slots,
            template=body.template,
            source=body.source or "",
        )

    return work


def _from_queries(body: CalibrateBody, ctx: Ctx, request_id: str) -> Calibration:
    """The work of a calibration from posted queries, every input limit checked first."""
    if body.slots is not None:
        raise InvalidRequest(
            "slots applies to from_traffic; with queries the slot count is their passage "
            "count (random) or prompt_passages (pruned_random)",
            param="slots",
        )
    examples = _examples(body, ctx.settings)
    n = len(examples[0].passages)

    async def work(new_reorderer: Callable[[], Reorderer]) -> CalibrationReport:
        def work_for(rid: str, template: str) -> Work:
            return new_reorderer().work(rid, template)

        return await calibrate_profile(
            new_reorderer(),
            examples,
            max_passages=n,
            design=body.design,
            prompt_passages=body.prompt_passages,
            num_prompts=body.num_prompts,
            seed=ctx.settings.seed if body.seed is None else body.seed,
            template=body.template,
            source=body.source or f"HTTP: {len(examples)} queries, {body.design} design",
            request_id=request_id,
            work_for=work_for,
        )

    return work


def _examples(body: CalibrateBody, settings: Settings) -> list[Example]:
    """The queries as calibration examples, every input limit checked first (never truncated).

    Raises:
        LimitExceeded: more than ``max_calibration_queries`` queries, or a query over a
            per-request limit.
        InvalidRequest: queries with different passage counts, or a design the solver cannot
            build for them.
    """
    if body.queries is None:
        raise InvalidRequest(
            "send queries (each with its passages), or from_traffic with slots",
            param="queries",
        )
    max_queries = settings.max_calibration_queries
    if len(body.queries) > max_queries:
        raise LimitExceeded(
            "queries", max_queries, len(body.queries), what="queries in one calibration"
        )
    n = len(body.queries[0].passages)
    out: list[Example] = []
    for k, q in enumerate(body.queries):
        if len(q.passages) != n:
            raise InvalidRequest(
                f"queries[{k}] has {len(q.passages)} passages and queries[0] has {n}: one "
                "profile is for one slot count, so every query needs the same number",
                param=f"queries[{k}].passages",
            )
        passages = to_passages(q.passages)
        check_inputs(
            settings, q.query, passages, DesignSpec(), passages_param=f"queries[{k}].passages"
        )
        out.append(Example(f"q{k}", q.query, (), tuple(passages), ()))
    planned = prompts_per_query(
        body.design, n, num_prompts=body.num_prompts, prompt_passages=body.prompt_passages
    )
    if body.design == "random":  # its orienting pruned-random runs are a score call too
        planned = max(
            planned, prompts_per_query("pruned_random", n, prompt_passages=body.prompt_passages)
        )
    limit = settings.max_prompts_per_request
    if planned > limit:
        raise LimitExceeded(
            "num_prompts", limit, planned, what=f"prompts per query of the {body.design} design"
        )
    return out
