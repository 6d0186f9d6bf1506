"""``moi``: Mixture-of-Intervention (the MoI paper), the service's default strategy.

plan a design -> score every row's query log-likelihood -> fit utilities and position bias
(``solver.fit``, in a worker thread) -> place by ``placement``. Failed prompts are dropped and
identifiability is re-checked on the rest.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

import solver
from service.config.settings import Settings
from service.errors import InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.runtime import tracing
from service.strategies.placement import named_profile, placed_by
from service.strategies.protocol import Reference
from service.strategies.request import (
    AdaptiveReport,
    Calls,
    Cost,
    DesignKind,
    DesignSpec,
    Outcome,
    ReorderRequest,
)
from service.strategies.work import Work
from solver import adaptive

if TYPE_CHECKING:
    from service.state.profile_store import StoredProfile

BiasSource = Literal["profile", "resampled_profile", "fitted"]
BiasBasis = Literal["trusted", "data_oriented"]

# The default design: adaptive (solver.adaptive) spends at most half pruned random's prompt
# tokens and, on SmolLM2 with NQ-Open and HotpotQA, answered no worse (docs/evaluation.md,
# "The adaptive design"). Pruned random, the default before it, identifies bias, utilities and
# orientation from the data at about N^2 passage-tokens; it is still what auto learns from and
# what adaptive runs in one round for requests too small to adapt.
DEFAULT_DESIGN: DesignKind = "adaptive"
CYCLIC_KINDS: frozenset[str] = frozenset({"cyclic", "pruned_cyclic"})
# Designs that show every passage in every prompt: the data fix the bias up to direction.
FULL_LENGTH_KINDS: frozenset[str] = frozenset({"random", "hybrid"})


def plan_design(
    spec: DesignSpec, passages: Sequence[Passage], default_seed: int
) -> tuple[DesignKind, np.ndarray]:
    """The design for a request, before any scoring.

    Raises:
        InvalidRequest: the solver cannot build that design.
    """
    n = len(passages)
    kind = design_kind(spec)
    if spec.stop_confidence is not None and kind != "adaptive":
        raise InvalidRequest(
            "design.stop_confidence applies to the adaptive design", param="design"
        )
    retr = None
    if spec.variable_pruning:
        if kind not in CYCLIC_KINDS and kind != "pruned_random":
            raise InvalidRequest(
                "design.variable_pruning applies to pruned designs", param="design"
            )
        retr = retriever_scores(passages)
        if retr is None:
            raise InvalidRequest(
                "design.variable_pruning needs a retriever score on every passage",
                param="passages",
            )
    try:
        perms = solver.plan(
            kind,
            n,
            num_prompts=spec.num_prompts,
            prompt_passages=spec.prompt_passages,
            seed=default_seed if spec.seed is None else spec.seed,
            retriever_scores=retr,
        )
    except solver.SolverError as exc:
        raise InvalidRequest(str(exc), param="design") from None
    return kind, perms


def design_kind(spec: DesignSpec) -> DesignKind:
    """The request's design: its kind, else the default; a request that asks for variable
    pruning without a kind gets pruned random, the default design it was written for."""
    if spec.kind is not None:
        return spec.kind
    return "pruned_random" if spec.variable_pruning else DEFAULT_DESIGN


def retriever_scores(passages: Sequence[Passage]) -> np.ndarray | None:
    """The retriever scores if every passage has a finite one."""
    vals = [p.score for p in passages]
    if any(v is None or not math.isfinite(v) for v in vals):
        return None
    return np.asarray(vals, dtype=np.float64)


async def score_design(
    work: Work,
    query: str,
    passages: Sequence[Passage],
    perms: np.ndarray,
    *,
    joint: bool = False,
) -> np.ndarray:
    """Build and score one prompt per design row: log p(query) per row, NaN where it failed."""
    orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
    prompts = await work.scoring_prompts(query, passages, orders)
    scores = await work.score_prompts(prompts, joint=joint)
    return np.asarray([np.nan if s is None else s.total for s in scores], dtype=np.float64)


@dataclass(frozen=True)
class ScoredOutcome:
    """A MoI outcome with its design and per-prompt scores (NaN where a prompt failed)."""

    outcome: Outcome
    perms: np.ndarray
    scores: np.ndarray


class MoI:
    name = "moi"
    reference = Reference(
        rule=(
            "fit utilities and position bias from scored permutations ([How it works](method.md)), "
            "place by `placement`"
        ),
        calls=(
            "the design's M scored prompts (default `adaptive`: at most half `pruned_random`'s "
            "tokens, in rounds; `pruned_random`: 2N of ⌈N/2⌉ passages)"
        ),
        returns="`position_bias`; `passages[].utility`, `stderr`, `confidence_above_next`",
    )
    options = frozenset({"seed"})
    uses_design = True
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        if design_kind(request.design) == "adaptive":
            # The budget, the most it may score: admission and the request limits count
            # that; what the rounds do not use is given back when the request ends. Whether
            # a profile fixes the bias is not known here: the larger of the two plans.
            n = len(request.passages)
            plans = [adaptive_plan(request.design, n, fixed_bias=f) for f in (True, False)]
            worst = max(plans, key=lambda q: q.max_prompts * q.slots)
            return Cost((Calls(worst.max_prompts, worst.slots),), param="design.num_prompts")
        _, perms = plan_design(request.design, request.passages, self._seed(request, settings))
        return design_cost(perms)

    @staticmethod
    def _seed(request: ReorderRequest, settings: Settings) -> int:
        # design.seed wins; the strategy-wide seed is the fallback, then the configured one.
        return settings.seed if request.options.seed is None else request.options.seed

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        return (await self.run_scored(work, request)).outcome

    async def run_scored(self, work: Work, request: ReorderRequest) -> ScoredOutcome:
        """``run``, with the design and the scores it fitted (``auto`` learns from them).

        Raises:
            as ``run``.
        """
        if design_kind(request.design) == "adaptive":
            return await self._run_adaptive(work, request)
        passages = request.passages
        n = len(passages)
        kind, perms = plan_design(request.design, passages, self._seed(request, work.settings))
        slots = int(perms.shape[1])
        profile = work.profiles.get(work.model_id, work.template, slots)
        if kind in CYCLIC_KINDS and profile is None and n > 1:
            raise UnidentifiableRequest(
                f"a {kind} design cannot identify the position bias, and no calibrated profile "
                f"exists for model {work.model_id!r}, template {work.template!r} and {slots} "
                "slots; run `rag-reorder calibrate` or use pruned_random (the default)",
                param="design.kind",
            )
        if n > 1 and profile is None:
            ident = solver.identifiability(solver.as_design(perms, n))
            if ident.level == "none":
                raise UnidentifiableRequest(f"{ident.reason}", param="design.num_prompts")
        reference = np.asarray(profile.coefficients) if profile is not None else None
        if profile is None and kind in FULL_LENGTH_KINDS and n > 1:
            # Full-length designs take their direction from a reference; a data-oriented
            # profile of another slot count knows the model's direction, the generic primacy
            # prior does not (it reverses every order of a recency-biased model).
            orienting = work.profiles.orienting(work.model_id, work.template)
            if orienting is not None:
                profile = orienting
                reference = solver.resample(orienting.coefficients, slots)
        scores = await score_design(work, request.query, passages, perms, joint=request.joint)
        if work.traffic is not None and not request.joint:
            # Joint scores add the passages' own tokens: not the quantity a profile fits.
            work.traffic.offer(
                model=work.model_id, template=work.template, kind=kind, perms=perms, scores=scores
            )
        fit = await _fit(work, perms, scores, passages, reference=reference)
        outcome = _outcome(work, request, fit, kind, slots, profile)
        return ScoredOutcome(outcome, perms, scores)

    async def _run_adaptive(self, work: Work, request: ReorderRequest) -> ScoredOutcome:
        """The ``adaptive`` design (``solver.adaptive``): a first round that identifies the fit,
        then leader/challenger pairs, refitting after each round, until the leader is settled
        or the budget is spent. Each round goes through ``Work`` like any prompts, so the
        cross-request scheduler fills the forwards between rounds with other requests'."""
        passages = request.passages
        n = len(passages)
        spec = request.design
        seed = self._seed(request, work.settings) if spec.seed is None else spec.seed
        slots = adaptive.default_slots(n) if spec.prompt_passages is None else spec.prompt_passages
        profile, bias, source, skipped = _adaptive_bias(work, slots, n)
        p = adaptive_plan(spec, n, fixed_bias=bias is not None)
        if p.small:
            profile, bias, source = None, None, "fitted"
        rows = adaptive.first_rows(p, seed)
        scores = await score_design(work, request.query, passages, rows, joint=request.joint)
        # The pairs' filler passages are drawn from the request's own stream: reproducible.
        rng = np.random.default_rng([seed, zlib.crc32(request.query.encode("utf-8"))])
        rounds = 1
        while True:
            fit = await _fit(work, rows, scores, passages, reference=None, fixed_bias=bias)
            done, reached = adaptive.settled(fit, p.confidence)
            if p.small or done:
                break
            weights = bias if bias is not None else np.asarray(fit.position_bias)
            more = adaptive.next_rows(fit, rows, p, weights, rng)
            if more.shape[0] == 0:
                break
            new = await score_design(work, request.query, passages, more, joint=request.joint)
            rows = np.vstack([rows, more])
            scores = np.concatenate([scores, new])
            rounds += 1
        if work.traffic is not None and not request.joint:
            work.traffic.offer(
                model=work.model_id,
                template=work.template,
                kind="adaptive",
                perms=rows,
                scores=scores,
            )
        report = AdaptiveReport(
            rounds=rounds,
            prompts=int(rows.shape[0]),
            max_prompts=p.max_prompts,
            stopped="small_request" if p.small else ("settled" if done else "budget"),
            confidence=reached,
            target=p.confidence,
            bias=source,
            bias_profile=profile.id if profile is not None else None,
            bias_basis=bias_basis(profile) if profile is not None else None,
        )
        # A fixed bias is the model's stored profile: bias_matched places by its profile for
        # the request's N slots (as the profile-first path does), not by the fit's few slots
        # resampled, when one it may use is stored.
        place = None
        if bias is not None:
            place, _ = _usable(work, n)
            place = place or profile
        outcome = _outcome(work, request, fit, "adaptive", p.slots, profile, place_by=place)
        warnings = outcome.warnings + tuple(skipped)
        return ScoredOutcome(replace(outcome, adaptive=report, warnings=warnings), rows, scores)


