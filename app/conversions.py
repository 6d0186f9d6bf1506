"""Between the wire models (``app.schemas``) and the service: request passages in, fitted
results and stored profiles out as response models.

Apart from the models because it is a second concept: the models say what the wire carries,
this module what each field is computed from (null for a value the fit could not estimate,
``top_n`` cuts, the rerank results' order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final, Literal, cast

from starlette.requests import Request

from app.schemas.base import PassageIn
from app.schemas.profiles import PositionalProfileOut, ProfileOut, TrustOut
from app.schemas.reorder import (
    AdaptiveOut,
    AnswerOut,
    AutoOut,
    DiagnosticsOut,
    PassageOut,
    PositionBiasOut,
    ReorderMeta,
    ReorderResponse,
    TimingOut,
    TruncatedOut,
    UsageOut,
)
from app.schemas.rerank import RerankDocumentIn
from service.errors import InvalidRequest
from service.passage import Passage
from service.pipeline import ReorderResult
from service.prompting.truncation import Cut
from service.state.profile_store import ProfileTrust, StoredProfile, finite_or_none
from service.strategies.request import AdaptiveReport, AutoReport

UNKNOWN_CALLER: Final = "unknown"
"""The one caller of every request without ``auto_caller_header``, when that is set."""
MAX_CALLER_CHARS: Final = 256


def caller_of(request: Request, header: str | None = None) -> str | None:
    """Who sent ``request``, for ``auto``'s per-caller share of learning runs. With
    ``header`` (``auto_caller_header``), that header's value, as a gateway in front set it
    (the address is then the gateway's, so it is ignored), or ``UNKNOWN_CALLER`` when it is
    missing; else the client's address as the HTTP server resolved it (behind a proxy,
    uvicorn's ``forwarded_allow_ips`` decides whose ``X-Forwarded-For`` is believed). Not an
    identity for anything else.

    Raises:
        InvalidRequest: the header's value is over ``MAX_CALLER_CHARS`` characters (it is
            kept in memory; never cut, which could merge two callers).
    """
    if header is not None:
        value = request.headers.get(header, "").strip()
        if len(value) > MAX_CALLER_CHARS:
            raise InvalidRequest(
                f"header {header} is {len(value)} characters, over the limit of "
                f"{MAX_CALLER_CHARS} (it names auto's caller)",
                param=header,
            )
        return f"header:{value}" if value else UNKNOWN_CALLER
    return request.client.host if request.client is not None else None


def to_passages(items: Sequence[PassageIn | RerankDocumentIn]) -> list[Passage]:
    return [
        Passage(
            text=p.text, title=p.title, id=p.id, score=p.score, source=p.source, offset=p.offset
        )
        if isinstance(p, PassageIn)
        else Passage(text=p.text, source=p.source, offset=p.offset)
        for p in items
    ]


def _profile(p: StoredProfile | None) -> ProfileOut | None:
    if p is None:
        return None
    return profile_out(p)


def profile_out(p: StoredProfile) -> ProfileOut:
    return ProfileOut(
        id=p.id,
        model=p.model,
        template=p.template,
        slots=p.slots,
        coefficients=[float(c) for c in p.coefficients],
        identification=p.identification,
        runs=p.runs,
        prompts=p.prompts,
        r2=finite_or_none(p.r2),
        source=p.source,
        created_at=p.created_at,
        oriented_by=cast(Literal["data", "profile", "prior"], p.oriented_by),
        trust=trust_out(p.trust),
    )


def trust_out(t: ProfileTrust | None) -> TrustOut | None:
    if t is None:
        return None
    return TrustOut(
        verdict=t.verdict,
        reason=t.reason,
        runs=t.runs,
        flat_p=finite_or_none(t.flat_p) or 0.0,
        spread=finite_or_none(t.spread) or 0.0,
        spread_upper=finite_or_none(t.spread_upper) or 0.0,
        stability=finite_or_none(t.stability) or 0.0,
        top_slots=list(t.top_slots),
        placement_slots=t.placement_slots,
        resamples=t.resamples,
        source=cast(Literal["traffic", "calibration", "generator_online"], t.source),
        assessed_at=t.assessed_at,
        trusted_since=t.trusted_since,
    )


def adaptive_out(a: AdaptiveReport | None) -> AdaptiveOut | None:
    if a is None:
        return None
    return AdaptiveOut(
        rounds=a.rounds,
        prompts=a.prompts,
        max_prompts=a.max_prompts,
        stopped=a.stopped,
        confidence=a.confidence,
        target=a.target,
        bias=a.bias,
        bias_profile=a.bias_profile,
        bias_basis=a.bias_basis,
    )


def auto_out(a: AutoReport | None) -> AutoOut | None:
    if a is None:
        return None
    return AutoOut(
        path=a.path,
        reason=a.reason,
        ranker=cast(Literal["request_scores", "dense", "bm25", "moi", "retriever"], a.ranker),
        profile=a.profile.id if a.profile is not None else None,
        operator=a.operator,
        trust=trust_out(a.profile.trust) if a.profile is not None else None,
        learning_runs=a.learning_runs,
        recorded=a.recorded,
        arm=a.arm.arm if a.arm is not None else None,
    )


def selected_order(result: ReorderResult, top_n: int | None) -> list[int]:
    """The placement, or with ``top_n`` the ``top_n`` best passages in their placement order.

    For ``descending_utility`` this is the placement's first ``top_n``; for ``bias_matched``
    truncating the placement would drop good passages put into strong late slots, so the
    best passages are kept instead, in the relative order the placement gives them.
    """
    if top_n is None or top_n >= len(result.order):
        return list(result.order)
    best = set(result.ranking[:top_n])
    return [i for i in result.order if i in best]


def _passages_out(result: ReorderResult, passages: Sequence[Passage]) -> list[PassageOut]:
    fit = result.fit
    conf = fit.confidence if fit is not None else None
    stderr = fit.utility_stderr if fit is not None else None
    scores = result.scores
    de = result.distracting_effect
    answers = result.passage_answers
    out = []
    for k, idx in enumerate(result.ranking):
        out.append(
            PassageOut(
                index=idx,
                id=passages[idx].id if idx < len(passages) else None,
                utility=finite_or_none(fit.utilities[idx]) if fit is not None else None,
                score=finite_or_none(scores[idx]) if scores is not None else None,
                stderr=finite_or_none(stderr[idx]) if stderr is not None else None,
                confidence_above_next=(
                    finite_or_none(conf[k]) if conf is not None and k < len(conf) else None
                ),
                shown=bool(fit.shown[idx]) if fit is not None else result.usage.prompts > 0,
                distracting_effect=finite_or_none(de[idx]) if de is not None else None,
                answer=answers[idx] if answers is not None else None,
            )
        )
    return out


def _json_safe(value: Any) -> Any:
    """Strategy details as JSON: NaN and infinities become null, arrays become lists."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    if isinstance(value, float):
        return finite_or_none(value)
    return value


