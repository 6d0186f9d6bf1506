"""The request pipeline: one request -> its strategy -> one ``ReorderResult``.

One ``Reorderer`` per process owns the backend and the profile store. ``reorder`` checks the
strategy's options, gives the strategy a metered ``Work`` (all prompts of a step go to the
backend together; vLLM schedules them as one batched prefill; tokenising and fitting run in
worker threads so the event loop keeps serving) and wraps its ``Outcome`` with the request's
id, cost and timing. The MoI steps live in ``service.strategies.moi``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import solver
from service.backends.base import LogprobBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded, ServerError
from service.passage import Passage
from service.runtime import tracing
from service.state.profile_store import ProfileStore, StoredProfile
from service.state.traffic import TrafficSampler
from service.strategies import get_strategy
from service.strategies import moi as _moi
from service.strategies.placement import apply_placement
from service.strategies.protocol import check_options
from service.strategies.request import (
    AdaptiveReport,
    AutoReport,
    Cost,
    DesignKind,
    DesignSpec,
    Outcome,
    Placement,
    PositionalProfile,
    ReorderRequest,
    StrategyOptions,
    Timing,
    Usage,
    VotedAnswer,
)
from service.strategies.work import RequestGate, Work

if TYPE_CHECKING:
    from service.learning.learner import ProfileLearner

__all__ = [
    "CYCLIC_KINDS",
    "DEFAULT_DESIGN",
    "DesignKind",
    "DesignSpec",
    "Placement",
    "ReorderRequest",
    "ReorderResult",
    "Reorderer",
    "StrategyOptions",
    "Timing",
    "Usage",
]

DEFAULT_DESIGN = _moi.DEFAULT_DESIGN
CYCLIC_KINDS = _moi.CYCLIC_KINDS


@dataclass(frozen=True)
class ReorderResult:
    request_id: str
    model: str
    template: str
    strategy: str
    design: DesignKind | None  # MoI's design; None for other strategies
    placement: Placement | None  # the placement applied (MoI's, or the request's for a ranker)
    prompts: int  # planned model calls
    slots: int | None
    order: list[int]  # the placement: passage indices in prompt order
    ranking: list[int]  # passages by the strategy's judgement, best first
    score_name: str | None  # what `scores` means
    scores: np.ndarray | None  # per passage, higher is better; NaN where not computed
    fit: solver.Fit | None  # MoI's fit
    profile: StoredProfile | None  # the calibrated bias profile used, if any
    positional_profile: PositionalProfile | None
    answer: VotedAnswer | None
    auto: AutoReport | None  # what `auto` did (path, reason, profile and its trust)
    adaptive: AdaptiveReport | None  # how MoI's adaptive design ran
    passage_answers: tuple[str | None, ...] | None
    distracting_effect: np.ndarray | None
    details: dict[str, object]
    usage: Usage
    timing: Timing
    warnings: tuple[str, ...]

    @property
    def n_passages(self) -> int:
        return len(self.ranking)


class Reorderer:
    """Runs reorder requests against one backend."""

    def __init__(
        self,
        backend: LogprobBackend,
        settings: Settings,
        profiles: ProfileStore | None = None,
        traffic: TrafficSampler | None = None,
        learner: ProfileLearner | None = None,
        gate: RequestGate | None = None,
    ) -> None:
        self.backend = backend
        self.gate = gate
        """Admission of each request as a whole (the server's); ``None``: not checked."""
        self.settings = settings
        self.profiles = profiles or ProfileStore(settings.profiles_path)
        self.traffic = traffic
        """Where MoI runs of live requests are sampled for calibration (the server's only)."""
        self.learner = learner
        """What ``auto`` learns from and decides by (the server's; ``None``: read-only)."""

    def plan(self, spec: DesignSpec, passages: Sequence[Passage]) -> tuple[DesignKind, np.ndarray]:
        """MoI's design for a request, before any scoring.

        Raises:
            InvalidRequest: the solver cannot build that design.
        """
        return _moi.plan_design(spec, passages, self.settings.seed)

    def cost(self, req: ReorderRequest) -> Cost:
        """The model calls the request will need, before any scoring.

        Raises:
            InvalidRequest: unknown strategy, options it does not read, or a bad design.
        """
        strategy = get_strategy(req.strategy)
        check_options(strategy, req)
        return strategy.cost(req, self.settings)

    def planned_prompts(self, req: ReorderRequest) -> int:
        """Model calls the request will need (for the request limits), before any scoring.

        Raises:
            as ``cost``.
        """
        return self.cost(req).prompts

    def work(self, request_id: str, template: str | None = None) -> Work:
        """Metered model access for one request (strategies, calibration, evaluation)."""
        return Work(
            self.backend,
            self.settings,
            request_id,
            template or self.settings.chat_template,
            self.profiles,
            self.traffic,
            self.learner,
            self.gate,
        )

    async def reorder(self, req: ReorderRequest) -> ReorderResult:
        """Order ``req.passages`` with ``req.strategy`` (see the module docstring).

        Raises:
            InvalidRequest: bad strategy options, design, placement, template or passages.
            LimitExceeded: a prompt longer than the model's context.
            UnidentifiableRequest: a design or profile that cannot identify what the
                strategy needs (cyclic design or positional strategy without a profile).
            ScoringFailed: so many prompts failed that the rest cannot order the passages.
        """
        t0 = time.perf_counter()
        rid = req.request_id or f"reorder-{uuid.uuid4().hex[:16]}"
        if not req.passages:
            raise InvalidRequest("passages must not be empty", param="passages")
        cost = self.cost(req)
        strategy = get_strategy(req.strategy)
        limit = self.settings.max_prompts_per_request
        if cost.prompts > limit:
            # Named by the knob that sets the count: K where the strategy samples (its default
            # K = 30 for self_consistency does not depend on the passages), else the design
            # or the number of passages.
            raise LimitExceeded(
                cost.param, limit, cost.prompts, what=f"model calls strategy {req.strategy!r} needs"
            )
        work = self.work(rid, req.template)
        # Every span of the request (admission, engine calls, fit, placement) carries these.
        tracing.annotate(request_id=rid, strategy=strategy.name)
        with tracing.span("rag_reorder.reorder", {"rag_reorder.passages": len(req.passages)}):
            try:
                if cost.upfront:
                    # The whole request is admitted (or refused at once) before its first
                    # prompt is built; ``auto`` admits its MoI path when it takes it.
                    await work.admit(cost, req.query, req.passages)
                outcome = await strategy.run(work, req)
            finally:
                if self.gate is not None:
                    # What the estimate reserved beyond the calls goes back now, not when the
                    # HTTP request ends (a calibration runs many queries in one).
                    self.gate.release()
            if strategy.name not in ("moi", "auto"):  # both place by themselves
                outcome = apply_placement(work, req, outcome)
        _check_outcome(outcome, len(req.passages))
        usage = work.usage()
        return ReorderResult(
            request_id=rid,
            model=self.backend.model_id,
            template=work.template,
            strategy=strategy.name,
            design=outcome.design,
            placement=outcome.placement,
            prompts=usage.prompts,
            slots=outcome.slots,
            order=outcome.order,
            ranking=outcome.ranking,
            score_name=outcome.score_name,
            scores=outcome.scores,
            fit=outcome.fit,
            profile=outcome.profile,
            positional_profile=outcome.positional_profile,
            answer=outcome.answer,
            auto=outcome.auto,
            adaptive=outcome.adaptive,
            passage_answers=outcome.passage_answers,
            distracting_effect=outcome.distracting_effect,
            details=dict(outcome.details),
            usage=usage,
            timing=Timing(
                tokenize_s=work.tokenize_s,
                scoring_s=work.model_s,
                solver_s=work.solver_s,
                total_s=time.perf_counter() - t0,
                estimated_s=work.estimated_s,
            ),
            warnings=tuple(dict.fromkeys(outcome.warnings)),
        )


def _check_outcome(outcome: Outcome, n: int) -> None:
    """A strategy's order and ranking must be permutations of the passages: a broken strategy
    is a server error, never a silently dropped or repeated passage."""
    for name in ("order", "ranking"):
        seq = getattr(outcome, name)
        if sorted(seq) != list(range(n)):
            raise ServerError(
                f"strategy returned a {name} that is not a permutation of the {n} passages"
            )