def adaptive_plan(spec: DesignSpec, n: int, *, fixed_bias: bool) -> adaptive.AdaptivePlan:
    """The adaptive design's sizes for a request.

    Raises:
        InvalidRequest: options the design cannot satisfy.
    """
    if spec.variable_pruning:
        raise InvalidRequest("design.variable_pruning applies to pruned designs", param="design")
    try:
        return adaptive.make_plan(
            n,
            fixed_bias=fixed_bias,
            max_prompts=spec.num_prompts,
            slots=spec.prompt_passages,
            confidence=(
                adaptive.DEFAULT_CONFIDENCE
                if spec.stop_confidence is None
                else spec.stop_confidence
            ),
        )
    except solver.SolverError as exc:
        raise InvalidRequest(str(exc), param="design") from None


def bias_basis(profile: StoredProfile) -> BiasBasis | None:
    """On what ground the adaptive design may fix its bias at ``profile``: ``trusted`` (its
    trust figures say so), ``data_oriented`` (an operator's calibration, oriented by data,
    with no verdict against it); ``None`` when it may not: a profile ``auto`` learned and
    has not trusted (still learning, or rejected after a drift), or one oriented by a prior.

    A fixed bias is taken as true: the fit, the stop rule's confidence and the placement all
    rest on it, so a profile ``auto`` itself would not place by must not be fixed either.
    """
    trust = profile.trust
    if trust is not None:
        if trust.trusted:
            return "trusted"
        if trust.source == "traffic":
            return None
    return "data_oriented" if profile.oriented_by in ("data", "profile") else None


