"""Wire models of the HTTP API (docs/api.md): requests, responses and the error envelope.

Native models forbid unknown fields, so a misspelt option is a 422 and not a silent default;
the rerank models ignore them (Cohere, Jina and vLLM clients send fields we do not use), except
inside our own ``reorder`` object. Every string and list is bounded in its type; the
configurable limits (``Settings.max_*``) are checked after parsing so their errors can name the
limit and the value. Numbers must be finite: Python's JSON parser accepts ``NaN`` and turns
``1e999`` into infinity, and neither may reach the solver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from service.config.settings import Settings
from service.config.strategy_names import StrategyName
from service.passage import Passage
from service.pipeline import DesignSpec, ReorderRequest
from service.strategies import ranking_strategy_names
from service.strategies.request import DesignKind, Placement, StrategyOptions

# Absolute caps of the wire types. The configurable limits in Settings are bounded by the same
# numbers (their `le=`), so a limit can be lowered in configuration but never raised past the
# type; above a cap the client still gets a 422 naming the parameter.
MAX_PASSAGES = 4096
MAX_TEXT_CHARS = 1_000_000
MAX_QUERY_CHARS = 100_000
MAX_TITLE_CHARS = 4096
MAX_ID_CHARS = 512
MAX_NUM_PROMPTS = 100_000
MAX_SEED = 2**32 - 1
MAX_ANSWER_TOKENS = 1024
MAX_CALIBRATION_QUERIES = 4096

Strategy = StrategyName


def _whitespace_class() -> str:
    """The characters ``str.strip`` removes (``str.isspace``), as a regex class body of
    ``\\uHHHH`` ranges: ECMA 262 (the OpenAPI document's), Rust (pydantic's) and Python read
    it alike, where ``\\s`` differs between them (U+001C-U+001F, U+0085, U+FEFF)."""
    # All of them are in the Basic Multilingual Plane (tests/app/test_schema_text.py).
    spaces = [c for c in range(0x10000) if chr(c).isspace()]
    runs: list[tuple[int, int]] = []
    for c in spaces:
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in runs)


NOT_BLANK = f"[^{_whitespace_class()}]"
"""Pattern of a text with a character that is not whitespace: what the server needs of a
query, a passage and a document (``service.prompting.prompts`` refuses one that strips to nothing),
so the schema says it and a blank one is refused by name before any work."""

QueryText = Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS, pattern=NOT_BLANK)]
PassageText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK)]
PlacementName = Placement
ResultsOrder = Literal["ranking", "placement"]
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "overloaded_error",
    "unavailable_error",
    "timeout_error",
    "client_closed_request",
    "server_error",
]


class _Model(BaseModel):
    # Field docstrings become the OpenAPI descriptions.
    model_config = ConfigDict(use_attribute_docstrings=True)


class _Strict(_Model):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class _Lenient(_Model):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


# --- requests ---------------------------------------------------------------------------


class PassageIn(_Strict):
    """A retrieved passage. A bare JSON string is accepted as ``{"text": ...}``."""

    text: PassageText
    title: str | None = Field(default=None, max_length=MAX_TITLE_CHARS)
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    score: float | None = Field(default=None, allow_inf_nan=False)
    """The retriever's score: variable pruning, ties and never-shown passages use it."""


def _text_object(value: Any) -> Any:
    return {"text": value} if isinstance(value, str) else value


PassageItem = Annotated[
    PassageIn,
    # The bare string is the passage's text: the same bounds as ``PassageIn.text``.
    BeforeValidator(_text_object, json_schema_input_type=PassageText | PassageIn),
]


