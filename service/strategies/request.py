"""A reorder request and what a strategy returns: the request and its options, the cost and
timing ledgers, answers, and the ``Outcome`` every strategy produces; plus the small rules
several strategies share (retriever order, descending scores, the request's random stream).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from service.config.settings import Settings
from service.errors import ScoringFailed
from service.passage import Passage

# The design and placement names live once, with the solver that implements them; the wire
# models and the CLI read them from here.
from solver import designs as _designs
from solver import placement as _placement

if TYPE_CHECKING:
    import solver
    from service.learning.outcomes import ArmDraw
    from service.state.profile_store import StoredProfile

DesignKind = _designs.DesignKind
Placement = _placement.Placement


@dataclass(frozen=True)
class DesignSpec:
    """How MoI chooses the permutations (``None`` fields take the design's defaults)."""

    kind: DesignKind | None = None
    num_prompts: int | None = None
    prompt_passages: int | None = None
    seed: int | None = None
    variable_pruning: bool = False
    stop_confidence: float | None = None
    """``adaptive`` only: stop once the leader is above every other passage with this
    probability (default ``solver.adaptive.DEFAULT_CONFIDENCE``)."""


@dataclass(frozen=True)
class StrategyOptions:
    """Options of the non-MoI strategies. ``None`` means "not set": the strategy's default.

    Each strategy names the options it reads (``Strategy.options``); setting another one is
    an ``InvalidRequest``, never silently ignored.
    """

    samples: int | None = None
    """K: shuffles (query_likelihood), permutations (self_consistency)."""
    rankings: tuple[tuple[int, ...], ...] | None = None
    """Extra input rankings for LoRE's rank fusion: passage indices, best first."""
    probability_weight: float | None = None
    """LoRE: weight of the answer's mean token probability (default 0.8)."""
    rank_weight: float | None = None
    """LoRE: weight of 1 / fused context rank (default 0.2)."""
    rrf_k: int | None = None
    """LoRE: the k of reciprocal rank fusion (default 60)."""
    max_answer_tokens: int | None = None
    """Most tokens generated per answer (default 32)."""
    seed: int | None = None
    """Seed of the strategy's random shuffles (default: the configured seed)."""

    def set_names(self) -> frozenset[str]:
        """Names of the options given a value."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)


@dataclass(frozen=True)
class ReorderRequest:
    query: str
    passages: Sequence[Passage]
    strategy: str = "moi"
    design: DesignSpec = field(default_factory=DesignSpec)
    placement: Placement | None = None
    """How the ranking goes into the prompt (strategies that rank). ``None``: MoI takes
    ``Settings.placement``; the others keep their own order."""
    bias_profile: str | None = None
    """The stored bias profile (``StoredProfile.id``) ``bias_matched`` places by: the
    generator's, when the scorer is another model. ``None``: ``Settings.placement_profile``,
    else MoI's own fit, else the profile stored for the scoring model."""
    options: StrategyOptions = field(default_factory=StrategyOptions)
    joint: bool = False
    template: str | None = None
    request_id: str | None = None
    caller: str | None = None
    """Who sent it (the HTTP client's address, or ``auto_caller_header``'s value), for
    ``auto``'s per-caller share of learning runs; ``None`` (the command line, probes):
    unbounded."""
    holdout: bool = False
    """Whether ``auto`` may draw this request into its randomized holdout
    (``service.learning.outcomes``): only ``POST /v1/reorder`` (and its batch), whose
    response carries the ``feedback_id`` an outcome is reported on, and only unless the
    caller exempts it; ``False``: placed, never in the experiment."""


@dataclass(frozen=True)
class Usage:
    prompts: int  # planned model calls (design rows, generations)
    prompts_scored: int  # distinct prompts whose log-probs were read
    prompts_failed: int  # scored or generating prompts that failed and were dropped
    prompt_tokens: int  # tokens prefilled (scored and generating prompts)
    scored_tokens: int  # tokens whose log-probs were read
    generations: int = 0  # answers generated
    generated_tokens: int = 0


@dataclass(frozen=True)
class Calls:
    """Prompts of one shape a strategy sends: ``prompts`` prompts of ``passages`` passages
    each, scored (``new_tokens`` 0) or each generating up to ``new_tokens``."""

    prompts: int
    passages: int
    new_tokens: int = 0
    distinct: int | None = None
    """Prompts left after identical ones are merged (``Work`` sends each once), when fewer
    than ``prompts``; the request limits count ``prompts``, the estimate ``distinct``."""
    template: str | None = None
    """The prompts' template when it is not the request's (``min_distraction`` asks its
    abstain template whatever the request's is)."""
    continuation: str = ""
    """Text teacher-forced after each prompt (``Work.continuation_logprobs``): its tokens
    are prefilled with the prompt."""

    @property
    def generation(self) -> bool:
        """The prompts end in the assistant turn: they generate, or score a continuation."""
        return self.new_tokens > 0 or bool(self.continuation)

    @property
    def sent(self) -> int:
        return self.prompts if self.distinct is None else self.distinct


@dataclass(frozen=True)
class Cost:
    """What a request will cost in model calls, stated before any call (issue 62): the request
    limits count its prompts, admission estimates its seconds from it."""

    calls: tuple[Calls, ...] = ()
    param: str = "passages"
    """The request field that sets the count: where a refusal tells the caller to turn down."""
    upfront: bool = True
    """False: the most the strategy may need (``auto``); it admits what it decides to send
    itself, in ``run``."""

    @property
    def prompts(self) -> int:
        """Model calls, scored prompts plus generations."""
        return sum(c.prompts for c in self.calls)


@dataclass(frozen=True)
class Estimate:
    """A request's model work in tokens, from its ``Cost`` and its prompts' ``PromptSize``."""

    prompts: int
    prompt_tokens: int
    new_tokens: int
    param: str


@dataclass(frozen=True)
class Timing:
    tokenize_s: float
    scoring_s: float  # in the model: scoring and generating
    solver_s: float
    total_s: float
    estimated_s: float | None = None
    """Admission's estimate of the seconds the model calls take on an idle engine (issue
    62); ``None``: no model call admitted as a whole, or no measured rate yet."""


@dataclass(frozen=True)
class Answer:
    """A generated answer: text without the end-of-turn token, and its token log-probs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str

    @property
    def mean_probability(self) -> float:
        """Mean over the answer's tokens of the chosen token's probability (LoRE)."""
        if not self.logprobs:
            return 0.0
        return float(np.mean(np.exp(np.asarray(self.logprobs))))


@dataclass(frozen=True)
class VotedAnswer:
    """The answer a strategy returns (LoRE's best answer, self-consistency's vote)."""

    text: str
    passage: int | None = None  # the passage it was generated from (LoRE)
    votes: int | None = None  # prompts that gave it (self-consistency)
    samples: int | None = None  # answers counted
    probability: float | None = None  # mean token probability


@dataclass(frozen=True)
class PositionalProfile:
    """A model's measured positional profile (Cuconasu et al.): a value per prompt slot."""

    kind: Literal["accuracy", "distracting_effect"]
    model: str
    template: str
    slots: int
    values: tuple[float, ...]
    questions: int


@dataclass(frozen=True)
class AutoReport:
    """What ``auto`` did with a request (``service.strategies.auto``)."""

    path: Literal["profile", "flat", "moi", "explore", "cold", "holdout", "pass_through"]
    reason: str
    ranker: str
    """``request_scores``, ``dense`` or ``bm25`` (profile, flat paths, cold with a prior),
    ``retriever`` (cold without one), ``moi`` otherwise."""
    profile: StoredProfile | None
    """The profile placed by, shown flat, or being checked; with its trust figures."""
    operator: bool
    """The profile was named (request or ``RAG_REORDER_PLACEMENT_PROFILE``): taken as given."""
    learning_runs: int
    """Runs pooled for learning this key, this one included when it was kept."""
    recorded: bool
    """Whether this request's MoI run was kept for learning or the drift test."""
    arm: ArmDraw | None = None
    """The randomized holdout's arm (``service.learning.outcomes``; ``None``: not in it)."""


@dataclass(frozen=True)
class AdaptiveReport:
    """How an ``adaptive`` design ran (``solver.adaptive``)."""

    rounds: int
    prompts: int
    """Prompts scored (all rounds)."""
    max_prompts: int
    stopped: Literal["settled", "budget", "small_request"]
    confidence: float
    """Reached: the smallest probability that the leader is above another passage."""
    target: float
    bias: Literal["profile", "resampled_profile", "fitted"]
    """Where the bias came from: the stored profile for these slots, a stored profile of
    another slot count resampled, or the joint fit."""
    bias_profile: str | None = None
    """The id of the stored profile the bias was fixed at (``None``: fitted)."""
    bias_basis: Literal["trusted", "data_oriented"] | None = None
    """Why that profile could be fixed: ``auto`` trusts it, or an operator's calibration
    oriented it by data (``strategies.moi.bias_basis``)."""


@dataclass(frozen=True)
class Outcome:
    """What a strategy decided, before the pipeline adds ids, usage and timing.

    ``scores`` is the strategy's own per-passage score (higher is better; NaN where it was
    not computed), named by ``score_name``; ``None`` for pure placements with no score.
    ``ranking`` is the strategy's judgement, best first; for placements with no judgement of
    their own (shuffle) it is the placement itself.
    """

    order: list[int]
    ranking: list[int]
    score_name: str | None = None
    scores: np.ndarray | None = None
    fit: solver.Fit | None = None
    design: DesignKind | None = None
    placement: Placement | None = None  # the placement applied, if the request or MoI chose one
    slots: int | None = None
    profile: StoredProfile | None = None
    positional_profile: PositionalProfile | None = None
    answer: VotedAnswer | None = None
    passage_answers: tuple[str | None, ...] | None = None
    distracting_effect: np.ndarray | None = None
    details: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    auto: AutoReport | None = None
    """Set by ``auto``: the path it took and why."""
    adaptive: AdaptiveReport | None = None
    """Set by MoI's ``adaptive`` design: rounds, prompts, why it stopped."""


@dataclass(frozen=True)
class PromptScore:
    """The log-probs read from one scoring prompt: the query's tokens and the passages' sum."""

    query: np.ndarray  # per query token, nats
    passages: float  # sum over passage tokens (joint requests), else 0.0

    @property
    def total(self) -> float:
        return float(self.query.sum()) + self.passages


def retriever_ranking(passages: Sequence[Passage]) -> list[int]:
    """Passages best first by the retriever: by descending ``score`` when every passage has a
    finite one (ties keep input order), else the input order (lists arrive in retriever order).
    """
    scores = [p.score for p in passages]
    if scores and all(s is not None and math.isfinite(s) for s in scores):
        return sorted(range(len(passages)), key=lambda i: (-float(scores[i] or 0.0), i))
    return list(range(len(passages)))


def descending(scores: np.ndarray, tiebreak: Sequence[int]) -> list[int]:
    """Indices by descending score; NaN last; ties (and NaNs among themselves) follow
    ``tiebreak`` (a ranking, best first)."""
    rank = {idx: k for k, idx in enumerate(tiebreak)}

    def key(i: int) -> tuple[int, float, int]:
        v = float(scores[i])
        return (1, 0.0, rank[i]) if not math.isfinite(v) else (0, -v, rank[i])

    return sorted(range(len(scores)), key=key)


def rng_for(request: ReorderRequest, settings: Settings) -> np.random.Generator:
    """The request's random stream: the seed (``options.seed``, else the configured one)
    mixed with a CRC-32 of the query.

    Mixing in the query gives every question its own reproducible shuffles: with the seed
    alone, every request of N passages would get the same permutation, a fixed order that
    could favour one input position across all traffic.
    """
    seed = settings.seed if request.options.seed is None else request.options.seed
    return np.random.default_rng([seed, zlib.crc32(request.query.encode("utf-8"))])


def need_scores(values: Sequence[object], what: str) -> None:
    """Raise ``ScoringFailed`` when every model call of a strategy failed."""
    if values and all(v is None for v in values):
        raise ScoringFailed(f"all {len(values)} {what} failed; nothing to order by")
