"""``POST /v1/feedback``: the generator's answer to a served request, learned from where the
served placement identifies the generator's profile (docs/generator-profile.md, "Feedback")."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.conversions import caller_of
from app.dependencies import Ctx
from app.errors import POST_ERRORS, error_responses
from app.schemas.feedback import FeedbackBody, FeedbackOut, OutcomeOut, UpliftOut
from service.errors import NotFound
from service.learning.generator_online import OutcomeTaken
from service.learning.outcomes import Uplift

router = APIRouter(tags=["feedback"])


@router.post(
    "/v1/feedback",
    response_model=FeedbackOut,
    responses=POST_ERRORS | error_responses(403, 404, 409),
    summary="Report on a served request: its outcome, the generator's answer",
)
async def feedback(body: FeedbackBody, request: Request, ctx: Ctx) -> FeedbackOut:
    """Count the request's `outcome` (in [0, 1]; a boolean is 1 or 0) in `auto`'s uplift
    when it was in the randomized holdout (docs/outcomes.md), and attribute the generator's
    answer to the passages of the served request `id` holding
    it and, if that request's placement was uniformly random (`shuffle`), pool it into the
    generator's online profile (`used: true`); otherwise `used: false` and why. Served requests
    are kept in the state store, so any worker or replica answers, under the name of the caller
    they were served to (the `RAG_REORDER_AUTO_CALLER_HEADER` header, else the client's
    address): only that caller can answer on them. 404 for an id that is unknown, another
    caller's, already answered, past `RAG_REORDER_FEEDBACK_TTL_S` or evicted by
    `RAG_REORDER_FEEDBACK_MAX_REQUESTS` / `_MAX_BYTES`, or while feedback is off; 409 for a
    second report on one id; 422 for an outcome outside [0, 1] or neither outcome nor
    answer; 503 while the state store cannot be reached."""
    sampler = ctx.engine.learner.generator
    if sampler is None:
        raise NotFound(
            "feedback is off: set RAG_REORDER_FEEDBACK_MAX_REQUESTS to keep served requests for it",
            param="id",
        )
    caller = caller_of(request, ctx.settings.auto_caller_header)
    done = await sampler.feedback(
        body.id, body.answer, caller, outcome=body.reward, outcomes=ctx.engine.learner.outcomes
    )
    return FeedbackOut(
        id=body.id,
        used=done.used,
        reason=done.reason,
        attribution=done.attribution,
        slots=list(done.slots),
        outcome=outcome_out(done.outcome),
    )


def uplift_out(u: Uplift) -> UpliftOut:
    return UpliftOut(
        key=u.key.label,
        estimate=round(u.estimate, 6),
        lower=round(u.lower, 6),
        upper=round(u.upper, 6),
        verdict=u.verdict,
        outcomes=dict(u.outcomes),
        needed=u.needed,
        eta_s=None if u.eta_s is None else round(u.eta_s, 1),
        pass_through=u.pass_through,
        reason=u.reason,
    )


def outcome_out(t: OutcomeTaken | None) -> OutcomeOut | None:
    if t is None:
        return None
    return OutcomeOut(
        counted=t.counted,
        arm=t.arm,
        reason=t.reason,
        uplift=uplift_out(t.uplift) if t.uplift is not None else None,
    )
