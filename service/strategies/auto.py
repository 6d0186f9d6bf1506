"""``auto``: the cheapest path the measurements support, per request (the default strategy).

The evidence (docs/evaluation.md): the gain comes from *placing* passages by the generator's
position profile; a free ranker placed by a calibrated profile answered as well as MoI's
default or better, at a small fraction of its cost. ``auto`` serves that path once the profile
is trusted, and MoI until then (``service.learning.learner`` learns and watches the profile):

- ``profile``: a trusted profile exists (named by ``bias_profile`` or
  ``RAG_REORDER_PLACEMENT_PROFILE``, else learned, or calibrated with trust figures, for the
  scoring model, template and slot count). Rank with the request's own scores when every
  passage has one (the caller's retriever or reranker), else with ``auto_ranker`` (``dense``
  by default), and place ``bias_matched`` by the profile. No language-model call.
- ``flat``: the trusted profile shows no position preference: the ranking, best first.
- ``moi``: no trusted profile (or too few passages to learn one): MoI's default design,
  placed by its own fit; its scored runs are kept for learning.
- ``explore``: a trusted profile, and this request was drawn (``auto_explore_rate``) to
  check it: it is served as ``profile`` (or ``flat``), and MoI runs on its query and passages
  afterwards, in the background while no request uses the engine (``ProfileLearner.
  run_shadows``); that run tests the profile for drift. The caller never waits for it.
- ``cold``: no trusted profile, and the MoI path is estimated (the queue ahead and its own
  work, at admission's measured rates) to take longer than ``auto_cold_max_s``, as on a CPU:
  the caller is served at once, placed by a trusted profile of the same model and template
  for another slot count, or the operator's calibration of them (the prior), else left in
  the retriever's order, and the
  request's MoI run is queued for the background like an explore run; kept, it counts toward
  learning (issue 70). The caller never waits on the service's learning.

The response's ``auto`` object names the path, why, the profile and its trust figures (a
profile learned online from the generator's own answers, ``generator_url``, has the trust
source ``generator_online``; ``service.learning.generator_online``, whose sampler each served
request is offered to).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Literal

import anyio.to_thread
import numpy as np

import solver
from service.config.settings import Settings
from service.errors import InvalidRequest
from service.learning.learner import Decision, ProfileLearner, ShadowRun
from service.learning.outcomes import PLACED_PATHS, ArmDraw, OutcomeKey
from service.runtime import tracing
from service.strategies.moi import MoI, bias_basis, design_cost, plan_design, retriever_scores
from service.strategies.placement import named_profile
from service.strategies.protocol import Reference
from service.strategies.request import (
    AutoReport,
    Cost,
    DesignSpec,
    Outcome,
    Placement,
    ReorderRequest,
    descending,
    retriever_ranking,
)
from service.strategies.retrieval import bm25_scores, cosine_scores, passage_text
from service.strategies.work import Work

_MOI = MoI()
LEARNING_SPEC = DesignSpec(kind="pruned_random")
"""MoI's default design, the one ``auto`` learns from: pruned random (L = ceil(N/2) passages
a prompt, 2N prompts) identifies the bias *with its direction* from each request's own data
(docs/method.md), so the pooled runs need no prior, and it is the MoI design whose answers
were measured best per token."""


class Auto:
    """``auto``: profile-first with MoI where no trusted profile exists (module docstring)."""

    name = "auto"
    reference = Reference(
        rule=(
            "until the scoring model's position profile is learned from these MoI runs and "
            "trusted: `moi`'s pruned random design; then the caller's `score`s (else `dense`) "
            "placed `bias_matched` by that profile, or best first if it is flat; a share of "
            "requests still run MoI to check it ([The profile-first "
            "strategy](operations.md#the-profile-first-strategy))"
        ),
        calls=(
            "2N scored prompts of ⌈N/2⌉ passages while learning and on explore requests; 0 once "
            "trusted"
        ),
        returns=(
            "`auto` (path, reason, profile and its trust figures); MoI's fields on the MoI paths"
        ),
        options_note="`placement`: `bias_matched` only; `bias_profile` is taken as given",
    )
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        # The most it may need: the MoI path (the request limits hold for every path). Only
        # that path calls the model in the caller's time; it is admitted when it is taken.
        _, perms = plan_design(LEARNING_SPEC, request.passages, settings.seed)
        return replace(design_cost(perms), param="passages", upfront=False)

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        outcome = await self._serve(work, request)
        sampler = work.learner.generator if work.learner is not None else None
        if sampler is not None:
            # Served first, in the order chosen for the caller: the generator's sample is
            # asked in a random order of its own, in the background (never awaited here).
            sampler.offer(work.request_id, request.query, request.passages, request.caller)
        return outcome

    async def _serve(self, work: Work, request: ReorderRequest) -> Outcome:
        if request.placement not in (None, "bias_matched"):
            raise InvalidRequest(
                f"strategy 'auto' places by the generator's profile; placement "
                f"{request.placement!r} needs a named strategy (e.g. 'dense')",
                param="placement",
            )
        learner = work.learner or ProfileLearner.read_only(work.settings, work.profiles)
        named = named_profile(work, request)
        decision = learner.decide(work.model_id, work.template, len(request.passages), named)
        tracing.annotate(path=decision.path)
        if decision.path == "moi":
            cold = await self._cold(work, request, learner, decision)
            if cold is not None:
                return cold
            return await self._moi(work, request, learner, decision)
        arm = _draw(work, request, learner, decision)
        if arm is not None and arm.arm != "placed":
            return await _control(work, request, decision, arm)
        outcome = await self._placed(work, request, decision)
        if arm is not None:
            assert outcome.auto is not None
            why = f"{arm.reason}; {outcome.auto.reason}" if arm.reason else outcome.auto.reason
            outcome = replace(outcome, auto=replace(outcome.auto, arm=arm, reason=why))
        if decision.path == "explore":
            # Served by the profile like any other; the MoI run that checks the profile
            # happens afterwards, in the background, never in this caller's path.
            queued = learner.explore_later(
                decision, _shadow_run(work, request, learner), request.caller
            )
            assert outcome.auto is not None
            outcome = replace(outcome, auto=replace(outcome.auto, recorded=queued))
        return outcome

    async def _moi(
        self, work: Work, request: ReorderRequest, learner: ProfileLearner, decision: Decision
    ) -> Outcome:
        moi_request = _learning_request(request)
        await work.admit(_MOI.cost(moi_request, work.settings), request.query, request.passages)
        scored = await _MOI.run_scored(work, moi_request)
        kept = learner.record(decision, scored.perms, scored.scores, request.caller)
        report = _report(decision, ranker="moi", kept=kept)
        return replace(scored.outcome, auto=report)

    async def _cold(
        self, work: Work, request: ReorderRequest, learner: ProfileLearner, decision: Decision
    ) -> Outcome | None:
        """The cold path, or ``None`` when MoI is quick enough to run in the caller's time
        (or cannot be learned from: too few passages, another generator, no measured rate)."""
        bound = work.settings.auto_cold_max_s
        if bound <= 0 or decision.key is None:
            return None
        moi_request = _learning_request(request)
        estimate_s = await work.estimate_s(
            _MOI.cost(moi_request, work.settings), request.query, request.passages
        )
        if estimate_s is None or estimate_s <= bound:
            return None
        prior = learner.prior(work.model_id, work.template, len(request.passages))
        if prior is None:
            # An operator's calibration of this model and template (any passage count, read
            # off the loop: the folder store reads files), if nothing says not to place by it.
            found = await anyio.to_thread.run_sync(
                work.profiles.orienting, work.model_id, work.template
            )
            prior = found if found is not None and bias_basis(found) is not None else None
        why = (
            f"{decision.reason}; MoI estimated at {estimate_s:.1f} s, over auto_cold_max_s = "
            f"{bound:g} s: served "
            + (f"by {prior.id!r} (another passage count)" if prior else "in the retriever's order")
            + ", learning in the background"
        )
        cold = replace(decision, path="cold", reason=why, profile=prior)
        if prior is not None:
            outcome = await self._placed(work, request, cold)
        else:
            # What the caller would have sent its generator without us: no placement guess.
            ranking = retriever_ranking(request.passages)
            outcome = Outcome(
                order=list(ranking), ranking=ranking, auto=_report(cold, ranker="retriever")
            )
        queued = learner.learn_later(decision, _shadow_run(work, request, learner), request.caller)
        assert outcome.auto is not None
        return replace(outcome, auto=replace(outcome.auto, recorded=queued))

    async def _placed(self, work: Work, request: ReorderRequest, decision: Decision) -> Outcome:
        profile = decision.profile
        assert profile is not None
        passages = request.passages
        tiebreak = retriever_ranking(passages)
        own = retriever_scores(passages)
        ranker: str
        if own is not None:
            ranker, score_name, scores = "request_scores", "request_score", own
        else:
            ranker = work.settings.auto_ranker
            docs = [passage_text(p) for p in passages]
            if ranker == "dense":
                settings = work.settings
                scores = await work.off_loop(
                    lambda: cosine_scores(request.query, docs, settings), timer="solver"
                )
            else:
                scores = await work.off_loop(
                    lambda: bm25_scores(request.query, docs), timer="solver"
                )
            score_name = "cosine_similarity" if ranker == "dense" else "bm25"
        ranking = descending(np.asarray(scores, dtype=np.float64), tiebreak)
        flat = profile.trust is not None and profile.trust.verdict == "flat"
        placement: Placement = "descending_utility" if flat else "bias_matched"
        if placement == "descending_utility":
            order = list(ranking)
        else:
            with tracing.span(
                "rag_reorder.placement",
                {"rag_reorder.placement": placement, "rag_reorder.profile": profile.id},
            ):
                order = solver.place_ranking(ranking, placement, np.asarray(profile.coefficients))
        warnings: tuple[str, ...] = ()
        if profile.oriented_by == "prior":
            warnings = (
                f"bias profile {profile.id!r} takes its direction from the generic primacy "
                "prior; for a recency-biased generator its placement is reversed",
            )
        return Outcome(
            order=order,
            ranking=ranking,
            score_name=score_name,
            scores=np.asarray(scores, dtype=np.float64),
            placement=placement,
            slots=profile.slots,
            profile=profile,
            details={"placement_profile": profile.id},
            warnings=warnings,
            auto=_report(decision, ranker=ranker),
        )


def _draw(
    work: Work, request: ReorderRequest, learner: ProfileLearner, decision: Decision
) -> ArmDraw | None:
    """The randomized holdout's arm of a request on a placed path (``None``: not in it)."""
    monitor = learner.outcomes
    if monitor is None or decision.path not in PLACED_PATHS or len(request.passages) < 2:
        return None
    key = OutcomeKey(work.model_id, work.template, len(request.passages))
    return monitor.draw(key, exempt=not request.holdout)


