"""The MoI pipeline: plan -> build prompts -> dedupe -> fan out -> fit -> place.

One ``Reorderer`` per process owns the backend and the profile store. ``reorder`` is a
coroutine: all prompts of a request go to the backend together (vLLM schedules them as one
batched prefill), the fit runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio.to_thread
import numpy as np

import solver
from service.backends.base import LogprobBackend, PromptFailure, SpanRequest
from service.errors import InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.profile_store import ProfileStore, StoredProfile
from service.prompts import BuiltPrompt, Passage, build_prompts
from service.settings import Settings

log = logging.getLogger(__name__)

DesignKind = Literal["random", "cyclic", "pruned_random", "pruned_cyclic", "hybrid"]
Placement = Literal["descending_utility", "bias_matched"]
# The default design: pruned random identifies bias, utilities and orientation from the data
# at about M * L = N^2 passage-tokens, against 3 N^2 for the paper's random design
# (METHOD.md 3.1): the best identifiability per scored token.
DEFAULT_DESIGN: DesignKind = "pruned_random"
CYCLIC_KINDS: frozenset[str] = frozenset({"cyclic", "pruned_cyclic"})


@dataclass(frozen=True)
class DesignSpec:
    """How to choose the permutations (``None`` fields take the design's defaults)."""

    kind: DesignKind | None = None
    num_prompts: int | None = None
    prompt_passages: int | None = None
    seed: int | None = None
    variable_pruning: bool = False


@dataclass(frozen=True)
class ReorderRequest:
    query: str
    passages: Sequence[Passage]
    design: DesignSpec = field(default_factory=DesignSpec)
    placement: Placement = "descending_utility"
    joint: bool = False
    template: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class Usage:
    prompts: int  # planned prompts (design rows)
    prompts_scored: int  # distinct prompts sent to the backend
    prompts_failed: int
    prompt_tokens: int  # tokens prefilled
    scored_tokens: int  # tokens whose log-probs were read


@dataclass(frozen=True)
class Timing:
    tokenize_s: float
    scoring_s: float
    solver_s: float
    total_s: float


@dataclass(frozen=True)
class ReorderResult:
    request_id: str
    model: str
    template: str
    design: DesignKind
    prompts: int
    slots: int
    order: list[int]  # the placement: passage indices in prompt order
    ranking: list[int]  # passages by debiased utility, best first
    fit: solver.Fit
    profile: StoredProfile | None  # the calibrated profile used, if any
    usage: Usage
    timing: Timing
    warnings: tuple[str, ...]


class Reorderer:
    """Runs reorder requests against one backend."""

    def __init__(
        self, backend: LogprobBackend, settings: Settings, profiles: ProfileStore | None = None
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.profiles = profiles or ProfileStore(settings.profiles_path)

    def plan(self, spec: DesignSpec, passages: Sequence[Passage]) -> tuple[DesignKind, np.ndarray]:
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
            retr = _retriever_scores(passages)
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
                seed=self.settings.seed if spec.seed is None else spec.seed,
                retriever_scores=retr,
            )
        except solver.SolverError as exc:
            raise InvalidRequest(str(exc), param="design") from None
        return kind, perms

    async def reorder(self, req: ReorderRequest) -> ReorderResult:
        """Order ``req.passages`` by debiased utility (see the module docstring).

        Raises:
            InvalidRequest: bad design, placement, template or passages.
            LimitExceeded: a prompt longer than the model's context.
            UnidentifiableRequest: a cyclic design without a calibrated profile, or a design
                too small to identify the bias.
            ScoringFailed: so many prompts failed that the rest cannot identify the fit.
        """
        t0 = time.perf_counter()
        rid = req.request_id or f"reorder-{uuid.uuid4().hex[:16]}"
        template = req.template or self.settings.chat_template
        n = len(req.passages)
        if n == 0:
            raise InvalidRequest("passages must not be empty", param="passages")
        kind, perms = self.plan(req.design, req.passages)
        slots = int(perms.shape[1])
        profile = self.profiles.get(self.backend.model_id, template, slots)
        if kind in CYCLIC_KINDS and profile is None and n > 1:
            raise UnidentifiableRequest(
                f"a {kind} design cannot identify the position bias, and no calibrated profile "
                f"exists for model {self.backend.model_id!r}, template {template!r} and {slots} "
                "slots; run `rag-reorder calibrate` or use pruned_random (the default)",
                param="design.kind",
            )
        if n > 1 and profile is None:
            ident = solver.identifiability(solver.as_design(perms, n))
            if ident.level == "none":
                raise UnidentifiableRequest(f"{ident.reason}", param="design.num_prompts")
        scores, usage, (tokenize_s, scoring_s) = await self.score_design(
            rid, req.query, req.passages, perms, template=template, joint=req.joint
        )
        t_fit = time.perf_counter()
        reference = np.asarray(profile.coefficients) if profile is not None else None
        try:
            fit = await anyio.to_thread.run_sync(
                _fit,
                perms,
                scores,
                reference,
                _retriever_scores(req.passages),
                n,
            )
        except solver.UnidentifiableDesign as exc:
            if usage.prompts_failed:
                raise ScoringFailed(
                    f"{usage.prompts_failed} of {usage.prompts_scored} prompts failed to score "
                    f"and the rest cannot identify the fit: {exc}"
                ) from None
            raise UnidentifiableRequest(str(exc), param="design") from None
        except solver.InvalidReference as exc:
            raise UnidentifiableRequest(f"stored profile unusable: {exc}") from None
        t_place = time.perf_counter()
        order = solver.place(fit, req.placement)
        warnings = list(fit.warnings)
        if usage.prompts_failed:
            warnings.append(f"{usage.prompts_failed} prompt(s) failed to score and were dropped")
        return ReorderResult(
            request_id=rid,
            model=self.backend.model_id,
            template=template,
            design=kind,
            prompts=int(perms.shape[0]),
            slots=slots,
            order=order,
            ranking=list(fit.order),
            fit=fit,
            profile=profile,
            usage=usage,
            timing=Timing(
                tokenize_s=tokenize_s,
                scoring_s=scoring_s,
                solver_s=t_place - t_fit,
                total_s=time.perf_counter() - t0,
            ),
            warnings=tuple(dict.fromkeys(warnings)),
        )

    async def score_design(
        self,
        rid: str,
        query: str,
        passages: Sequence[Passage],
        perms: np.ndarray,
        *,
        template: str,
        joint: bool = False,
    ) -> tuple[np.ndarray, Usage, tuple[float, float]]:
        """Build and score one prompt per design row.

        Returns:
            Scores per row (NaN where the prompt failed), usage, and the seconds spent
            tokenising and scoring.
        """
        orders = [tuple(int(p) for p in row if p >= 0) for row in perms]
        t_tok = time.perf_counter()
        # Tokenising dozens of long prompts is CPU work (~10 ms each with a BPE tokenizer):
        # keep it off the event loop like the fit.
        prompts = await anyio.to_thread.run_sync(
            lambda: build_prompts(
                self.backend.tokenizer,
                template,
                query,
                passages,
                orders,
                max_tokens=self.backend.max_model_len,
            )
        )
        t_score = time.perf_counter()
        scores, usage = await self._score(rid, prompts, joint=joint)
        return scores, usage, (t_score - t_tok, time.perf_counter() - t_score)

    async def _score(
        self, rid: str, prompts: Sequence[BuiltPrompt], *, joint: bool
    ) -> tuple[np.ndarray, Usage]:
        """Score distinct prompts once; a failed or non-finite prompt scores NaN."""
        unique: dict[tuple[int, ...], int] = {}
        requests: list[SpanRequest] = []
        index = []
        for p in prompts:
            req = p.span_request(f"{rid}-{len(requests)}", joint=joint)
            k = unique.get(req.token_ids)
            if k is None:
                k = unique[req.token_ids] = len(requests)
                requests.append(req)
            index.append(k)
        results = await self.backend.score(requests)
        if len(results) != len(requests):
            raise ScoringFailed(f"backend answered {len(results)} of {len(requests)} prompts")
        values = np.full(len(requests), np.nan)
        failed = 0
        for k, res in enumerate(results):
            if isinstance(res, PromptFailure):
                failed += 1
                log.warning("prompt %s failed: %s", res.request_id, res.reason)
                continue
            first = prompts[index.index(k)]
            try:
                q, psg = first.totals(res.logprobs, joint=joint)
            except ValueError as exc:
                failed += 1
                log.warning("prompt %s: %s", res.request_id, exc)
                continue
            total = q + psg
            if math.isfinite(total):
                values[k] = total
            else:
                failed += 1
        usage = Usage(
            prompts=len(prompts),
            prompts_scored=len(requests),
            prompts_failed=failed,
            prompt_tokens=sum(len(r.token_ids) for r in requests),
            scored_tokens=sum(r.span_end - r.span_start for r in requests),
        )
        return values[np.asarray(index, dtype=np.int64)], usage


def _fit(
    perms: np.ndarray,
    scores: np.ndarray,
    reference: np.ndarray | None,
    retriever: np.ndarray | None,
    n: int,
) -> solver.Fit:
    return solver.fit(
        perms, scores, reference_bias=reference, retriever_scores=retriever, n_passages=n
    )


def _retriever_scores(passages: Sequence[Passage]) -> np.ndarray | None:
    """The retriever scores if every passage has a finite one."""
    vals = [p.score for p in passages]
    if any(v is None or not math.isfinite(v) for v in vals):
        return None
    return np.asarray(vals, dtype=np.float64)
