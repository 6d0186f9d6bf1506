"""``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``: the Cohere/Jina/vLLM rerank shape.

RAG stacks (LiteLLM, LangChain, LlamaIndex, Haystack, Dify, RAGFlow) already call this shape;
the results are the debiased ranking (or, with ``reorder.results_order`` ``placement``, the
prompt order), and ``meta.reorder`` carries what the native API returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Final

from fastapi import APIRouter, Request, Response

from app.context_plan import ContextPlan
from app.conversions import caller_of, relevance_scores, reorder_meta, selected_order, to_passages
from app.dependencies import Ctx, RequestId
from app.errors import POST_ERRORS
from app.limits import check_inputs, fit_to_limit, passage_token_limit
from app.response_cache import as_hit, lookup
from app.schemas.reorder import ReorderOptions
from app.schemas.rerank import (
    RerankBody,
    RerankDocument,
    RerankMetaOut,
    RerankResponse,
    RerankResult,
    RerankUsage,
)
from service.errors import ReorderError
from service.pipeline import Reorderer, ReorderResult
from service.prompting.truncation import Cut
from serving.execution import execute

router = APIRouter(tags=["rerank"])


@router.post(
    "/rerank",
    response_model=RerankResponse,
    responses=POST_ERRORS,
    summary="Rerank documents (Cohere/Jina/vLLM shape)",
)
@router.post(
    "/v1/rerank",
    response_model=RerankResponse,
    responses=POST_ERRORS,
    summary="Rerank documents (Cohere/Jina/vLLM shape)",
)
@router.post(
    "/v2/rerank",
    response_model=RerankResponse,
    responses=POST_ERRORS,
    summary="Rerank documents (Cohere/Jina/vLLM shape)",
)
async def rerank(
    body: RerankBody, request: Request, response: Response, ctx: Ctx, request_id: RequestId
) -> RerankResponse:
    """Documents by the strategy's judgement (default: the server's, `auto` unless
    configured: MoI's debiased utility until a profile is trusted, then the dense ranking), or
    with
    `reorder.results_order` `placement` in the order to put into the prompt.
    `relevance_score` is `sigmoid((x - mean) / sd)` of the per-document score `x` (documents
    without one score 0; strategies without scores give `1 - rank / N`); unknown fields are
    ignored; our options go in `reorder`."""
    with _rerank_params():
        return await _rerank(body, request, response, ctx, request_id)


async def _rerank(
    body: RerankBody, request: Request, response: Response, ctx: Ctx, request_id: str
) -> RerankResponse:
    passages = to_passages(body.documents)
    opts = body.reorder
    spec = opts.design.spec()
    check_inputs(ctx.settings, body.query, passages, spec, passages_param="documents")
    # `reorder.context` (issue 93): near-duplicates merged before scoring.
    plan = ContextPlan(opts.context, passages)
    scored = plan.scored
    req = opts.request(
        body.query,
        scored,
        spec,
        request_id,
        ctx.settings,
        caller=caller_of(request, ctx.settings.auto_caller_header),
    )
    limit = passage_token_limit(
        ctx.settings, body.max_tokens_per_doc, opts.truncate, requested_name="max_tokens_per_doc"
    )
    cuts: list[Cut] = []

    async def work(reorderer: Reorderer) -> ReorderResult:
        # The model scores the cut texts; `results[].document.text` stays the caller's.
        fitted, found = await fit_to_limit(
            reorderer.backend.tokenizer, scored, limit, passages_param="documents"
        )
        cuts.extend(found)
        result = await reorderer.reorder(replace(req, passages=fitted) if found else req)
        plan.build(
            result,
            ctx.settings,
            reorderer.backend.tokenizer,
            body.top_n or None,
            param_prefix="reorder.context",
        )
        return result

    cache = await lookup(ctx, request, body, response)
    if cache is not None and cache.hit is not None:
        out = RerankResponse.model_validate_json(cache.hit)
        out.id = request_id
        out.usage = RerankUsage(total_tokens=0)
        as_hit(out.meta.reorder, cache.started)
        return out
    result = await execute(ctx, request, work)
    scores = relevance_scores(result)
    top_n = body.top_n or None
    results_order = opts.results_order or ctx.settings.rerank_results_order
    # `placement` hands rerank clients the prompt order, where the measured gain lies; the
    # same top_n passages either way, so only their order differs from `ranking`.
    if plan.active:
        # Only the kept passages, in prompt order or best first (`meta.reorder.context`).
        kept = plan.kept()
        by_rank = {plan.request_index(k): r for r, k in enumerate(result.ranking)}
        keep = kept if results_order == "placement" else sorted(kept, key=by_rank.__getitem__)
        scores = {plan.request_index(k): v for k, v in scores.items()}
    elif results_order == "placement":
        keep = selected_order(result, top_n)
    else:
        keep = result.ranking[:top_n] if top_n else result.ranking
    meta = reorder_meta(result, scored, top_n, truncated=cuts)
    plan.apply(meta)
    out = RerankResponse(
        id=request_id,
        model=result.model,
        usage=RerankUsage(total_tokens=result.usage.prompt_tokens),
        results=[
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=passages[i].text) if body.return_documents else None,
            )
            for i in keep
        ],
        meta=RerankMetaOut(
            reorder=meta,
            results_order=results_order,
        ),
    )
    if cache is not None:
        await cache.store(result, out)
    return out


# Our options live under `reorder` on these routes, and the passages are `documents`.
_OPTIONS: Final = frozenset(ReorderOptions.model_fields)


@contextmanager
def _rerank_params() -> Iterator[None]:
    """Name an error's ``param`` as this request spells it: the service names a strategy
    option (``design.kind``, ``samples``) or ``passages`` as the native body does, but here
    they are ``reorder.design.kind``, ``reorder.samples`` and ``documents``."""
    try:
        yield
    except ReorderError as exc:
        old = exc.param
        new = _wire_param(old) if old is not None else None
        if old is not None and new is not None and new != old:
            exc.param = new
            if exc.message.startswith(old):  # limit errors open with the parameter's name
                exc.message = new + exc.message[len(old) :]
        raise


def _wire_param(param: str) -> str:
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head == "passages":
        return "documents" + param[len("passages") :]
    if head in _OPTIONS:
        return f"reorder.{param}"
    return param