async def _control(
    work: Work, request: ReorderRequest, decision: Decision, arm: ArmDraw
) -> Outcome:
    """A holdout's or a pass-through's order: the retriever's, or a shuffle the server drew
    (``SystemRandom``: not the request's seed, which the caller sets). No ranking cost."""
    ranking = retriever_ranking(request.passages)
    order = list(ranking)
    if arm.arm == "holdout" and arm.control == "shuffle":
        random.SystemRandom().shuffle(order)
    shuffled = arm.arm == "holdout" and arm.control == "shuffle"
    path: Literal["holdout", "pass_through"] = (
        "pass_through" if arm.passing and not shuffled else "holdout"
    )
    report = AutoReport(
        path=path,
        reason=arm.reason + f" (the placed path: {decision.path!r}, {decision.reason})",
        ranker="retriever",
        profile=decision.profile,
        operator=decision.operator,
        learning_runs=decision.learning_runs,
        recorded=False,
        arm=arm,
    )
    return Outcome(order=order, ranking=ranking, auto=report)


def _learning_request(request: ReorderRequest) -> ReorderRequest:
    """``request`` as the MoI run ``auto`` learns from. The request's placement (none, or
    bias_matched) is MoI's; the design is the learning design, whatever path this is, so
    every run can be pooled."""
    return replace(request, strategy="moi", design=LEARNING_SPEC, bias_profile=None)


def _shadow_run(work: Work, request: ReorderRequest, learner: ProfileLearner) -> ShadowRun:
    """The background run of ``request`` (explore, or learning on the cold path): MoI's
    learning design on the engine behind no admission (the server's ``shadow_backend``, timed
    into admission's rate), its own request id, the learner's deadline and preemption."""
    moi_request = replace(
        _learning_request(request), placement=None, request_id=f"{work.request_id}-explore"
    )

    async def run() -> tuple[np.ndarray, np.ndarray]:
        backend = learner.shadow_backend or work.backend
        shadow = Work(
            backend, work.settings, f"{work.request_id}-explore", work.template, work.profiles
        )
        scored = await _MOI.run_scored(shadow, moi_request)
        return scored.perms, scored.scores

    return run


def _report(decision: Decision, *, ranker: str, kept: bool = False) -> AutoReport:
    return AutoReport(
        path=decision.path,
        reason=decision.reason,
        ranker=ranker,
        profile=decision.profile,
        operator=decision.operator,
        learning_runs=decision.learning_runs + (1 if kept and decision.path == "moi" else 0),
        recorded=kept,
    )
