"""``POST /v1/feedback``: the generator's answer to a served request, learned from where the
served placement identifies the generator's profile (docs/generator-profile.md, "Feedback")."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.conversions import caller_of
from app.dependencies import Ctx
from app.errors import POST_ERRORS, error_responses
from app.schemas.feedback import FeedbackBody, FeedbackOut
from service.errors import NotFound

router = APIRouter(tags=["feedback"])


@router.post(
    "/v1/feedback",
    response_model=FeedbackOut,
    responses=POST_ERRORS | error_responses(403, 404),
    summary="Send the generator's answer to a served request",
)
async def feedback(body: FeedbackBody, request: Request, ctx: Ctx) -> FeedbackOut:
    """Attribute the generator's answer to the passages of the served request `id` holding
    it and, if that request's placement was uniformly random (`shuffle`), pool it into the
    generator's online profile (`used: true`); otherwise `used: false` and why. Served requests
    are kept in the state store, so any worker or replica answers, under the name of the caller
    they were served to (the `RAG_REORDER_AUTO_CALLER_HEADER` header, else the client's
    address): only that caller can answer on them. 404 for an id that is unknown, another
    caller's, already answered, past `RAG_REORDER_FEEDBACK_TTL_S` or evicted by
    `RAG_REORDER_FEEDBACK_MAX_REQUESTS` / `_MAX_BYTES`, or while feedback is off; 503 while
    the state store cannot be reached."""
    sampler = ctx.engine.learner.generator
    if sampler is None:
        raise NotFound(
            "feedback is off: set RAG_REORDER_FEEDBACK_MAX_REQUESTS (and "
            "RAG_REORDER_GENERATOR_MODEL) to keep served requests for it",
            param="id",
        )
    caller = caller_of(request, ctx.settings.auto_caller_header)
    done = await sampler.feedback(body.id, body.answer, caller)
    return FeedbackOut(
        id=body.id,
        used=done.used,
        reason=done.reason,
        attribution=done.attribution,
        slots=list(done.slots),
    )