class DesignIn(_Strict):
    """Which permutations to score; absent fields take the design's defaults."""

    kind: DesignKind | None = None
    """Default `adaptive`: rounds until the top passage is settled, at most half
    `pruned_random`'s prompt tokens (`pruned_random`: the best identifiability per scored
    token; it runs in one round for requests too small to adapt). Cyclic kinds need
    a calibrated bias profile."""
    num_prompts: int | None = Field(default=None, ge=1, le=MAX_NUM_PROMPTS)
    prompt_passages: int | None = Field(default=None, ge=1, le=MAX_PASSAGES)
    """Passages per prompt (pruned kinds)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    variable_pruning: bool = False
    """Shorter prompts where the retriever is confident; needs a score on every passage."""
    stop_confidence: float | None = Field(default=None, ge=0.5, lt=1.0)
    """`adaptive` only: stop once the top passage is above every other with this probability
    (default 0.9). With `adaptive`, `num_prompts` is the budget (default: half the default
    design's passage-slots) and `prompt_passages` the passages per prompt (default
    ceil(0.3 N))."""

    def spec(self) -> DesignSpec:
        return DesignSpec(
            kind=self.kind,
            num_prompts=self.num_prompts,
            prompt_passages=self.prompt_passages,
            seed=self.seed,
            variable_pruning=self.variable_pruning,
            stop_confidence=self.stop_confidence,
        )


class ReorderOptions(_Strict):
    """How to reorder: the native request's options, and `reorder` on the rerank routes.

    `design` and `joint` apply to `moi` only; `placement` and `bias_profile` to every strategy
    that ranks (`/info` lists them); each other option names the strategies that read it, and
    setting it for another strategy is a 422.
    """

    strategy: Strategy | None = None
    """`moi` (mixture of interventions) or another published method: see the strategies page
    of the documentation (docs/strategies.md). Default: the server's `RAG_REORDER_STRATEGY`
    (`auto` unless configured; `/info`'s `default_strategy`)."""
    design: DesignIn = Field(default_factory=DesignIn)
    placement: PlacementName | None = None
    """How the ranking goes into the prompt, for every strategy that ranks: `bias_matched`
    (the k-th best passage into the slot with the k-th largest position bias: MoI's fitted
    one, or the generator's stored profile, see `bias_profile`), `descending_utility` (best
    first) or `litm` (best at both ends, weakest in the middle). Default: for `moi` the
    server's `RAG_REORDER_PLACEMENT` (`/info` says which), for other rankers their own order,
    except that a request naming no strategy gets the server's placement for any default
    strategy that ranks; the response's `diagnostics.placement` names the one applied."""
    bias_profile: str | None = Field(default=None, min_length=1, max_length=256)
    """Id of a stored bias profile (`GET /v1/bias-profiles`) that `bias_matched` places by:
    the generator's, when the scoring model is another one. Default: the server's
    `RAG_REORDER_PLACEMENT_PROFILE`, else MoI's own fit, else the profile stored for the
    scoring model. Unknown ids are a 422 listing the known ones."""
    joint: bool = False
    """Also score the passages' own tokens (the joint likelihood)."""
    template: str | None = Field(default=None, min_length=1, max_length=64)
    """Named scoring prompt template (default: the configured `chat_template`)."""
    samples: int | None = Field(default=None, ge=1, le=MAX_NUM_PROMPTS)
    """K: shuffles scored (`query_likelihood`, default N) or permutations answered
    (`self_consistency`, default 30)."""
    rankings: list[Annotated[list[int], Field(min_length=1, max_length=MAX_PASSAGES)]] | None = (
        Field(default=None, min_length=1, max_length=16)
    )
    """`lore`: input rankings to fuse (passage indices, best first; a ranking may list a
    subset). Default: the retriever's order (scores, else input order)."""
    probability_weight: float | None = Field(default=None, ge=0, le=1000, allow_inf_nan=False)
    """`lore`: weight of the answer's mean token probability (default 0.8)."""
    rank_weight: float | None = Field(default=None, ge=0, le=1000, allow_inf_nan=False)
    """`lore`: weight of 1 / fused context rank (default 0.2)."""
    rrf_k: int | None = Field(default=None, ge=0, le=1_000_000)
    """`lore`: k of reciprocal rank fusion, RRF(d) = sum 1 / (k + rank) (default 60)."""
    max_answer_tokens: int | None = Field(default=None, ge=1, le=MAX_ANSWER_TOKENS)
    """Most tokens generated per answer (`lore`, `self_consistency`; default 32)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seed of the strategy's shuffles (default: the configured seed, mixed with the query)."""

    def strategy_options(self) -> StrategyOptions:
        return StrategyOptions(
            samples=self.samples,
            rankings=tuple(tuple(r) for r in self.rankings) if self.rankings else None,
            probability_weight=self.probability_weight,
            rank_weight=self.rank_weight,
            rrf_k=self.rrf_k,
            max_answer_tokens=self.max_answer_tokens,
            seed=self.seed,
        )

    def request(
        self,
        query: str,
        passages: Sequence[Passage],
        spec: DesignSpec,
        request_id: str,
        settings: Settings,
        caller: str | None = None,
    ) -> ReorderRequest:
        """The pipeline's request for these options (both routes: `/v1/reorder` carries them
        at the top level, `/v1/rerank` under `reorder`), with the server's default strategy
        (and, for a ranker other than `moi`, its placement) where they name none."""
        strategy, placement = with_defaults(
            self.strategy,
            self.placement,
            settings,
            moi_options=spec != DesignSpec() or self.joint,
        )
        return ReorderRequest(
            query=query,
            passages=passages,
            strategy=strategy,
            options=self.strategy_options(),
            design=spec,
            placement=placement,
            bias_profile=self.bias_profile,
            joint=self.joint,
            template=self.template,
            request_id=request_id,
            caller=caller,
        )


def with_defaults(
    strategy: StrategyName | None,
    placement: PlacementName | None,
    settings: Settings,
    *,
    moi_options: bool = False,
) -> tuple[StrategyName, PlacementName | None]:
    """A request's strategy and placement with the server's defaults where it names none:
    `RAG_REORDER_STRATEGY`, and for a ranker other than `moi` and `auto` that it supplies,
    `RAG_REORDER_PLACEMENT` (those two place by themselves; a request that names a ranker
    keeps the ranker's own order). A request that names no strategy but sets what only MoI
    reads (`moi_options`: a design, `joint`, or a placement other than `bias_matched`) asks
    for MoI when the default is `auto`, which places by a profile. The routes and `rag-reorder
    reorder` resolve them alike."""
    if strategy is not None:
        return strategy, placement
    strategy = settings.strategy
    if strategy == "auto" and (moi_options or placement not in (None, "bias_matched")):
        return "moi", placement
    if (
        placement is None
        and strategy not in ("moi", "auto")
        and strategy in ranking_strategy_names()
    ):
        placement = settings.placement
    return strategy, placement


class RerankOptions(ReorderOptions):
    """`reorder` on the rerank routes: the native options, and how `results` are ordered."""

    results_order: ResultsOrder | None = None
    """`ranking`: `results` best first (descending `relevance_score`), as rerank clients
    expect. `placement`: `results` in the order to put into the prompt (`meta.reorder.order`;
    with `top_n`, the `top_n` best in their placement order), `relevance_score` still the
    strategy's judgement, so a client that re-sorts by it undoes the placement. Default: the
    server's `RAG_REORDER_RERANK_RESULTS_ORDER` (`ranking` unless configured); the response's
    `meta.results_order` names the one applied."""


class ReorderBody(ReorderOptions):
    """`POST /v1/reorder`."""

    query: QueryText
    passages: list[PassageItem] = Field(min_length=1, max_length=MAX_PASSAGES)
    top_n: int | None = Field(default=None, ge=1, le=MAX_PASSAGES)
    """Keep the top_n best passages in `order` (all passages are still scored)."""


class CalibrationQueryIn(_Strict):
    """One query of a calibration set with its passages (in any order: the design permutes
    them)."""

    query: QueryText
    passages: list[PassageItem] = Field(min_length=2, max_length=MAX_PASSAGES)


class CalibrateBody(_Strict):
    """`POST /v1/bias-profiles/calibrate`: fit one bias profile shared by these queries."""

    queries: list[CalibrationQueryIn] | None = Field(
        default=None, min_length=1, max_length=MAX_CALIBRATION_QUERIES
    )
    """Every query must have the same number of passages N: the profile is for that slot
    count (`random`) or for `prompt_passages` slots (`pruned_random`). Either `queries` or
    `from_traffic`."""
    from_traffic: bool = False
    """Calibrate from the live MoI runs this replica sampled (`traffic_sample_rate`; with
    `traffic_sample_dir`, every replica's) instead of scoring queries: no model calls. Needs
    `slots`; `design` picks the sampled runs (`random`: random and hybrid designs of `slots`
    passages, oriented by the stored data profile; `pruned_random`: pruned-random prompts of
    `slots` passages)."""
    slots: int | None = Field(default=None, ge=2, le=MAX_PASSAGES)
    """`from_traffic` only: the slot count of the profile."""
    design: Literal["random", "pruned_random"] = "random"
    """`random`: an N-slot profile for cyclic designs at N, oriented by a pruned-random
    profile measured on the same queries (both are stored); `pruned_random`: an L-slot
    profile for `pruned_cyclic` at L."""
    prompt_passages: int | None = Field(default=None, ge=1, le=MAX_PASSAGES)
    """L, passages per pruned prompt (default ceil(N/2))."""
    num_prompts: int | None = Field(default=None, ge=1, le=MAX_NUM_PROMPTS)
    """Prompts per query of `design` (default: the design's)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Base seed; query k uses seed + k (default: the configured seed)."""
    template: str | None = Field(default=None, min_length=1, max_length=64)
    """Scoring prompt template the profile is for (default: the configured `chat_template`)."""
    source: str | None = Field(default=None, min_length=1, max_length=256)
    """Provenance stored with the profile (default: the query count and design)."""


class RerankDocument(_Lenient):
    text: PassageText


DocumentItem = Annotated[
    RerankDocument,
    BeforeValidator(_text_object, json_schema_input_type=PassageText | RerankDocument),
]


class RerankBody(_Lenient):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: Cohere/Jina/vLLM request shape.

    Unknown fields are ignored; our options go in `reorder`, which is strict.
    """

    model: str | None = Field(default=None, max_length=256)
    """Accepted for compatibility and ignored: the service scores with its own model."""
    query: QueryText
    documents: list[DocumentItem] = Field(min_length=1, max_length=MAX_PASSAGES)
    top_n: int | None = Field(default=None, ge=0, le=MAX_PASSAGES)
    """0 or absent: all documents."""
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    """A document longer than this (in the model's tokens) is a 422, never truncated."""
    reorder: RerankOptions = Field(default_factory=RerankOptions)


# --- responses --------------------------------------------------------------------------


class PassageOut(_Model):
    index: int
    id: str | None
    utility: float | None
    """`moi`: debiased utility (nats of query log-likelihood per unit of slot weight, centred
    on the mean shown passage); null for other strategies and for never-shown passages."""
    score: float | None
    """The strategy's own per-passage score (higher is better; see `diagnostics.score`);
    null when the strategy has none or could not compute it."""
    stderr: float | None
    """`moi`: standard error of `utility`, from a jackknife over the prompts by default
    (`confidence_method` setting); null where the design leaves no residual freedom."""
    confidence_above_next: float | None
    """`moi`: probability that this passage truly beats the next one in `ranking` (Student's
    t on the same spread estimate)."""
    shown: bool
    """Whether any prompt showed this passage to the model."""
    distracting_effect: float | None
    """DE = 1 - P("NO-RESPONSE" | query, passage) (Cuconasu et al., 2025), where the strategy
    computes it."""
    answer: str | None
    """`lore`: the answer generated from this passage alone."""


class TrustOut(_Model):
    """How far a profile can be trusted: the figures of its assessment (docs/operations.md,
    "The profile-first strategy")."""

    verdict: Literal["shaped", "flat", "undecided"]
    """`shaped`: distinguishable from flat with a stable placement; `flat`: shown flat;
    `undecided`: neither yet. The first two are trusted."""
    reason: str
    runs: int
    """MoI runs it was assessed on."""
    flat_p: float
    """p-value of the test against a flat profile (bootstrap Wald)."""
    spread: float
    """`L (max a - min a)`: how much more the strongest slot weighs than the weakest, as a
    share of the mean slot's weight."""
    spread_upper: float
    """Its bootstrap upper bound (1 - alpha)."""
    stability: float
    """Share of bootstrap refits that place the same two strongest slots first."""
    top_slots: list[int]
    """The strongest slots (0-based), strongest first, when placing `placement_slots`."""
    placement_slots: int
    resamples: int
    source: Literal["traffic", "calibration"]
    """`traffic`: learned by `auto` from live MoI runs; `calibration`: a calibration."""
    assessed_at: float
    """Unix time of the assessment."""
    trusted_since: float | None
    """Unix time this key's profile became trusted (null while not trusted)."""


class ProfileOut(_Model):
    id: str
    """`<model>__<template>__L<slots>`, characters outside `[A-Za-z0-9._-]` as `_`: the key
    of `GET /v1/bias-profiles/{id}`."""
    model: str
    template: str
    slots: int
    coefficients: list[float]
    identification: str
    runs: int
    prompts: int
    r2: float | None
    source: str
    created_at: float
    """Unix time it was stored."""
    oriented_by: Literal["data", "profile", "prior"]
    """Where its direction came from: `data` (a pruned fit), `profile` (a full-length fit
    oriented by a data profile) or `prior` (the generic primacy shape; can be backwards)."""
    trust: TrustOut | None = None
    """Whether `auto` may place by it without measuring, and why (null: stored without the
    figures, e.g. a full-length calibration: not trusted by `auto`)."""


class TrafficSampleOut(_Model):
    model: str
    template: str
    design: Literal["random", "pruned_random"]
    """`random`: random and hybrid designs (N slots); `pruned_random`: L slots."""
    slots: int
    runs: int


class ProfileList(_Model):
    """`GET /v1/bias-profiles`."""

    object: Literal["list"] = "list"
    data: list[ProfileOut]
    traffic_samples: list[TrafficSampleOut]
    """Live MoI runs a `from_traffic` calibration would pool: this replica's, or with
    `traffic_sample_dir` the latest of every replica's (empty unless `traffic_sample_rate` >
    0)."""


class PositionBiasOut(_Model):
    coefficients: list[float]
    """Fitted weight of each prompt slot (sums to 1)."""
    identified: bool
    identification: Literal["full", "up_to_scale", "none"]
    orientation: Literal["data", "reference", "default_reference", "none"]
    orientation_strength: float | None
    profile: ProfileOut | None
    """The calibrated profile used (cyclic designs and orientation), if any."""


class PositionalProfileOut(_Model):
    """A measured positional profile (Cuconasu et al., 2025) used by `max_relevance` /
    `min_distraction`."""

    kind: Literal["accuracy", "distracting_effect"]
    model: str
    template: str
    slots: int
    values: list[float]
    """One value per prompt slot, first slot first."""
    questions: int
    """Questions the calibration averaged over."""


class AnswerOut(_Model):
    """The answer a strategy produced (`lore`: best-scoring passage's; `self_consistency`:
    the majority vote)."""

    text: str
    passage: int | None
    """`lore`: index of the passage the answer was generated from."""
    votes: int | None
    """`self_consistency`: permutations whose answer normalises to this one."""
    samples: int | None
    """`self_consistency`: answers counted."""
    probability: float | None
    """Mean token probability of the answer."""


class AutoOut(_Model):
    """What `auto` did with this request (docs/operations.md, "The profile-first strategy")."""

    path: Literal["profile", "flat", "moi", "explore", "cold"]
    """`profile`: ranked cheaply and placed by a trusted profile, no model call; `flat`: the
    trusted profile is flat, so best first; `moi`: no trusted profile yet (this run is kept
    for learning); `explore`: a trusted profile, and this request's MoI run checks it in the
    background; `cold`: no trusted profile and MoI too slow to wait on
    (`RAG_REORDER_AUTO_COLD_MAX_S`): placed by a prior (another passage count's profile) or
    left in the retriever's order, its MoI run learned from in the background."""
    reason: str
    ranker: Literal["request_scores", "dense", "bm25", "moi", "retriever"]
    """What ranked the passages: the caller's `score`s (every passage had one), the
    configured ranker (`RAG_REORDER_AUTO_RANKER`), MoI's fit, or the retriever's order (the
    cold path without a prior)."""
    profile: str | None
    """Id of the profile placed by, shown flat, or checked (`GET /v1/bias-profiles/{id}`)."""
    operator: bool
    """The profile was named (`bias_profile` or `RAG_REORDER_PLACEMENT_PROFILE`) and taken as
    given."""
    trust: TrustOut | None
    """The profile's trust figures (null without a profile or figures)."""
    learning_runs: int
    """MoI runs pooled for learning this profile (this request's included when kept)."""
    recorded: bool
    """Whether this request's MoI run was kept (learning, or the drift test)."""


class AdaptiveOut(_Model):
    """How MoI's `adaptive` design ran (docs/method.md, "The adaptive design")."""

    rounds: int
    prompts: int
    """Prompts scored over all rounds."""
    max_prompts: int
    """The budget."""
    stopped: Literal["settled", "budget", "small_request"]
    """`settled`: the top passage reached `target`; `budget`: the budget was spent first;
    `small_request`: too few passages to adapt, the default design ran in one round."""
    confidence: float
    """Reached: the smallest probability that the top passage is above another."""
    target: float
    bias: Literal["profile", "resampled_profile", "fitted"]
    """The bias the fit used: the stored profile for these slots, a stored profile of another
    slot count resampled, or fitted jointly with the utilities."""
    bias_profile: str | None = None
    """The stored profile the bias was fixed at (null: fitted)."""
    bias_basis: Literal["trusted", "data_oriented"] | None = None
    """Why it could be: `trusted` (`auto` or a calibration found it trustworthy) or
    `data_oriented` (an operator's calibration oriented by data, with no verdict against it).
    A profile `auto` has not trusted (still learning, or after a drift) is never fixed; a
    warning names one passed over."""


class DiagnosticsOut(_Model):
    strategy: Strategy
    design: DesignKind | None
    """`moi` only."""
    placement: PlacementName | None
    """`moi` only: how `order` was placed from the fit (the request's, else the server's
    default)."""
    template: str
    method: str
    """The fit's method (`moi`) or the strategy's name."""
    score: str | None
    """What `passages[].score` is (e.g. `debiased_utility`, `convex_score`, `lor`)."""
    prompts: int
    """Model calls planned (scored prompts plus generations, before de-duplication)."""
    prompts_failed: int
    slots: int | None
    r2: float | None
    converged: bool | None
    iterations: int | None
    residual_dof: int | None
    prior_sensitivity: float | None
    warnings: list[str]
    details: dict[str, Any]
    """Strategy-specific figures (e.g. the chosen shuffle's per-token log-likelihood)."""
    adaptive: AdaptiveOut | None = None
    """`moi` with the `adaptive` design: rounds, prompts, why it stopped."""


class UsageOut(_Model):
    prompt_tokens: int
    """Tokens prefilled (scored and generating prompts)."""
    scored_tokens: int
    """Tokens whose log-probs were read."""
    prompts_scored: int
    """Distinct prompts scored."""
    generations: int
    """Distinct prompts answered by greedy generation."""
    generated_tokens: int


class TimingOut(_Model):
    tokenize_s: float
    scoring_s: float
    solver_s: float
    total_s: float
    estimated_s: float | None = None
    """Admission's estimate, made before the first prompt was built, of the seconds this
    request's model calls take on an idle engine at the measured rates (compare with
    `scoring_s`); null when the request made no model call or no rate was measured yet."""


class ReorderMeta(_Model):
    """Everything the fit knows, without the envelope fields."""

    strategy: Strategy
    order: list[int]
    """The placement: passage indices in prompt order (top_n best when top_n is set)."""
    ranking: list[int]
    """All passages by the strategy's judgement (`moi`: debiased utility), best first; for
    strategies with no judgement of their own (`shuffle`) the placement itself."""
    passages: list[PassageOut]
    """All passages, in `ranking` order."""
    position_bias: PositionBiasOut | None
    """`moi`: the fitted position bias; null for other strategies."""
    positional_profile: PositionalProfileOut | None
    """`max_relevance`, `min_distraction`: the measured profile the placement used."""
    answer: AnswerOut | None
    """`lore`, `self_consistency`: the strategy's answer."""
    auto: AutoOut | None = None
    """`auto`: the path it took, why, and the profile's trust figures."""
    diagnostics: DiagnosticsOut
    usage: UsageOut
    timing: TimingOut


class ReorderResponse(ReorderMeta):
    id: str
    model: str


class CalibrationOut(_Model):
    """`POST /v1/bias-profiles/calibrate`: the stored profile and what it cost."""

    id: str
    profile: ProfileOut
    """The profile now stored (it replaced any earlier one with the same id)."""
    orienting_profile: ProfileOut | None
    """`random` only: the pruned-random profile that gave the direction (also stored)."""
    queries: int
    """Queries scored (or sampled live runs pooled, `from_traffic`)."""
    prompts: int
    """Prompts planned over all queries (or held in the sampled runs)."""
    prompts_failed: int
    prompt_tokens: int
    warnings: list[str]
    total_s: float


class RerankResult(_Model):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Model):
    total_tokens: int
    """Prompt tokens the model prefilled for this request."""


class RerankMetaOut(_Model):
    reorder: ReorderMeta
    results_order: ResultsOrder
    """How `results` are ordered: `ranking` (best first) or `placement` (prompt order); the
    request's `reorder.results_order`, else the server's default."""


class RerankResponse(_Model):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Sorted by descending relevance_score, or in prompt order with `reorder.results_order`
    `placement` (see `meta.results_order`)."""
    meta: RerankMetaOut


class ErrorDetail(_Model):
    type: ErrorType
    message: str
    param: str | None
    code: str
    request_id: str | None
    limit: float | None = None
    """Limit errors only: the configured limit."""
    value: float | None = None
    """Limit errors only: the request's value."""


class ErrorEnvelope(_Model):
    error: ErrorDetail


class ProbeStatus(_Model):
    status: str


class ModelCard(_Model):
    id: str
    """The scoring model; `<base>+<adapter>` when a distilled adapter is applied."""
    object: Literal["model"] = "model"
    owned_by: str = "rag-reorder"
    max_model_len: int | None
    """Context length of the scoring model (null until it has loaded)."""
    parent: str | None = None
    """The base model a distilled adapter is applied to (null without one), as vLLM's
    OpenAI server lists LoRA modules."""


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CapacityOut(_Model):
    """What admission's estimates rest on (docs/operations.md, "Admission's estimates")."""

    prefill_tokens_per_s: float | None
    """The engine's measured prompt tokens per busy second (null before the first call)."""
    decode_tokens_per_s: float | None
    """Its answer tokens per second of decode (null before a generation is measured)."""
    best_tokens_per_s: float | None
    """The faster of the estimate and the newest recent call alone on the engine: what a
    refusal for good (422) is judged at."""
    calls: int
    """Measurements within the last 300 s the rate rests on."""
    age_s: float | None
    """Seconds since the newest measurement (null: none)."""
    confirmed: bool
    """Whether the rate may refuse work for good (422): 4 or more recent calls, not
    contradicted by the newest call alone on the engine. Else work over its deadline is
    admitted on an idle engine and re-measures it."""
    estimated_wait_s: float | None
    """Seconds of admitted work queued now, at the measured rates."""
    remeasure: str | None
    """Why a re-measurement (the rate canary) is pending (null: none)."""


class CpusOut(_Model):
    """The CPUs the process may use and what is sized from them (`RAG_REORDER_CPUS`)."""

    cpus: int
    source: Literal["setting", "cgroup", "affinity", "host"]
    host_cpus: int
    affinity: int | None
    quota: float | None
    torch_threads: int
    solver_processes: int


class LimitsOut(_Model):
    max_body_bytes: int
    max_passages: int
    max_passage_chars: int
    max_query_chars: int
    max_prompts_per_request: int
    max_prompt_tokens_x_prompts: int
    max_inflight_prompt_tokens: int | None
    """The hard cap on prompt tokens in flight (null: none; admission is deadline-aware)."""
    max_concurrent_requests: int
    request_timeout_s: float
    max_model_len: int | None
    max_calibration_queries: int
    """Most queries in one `POST /v1/bias-profiles/calibrate`."""
    calibration_timeout_s: float
    traffic_sample_rate: float
    """Share of live MoI requests kept for calibration from traffic (0: none)."""


class AgreementOut(_Model):
    """A distilled scorer's agreement with its teacher on held-back training questions."""

    questions: int
    kendall_tau: float
    """Mean Kendall tau between the two models' scores of the question's permutations."""
    top1: float
    """Share of questions where both prefer the same permutation."""
    kl: float
    """Mean KL(teacher || student) of the softmax over the permutations, nats."""


class AdapterOut(_Model):
    """The distilled scorer the service runs (`RAG_REORDER_ADAPTER`), from its manifest."""

    name: str
    base_model: str
    teacher: str
    """The model whose preferences it was trained to keep (the generator)."""
    data: str
    lora_r: int
    before: AgreementOut
    """Agreement of the base model before distillation."""
    after: AgreementOut
    """Agreement after distillation."""


class AutoProfileOut(_Model):
    """One profile `auto` learns or places by (this replica's view)."""

    template: str
    slots: int
    """Prompt slots of the learning design (ceil(N / 2) for N passages)."""
    trusted: bool
    profile: str | None
    """Id of the stored profile (null until one is trusted)."""
    learning_runs: int
    """Runs pooled at the last assessment."""
    last: TrustOut | None
    """The last assessment, stored or not."""


class AutoInfoOut(_Model):
    """The profile-first strategy's configuration and state."""

    scorer: str
    generator: str
    """`RAG_REORDER_GENERATOR_MODEL`, else the scoring model."""
    scorer_is_generator: bool
    learned_profile_allowed: bool
    """Whether `auto` places by a profile learned from the scorer (false when the generator
    is another model and `RAG_REORDER_AUTO_LEARN_FROM_SCORER` is not set)."""
    ranker: str
    explore_rate: float
    cold_max_s: float
    """`RAG_REORDER_AUTO_COLD_MAX_S`: the longest MoI run a caller waits on while learning."""
    background: dict[str, dict[str, int]]
    """This replica's background runs by kind (`explore`, `learning`) and outcome
    (recorded, preempted, dropped, failed, expired), and `explore.skipped`: draws not made
    while a background run was still pending."""
    profiles: list[AutoProfileOut]


class ScoreModeOut(_Model):
    mode: Literal["token_ids", "prompt_logprobs"]
    """How the vLLM engine scores: `token_ids` (the span's rows only, vLLM >= 0.32 on Model
    Runner V2) or `prompt_logprobs` (every prompt row)."""
    check: Literal["agreed", "disagreed", "failed", "not_run"]
    """The start-up comparison of the two modes on probe prompts: `token_ids` is used only
    when they `agreed`; `not_run` when the engine cannot run `token_ids` at all."""
    tolerance_nats: float
    max_abs_diff_nats: float | None = None
    detail: str = ""


class InfoOut(_Model):
    name: str
    version: str
    model: str
    adapter: AdapterOut | None = None
    """The distilled adapter applied to the scoring model (null without one)."""
    backend: str | None
    ready: bool
    engine: str | None = None
    """A remote engine's state (`RAG_REORDER_BACKEND=remote`): `ok`, or `unavailable: <why>`;
    null for an in-process engine."""
    score_mode: ScoreModeOut | None = None
    """The vLLM engine's score mode and its start-up check (null for other engines)."""
    auth: bool
    """Whether an API key is required."""
    admin_auth: bool
    """Whether `POST /v1/bias-profiles/calibrate` needs the admin API key."""
    open_writes: bool = False
    """Whether `POST /v1/bias-profiles/calibrate` is open without an admin key
    (`RAG_REORDER_OPEN_WRITES`); false with neither: the route is refused (403)."""
    limits: LimitsOut
    strategies: list[str]
    design_kinds: list[str]
    placements: list[str]
    ranking_strategies: list[str]
    """The strategies that rank, to which `placement` and `bias_profile` apply."""
    default_strategy: Strategy
    """The strategy of a request that names none (`RAG_REORDER_STRATEGY`)."""
    default_placement: str
    """MoI's placement when a request names none, and the default strategy's when a request
    names neither (`RAG_REORDER_PLACEMENT`)."""
    placement_profile: str | None
    """The bias profile `bias_matched` places by when a request names none
    (`RAG_REORDER_PLACEMENT_PROFILE`)."""
    default_results_order: ResultsOrder
    """Order of rerank `results` when a request names none
    (`RAG_REORDER_RERANK_RESULTS_ORDER`)."""
    templates: list[str]
    auto: AutoInfoOut
    """The `auto` strategy: whose profile it places by, and what it has learned."""
    capacity: CapacityOut
    """Admission's measured rates and what they rest on."""
    cpus: CpusOut
    """The CPUs the process may use (affinity, cgroup quota, setting), torch's threads and
    the solver's processes."""
