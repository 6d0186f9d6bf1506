"""``moi``: Mixture-of-Intervention (the MoI paper), the service's default strategy.

plan a design -> score every row's query log-likelihood -> fit utilities and position bias
(``solver.fit``, in a worker thread) -> place by ``placement``. Failed prompts are dropped and
identifiability is re-checked on the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import solver
from service.errors import InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.settings import Settings
from service.strategies.placement import named_profile, placed_by
from service.strategies.request import Calls, Cost, DesignKind, DesignSpec, Outcome, ReorderRequest
from service.strategies.work import Work
from service.strategy_names import StrategyName

# The default design: pruned random identifies bias, utilities and orientation from the data
# at about M * L = N^2 passage-tokens, against 3 N^2 for the paper's random design
# (docs/method.md): the best identifiability per scored token.
DEFAULT_DESIGN: DesignKind = "pruned_random"
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
    kind: DesignKind = spec.kind or DEFAULT_DESIGN
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
    name: StrategyName = "moi"
    options = frozenset({"seed"})
    uses_design = True
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
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
        retr = retriever_scores(passages)
        failed = work.usage().prompts_failed
        if work.traffic is not None and not request.joint:
            # Joint scores add the passages' own tokens: not the quantity a profile fits.
            work.traffic.offer(
                model=work.model_id, template=work.template, kind=kind, perms=perms, scores=scores
            )
        try:
            fit = await work.solve(
                solver.fit,
                perms,
                scores,
                reference_bias=reference,
                retriever_scores=retr,
                n_passages=n,
                variance=work.settings.confidence_method,
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
        placement = request.placement or work.settings.placement
        # A named profile (the generator's, when this model only scores) replaces the fitted
        # bias in the placement; the utilities stay this model's.
        named = named_profile(work, request) if placement == "bias_matched" else None
        if named is None and request.bias_profile is not None:
            raise InvalidRequest(
                f"bias_profile applies with placement 'bias_matched', not {placement!r}",
                param="bias_profile",
            )
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
        return ScoredOutcome(outcome, perms, scores)


def design_cost(perms: np.ndarray) -> Cost:
    """A design's model calls: one scored prompt per row, of as many passages as it has slots."""
    m, slots = (int(v) for v in perms.shape)
    return Cost((Calls(m, slots),), param="design.num_prompts")