def reorder_meta(
    result: ReorderResult,
    passages: Sequence[Passage],
    top_n: int | None = None,
    *,
    truncated: Sequence[Cut] = (),
) -> ReorderMeta:
    fit = result.fit
    bias = None
    if fit is not None:
        bias = PositionBiasOut(
            coefficients=[float(c) for c in fit.position_bias],
            identified=fit.bias_identified,
            identification=fit.identification,
            orientation=fit.orientation,
            orientation_strength=finite_or_none(fit.orientation_strength),
            profile=_profile(result.profile),
        )
    pp = result.positional_profile
    answer = result.answer
    return ReorderMeta(
        strategy=result.strategy,
        order=selected_order(result, top_n),
        ranking=list(result.ranking),
        passages=_passages_out(result, passages),
        position_bias=bias,
        positional_profile=(
            PositionalProfileOut(
                kind=pp.kind,
                model=pp.model,
                template=pp.template,
                slots=pp.slots,
                values=[float(v) for v in pp.values],
                questions=pp.questions,
            )
            if pp is not None
            else None
        ),
        answer=(
            AnswerOut(
                text=answer.text,
                passage=answer.passage,
                votes=answer.votes,
                samples=answer.samples,
                probability=finite_or_none(answer.probability),
            )
            if answer is not None
            else None
        ),
        auto=auto_out(result.auto),
        truncated=[
            TruncatedOut(
                index=c.index,
                tokens=c.tokens,
                tokens_kept=c.tokens_kept,
                tokens_cut=c.tokens_cut,
                chars_kept=c.chars_kept,
            )
            for c in truncated
        ],
        diagnostics=DiagnosticsOut(
            strategy=result.strategy,
            design=result.design,
            placement=result.placement,
            template=result.template,
            method=fit.method if fit is not None else result.strategy,
            score=result.score_name,
            prompts=result.prompts,
            prompts_failed=result.usage.prompts_failed,
            slots=result.slots,
            r2=finite_or_none(fit.r2) if fit is not None else None,
            converged=fit.converged if fit is not None else None,
            iterations=fit.iterations if fit is not None else None,
            residual_dof=fit.residual_dof if fit is not None else None,
            prior_sensitivity=finite_or_none(fit.prior_sensitivity) if fit is not None else None,
            warnings=list(result.warnings),
            details=_json_safe(result.details),
            adaptive=adaptive_out(result.adaptive),
        ),
        usage=UsageOut(
            prompt_tokens=result.usage.prompt_tokens,
            scored_tokens=result.usage.scored_tokens,
            prompts_scored=result.usage.prompts_scored,
            generations=result.usage.generations,
            generated_tokens=result.usage.generated_tokens,
        ),
        timing=TimingOut(
            tokenize_s=result.timing.tokenize_s,
            scoring_s=result.timing.scoring_s,
            solver_s=result.timing.solver_s,
            total_s=result.timing.total_s,
            estimated_s=result.timing.estimated_s,
        ),
    )