def _usable(work: Work, slots: int) -> tuple[StoredProfile | None, str | None]:
    """The stored profile for ``slots`` if the adaptive design may fix it (``bias_basis``),
    and why not when one is stored that it may not."""
    profile = work.profiles.get(work.model_id, work.template, slots)
    if profile is None:
        return None, None
    if bias_basis(profile) is not None:
        return profile, None
    why = profile.trust.reason if profile.trust is not None else "oriented by a prior"
    return None, (
        f"the stored bias profile {profile.id!r} is not trusted ({why}): the adaptive design "
        "did not fix its bias at it"
    )


def _adaptive_bias(
    work: Work, slots: int, n: int
) -> tuple[StoredProfile | None, np.ndarray | None, BiasSource, list[str]]:
    """The bias an adaptive design fixes: the stored profile for its slots, else a stored
    data-oriented profile of another slot count resampled; else none (fitted jointly). Only
    a profile ``bias_basis`` allows is fixed; each stored one passed over is named in the
    returned warnings."""
    if n < 2:
        return None, None, "fitted", []
    profile, why = _usable(work, slots)
    skipped = [why] if why is not None else []
    if profile is not None:
        return profile, np.asarray(profile.coefficients, dtype=np.float64), "profile", skipped
    found = [
        p
        for p in work.profiles.list()
        if p.model == work.model_id
        and p.template == work.template
        and p.oriented_by == "data"
        and p.slots != slots
    ]
    allowed = [p for p in found if bias_basis(p) is not None]
    if not allowed and found:
        best = max(found, key=lambda p: p.slots)
        skipped.append(
            f"the stored bias profile {best.id!r} is not trusted: the adaptive design did not "
            "fix its bias at it"
        )
    if allowed:
        orienting = max(allowed, key=lambda p: p.slots)
        coef = solver.resample(orienting.coefficients, slots)
        return orienting, coef, "resampled_profile", skipped
    return None, None, "fitted", skipped


