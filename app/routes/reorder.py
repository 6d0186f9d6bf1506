"""``POST /v1/reorder``: the native API, everything the fit knows (docs/api.md)."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request, Response

from app.context_plan import ContextPlan
from app.conversions import caller_of, reorder_response, selected_order, to_passages
from app.dependencies import Ctx, RequestId
from app.errors import POST_ERRORS
from app.limits import check_inputs, fit_to_limit, passage_token_limit
from app.response_cache import as_hit, lookup
from app.schemas.reorder import ReorderBody, ReorderResponse
from service.pipeline import Reorderer, ReorderResult
from service.prompting.truncation import Cut
from serving.context import AppContext
from serving.execution import execute

router = APIRouter(tags=["reorder"])


@router.post(
    "/v1/reorder",
    response_model=ReorderResponse,
    responses=POST_ERRORS,
    summary="Order passages by debiased utility",
)
async def reorder(
    body: ReorderBody, request: Request, response: Response, ctx: Ctx, request_id: RequestId
) -> ReorderResponse:
    """Order the passages with `strategy` (default: the server's, `auto` unless configured:
    MoI, which scores permutations and fits utilities and position bias, until the model's
    position profile is learned and trusted; then a cheap ranking placed by it; `auto` says
    which)."""
    return await reorder_one(body, request, ctx, request_id, response)


async def reorder_one(
    body: ReorderBody,
    request: Request,
    ctx: AppContext,
    request_id: str,
    response: Response | None = None,
) -> ReorderResponse:
    """One native request's work, from its validated body to its response: the route's, and
    each item's of `POST /v1/reorder/batch` (app/routes/batch.py), so both answer alike."""
    passages = to_passages(body.passages)
    spec = body.design.spec()
    check_inputs(ctx.settings, body.query, passages, spec)
    limit = passage_token_limit(
        ctx.settings, body.max_passage_tokens, body.truncate, requested_name="max_passage_tokens"
    )
    caller = caller_of(request, ctx.settings.auto_caller_header)
    # `context` (issue 93): near-duplicates merged before scoring; the pipeline sees `scored`.
    plan = ContextPlan(body.context, passages)
    scored = plan.scored
    req = body.request(body.query, scored, spec, request_id, ctx.settings, caller=caller)
    # Only here (and in a batch's items) can an outcome come back: the response's feedback_id.
    req = replace(req, holdout=body.holdout)
    cuts: list[Cut] = []

    async def work(reorderer: Reorderer) -> ReorderResult:
        # The model scores the cut texts; the response (and feedback's record of what was
        # served) keeps the caller's passages, which `truncated` refers to.
        fitted, found = await fit_to_limit(reorderer.backend.tokenizer, scored, limit)
        cuts.extend(found)
        result = await reorderer.reorder(replace(req, passages=fitted) if found else req)
        plan.build(result, ctx.settings, reorderer.backend.tokenizer, body.top_n)
        return result

    # The response cache (docs/cache.md) on the route only: a batch's items are not cached.
    cache = await lookup(ctx, request, body, response) if response is not None else None
    if cache is not None and cache.hit is not None:
        out = ReorderResponse.model_validate_json(cache.hit)
        out.id = request_id
        as_hit(out, cache.started)
        shown, strategy, arm = out.order, out.strategy, None
    else:
        result = await execute(ctx, request, work)
        out = reorder_response(result, scored, top_n=body.top_n, truncated=cuts)
        plan.apply(out)
        if cache is not None:
            await cache.store(result, out)
        shown = out.order if plan.active else selected_order(result, body.top_n)
        strategy = result.strategy
        arm = result.auto.arm if result.auto is not None else None
    sampler = ctx.engine.learner.generator
    if sampler is not None:
        # Kept for POST /v1/feedback on this response (in the state store, bounded): what was
        # served, its passages only where the feedback can be learned from (a shuffle), and
        # the holdout's arm. Under the caller's name and a token the server made: no other
        # caller can replace it or report on it. A cached response's arm is not counted (it
        # was drawn for the request first served it).
        out.feedback_id = await sampler.served.keep(
            request_id, body.query, passages, shown, strategy, caller, arm
        )
    return out