def reorder_response(
    result: ReorderResult,
    passages: Sequence[Passage] | None = None,
    *,
    top_n: int | None = None,
    truncated: Sequence[Cut] = (),
) -> ReorderResponse:
    """The native response for a result (the CLI prints the same JSON as the route).

    Args:
        result: what ``Reorderer.reorder`` returned.
        passages: the request's passages, for their ids (omitted: ids are null).
        top_n: keep the ``top_n`` best passages in ``order``.
        truncated: the passages cut to the per-passage token limit (``truncated``).

    Returns:
        The ``POST /v1/reorder`` response; values the fit could not estimate (NaN) are null.
    """
    meta = reorder_meta(result, passages or (), top_n, truncated=truncated)
    return ReorderResponse(id=result.request_id, model=result.model, **dict(meta))


def relevance_scores(result: ReorderResult) -> dict[int, float]:
    """The strategy's judgement mapped monotonically into [0, 1] for the rerank routes.

    With per-passage scores (``moi``'s debiased utilities and every scoring strategy):
    ``sigmoid((x - mean) / sd)`` over the finite scores (the mean passage scores 0.5 and the
    scale is the request's own spread); equal scores give 0.5; a passage without a score
    (never shown, or its prompt failed) scores 0.0, below every scored one. Without scores
    (pure placements): ``1 - k / N`` for the passage at rank ``k`` of ``ranking``. Either way
    ``results`` sorted by the score follow ``ranking``, and scores are comparable within one
    response, not across requests.
    """
    x = result.scores
    n = len(result.ranking)
    if x is None:
        return {idx: 1.0 - k / n for k, idx in enumerate(result.ranking)}
    finite = [float(v) for v in x if math.isfinite(float(v))]
    mean = sum(finite) / len(finite) if finite else 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite)) if finite else 0.0
    out: dict[int, float] = {}
    for idx in result.ranking:
        v = float(x[idx])
        if not math.isfinite(v):
            out[idx] = 0.0
        elif sd <= 0.0:
            out[idx] = 0.5
        else:
            z = max(min((v - mean) / sd, 700.0), -700.0)
            out[idx] = 1.0 / (1.0 + math.exp(-z))
    return out