async def _fit(
    work: Work,
    perms: np.ndarray,
    scores: np.ndarray,
    passages: Sequence[Passage],
    *,
    reference: np.ndarray | None,
    fixed_bias: np.ndarray | None = None,
) -> solver.Fit:
    """The solver's fit in the worker pool, its refusals as the request's errors.

    Raises:
        ScoringFailed: failed prompts left a design that identifies nothing.
        UnidentifiableRequest: the design (or the stored profile) cannot give a fit.
    """
    failed = work.usage().prompts_failed
    try:
        return await work.solve(
            solver.fit,
            perms,
            scores,
            reference_bias=reference,
            retriever_scores=retriever_scores(passages),
            n_passages=len(passages),
            variance=work.settings.confidence_method,
            fixed_bias=fixed_bias,
        )
    except solver.UnidentifiableDesign as exc:
        if failed:
            raise ScoringFailed(
                f"{failed} of {work.usage().prompts_scored} prompts failed to score and the "
                f"rest cannot identify the fit: {exc}"
            ) from None
        raise UnidentifiableRequest(str(exc), param="design") from None
    except solver.InvalidReference as exc:
        raise UnidentifiableRequest(f"stored profile unusable: {exc}") from None


def _outcome(
    work: Work,
    request: ReorderRequest,
    fit: solver.Fit,
    kind: DesignKind,
    slots: int,
    profile: StoredProfile | None,
    *,
    place_by: StoredProfile | None = None,
) -> Outcome:
    """The fit placed (the request's placement, else the server's) with its warnings;
    ``bias_matched`` by the named profile, else ``place_by``, else the fitted bias."""
    failed = work.usage().prompts_failed
    placement = request.placement or work.settings.placement
    # A named profile (the generator's, when this model only scores) replaces the fitted
    # bias in the placement; the utilities stay this model's.
    named = named_profile(work, request) if placement == "bias_matched" else None
    if named is None and placement == "bias_matched":
        named = place_by
    if named is None and request.bias_profile is not None:
        raise InvalidRequest(
            f"bias_profile applies with placement 'bias_matched', not {placement!r}",
            param="bias_profile",
        )
    with tracing.span("rag_reorder.placement", {"rag_reorder.placement": placement}):
        order = solver.place(fit, placement)
    warnings = list(fit.warnings)
    if fit.orientation == "default_reference":
        warnings.append(
            "the order's direction comes from the generic primacy prior, not from the data: "
            "it is reversed for a model whose bias favours the end of the prompt; "
            "`rag-reorder calibrate` (or the default pruned_random design) fixes it"
        )
    if failed:
        warnings.append(f"{failed} prompt(s) failed to score and were dropped")
    outcome = Outcome(
        order=order,
        ranking=list(fit.order),
        score_name="debiased_utility",
        scores=np.asarray(fit.utilities, dtype=np.float64),
        fit=fit,
        design=kind,
        placement=placement,
        slots=slots,
        profile=profile,
        warnings=tuple(warnings),
    )
    if named is not None:
        outcome = placed_by(outcome, list(fit.order), named)
    return outcome


def design_cost(perms: np.ndarray) -> Cost:
    """A design's model calls: one scored prompt per row, of as many passages as it has slots."""
    m, slots = (int(v) for v in perms.shape)
    return Cost((Calls(m, slots),), param="design.num_prompts")
