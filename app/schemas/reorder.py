"""``POST /v1/reorder``'s wire models: the request with its options, and the response
with its passages, bias, diagnostics, usage and timing (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from app.schemas.base import (
    MAX_ANSWER_TOKENS,
    MAX_NUM_PROMPTS,
    MAX_PASSAGES,
    MAX_SEED,
    MAX_TEXT_CHARS,
    PassageItem,
    PlacementName,
    QueryText,
    Strategy,
    _Model,
    _Strict,
)
from app.schemas.context import ContextIn, ContextOut
from app.schemas.profiles import PositionalProfileOut, ProfileOut, TrustOut
from service.config.settings import Settings
from service.passage import Passage
from service.pipeline import DesignSpec, ReorderRequest
from service.strategies import ranking_strategy_names
from service.strategies.request import DesignKind, StrategyOptions

Truncate = Literal["none", "end"]
"""Cohere's `truncate` (`NONE`, `END`; `START` is not offered: a retrieved passage's lead is
what it is retrieved for) and Voyage's `truncation` (`false`, `true`), refusing by default."""


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
    truncate: Truncate = "none"
    """Every strategy: what a passage over the per-passage token limit gets (the lower of
    the server's `RAG_REORDER_MAX_PASSAGE_TOKENS` and the request's `max_passage_tokens`, on
    the rerank routes `max_tokens_per_doc`). `none`: a 422 naming it, the limit and its
    tokens. `end`: its text is cut to its first tokens and the model scores that; each cut is
    listed in the response's `truncated` (the rerank routes': `meta.reorder.truncated`).
    `end` without any limit is a 422."""
    context: ContextIn | None = None
    """Which passages go into the prompt, beyond their order: a token budget in the
    generator's tokens, distractor and near-duplicate removal, document order
    (docs/context.md). Set: `order` lists only the kept passages and the response's `context`
    says what was dropped and why; unset: every passage is placed."""

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
    strategy: str | None,
    placement: PlacementName | None,
    settings: Settings,
    *,
    moi_options: bool = False,
) -> tuple[str, PlacementName | None]:
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


class ReorderBody(ReorderOptions):
    """`POST /v1/reorder`."""

    query: QueryText
    passages: list[PassageItem] = Field(min_length=1, max_length=MAX_PASSAGES)
    top_n: int | None = Field(default=None, ge=1, le=MAX_PASSAGES)
    """Keep the top_n best passages in `order` (all passages are still scored)."""
    max_passage_tokens: int | None = Field(default=None, ge=1, le=MAX_TEXT_CHARS)
    """Most of the scoring model's tokens in one passage's text (tokenised on its own, the
    title not counted); over it: a 422, or a cut with `truncate` `end`. The server's
    `RAG_REORDER_MAX_PASSAGE_TOKENS` applies where it is lower (`/info`)."""
    holdout: bool = True
    """`auto` only: whether this request may be drawn into the randomized holdout
    (`RAG_REORDER_HOLDOUT_RATE`, docs/outcomes.md) and served the control order. `false`:
    it is placed, and not in the experiment (a request that must be placed)."""


class TruncatedOut(_Model):
    """One passage cut to the per-passage token limit (`truncate` `end`)."""

    index: int
    """Its position in the request's passages (documents)."""
    tokens: int
    """Its text's tokens as sent (the scoring model's tokenizer, the text on its own)."""
    tokens_kept: int
    """The text's first tokens, which the model scored (at most the limit)."""
    tokens_cut: int
    """`tokens - tokens_kept`: the tokens the model did not see."""
    chars_kept: int
    """The scored text is the passage's first `chars_kept` characters (Unicode code points):
    it tokenises, on its own, to exactly its first `tokens_kept` tokens."""


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


class PositionBiasOut(_Model):
    coefficients: list[float]
    """Fitted weight of each prompt slot (sums to 1)."""
    identified: bool
    identification: Literal["full", "up_to_scale", "none"]
    orientation: Literal["data", "reference", "default_reference", "none"]
    orientation_strength: float | None
    profile: ProfileOut | None
    """The calibrated profile used (cyclic designs and orientation), if any."""


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

    path: Literal["profile", "flat", "moi", "explore", "cold", "holdout", "pass_through"]
    """`profile`: ranked cheaply and placed by a trusted profile, no model call; `flat`: the
    trusted profile is flat, so best first; `moi`: no trusted profile yet (this run is kept
    for learning); `explore`: a trusted profile, and this request's MoI run checks it in the
    background; `cold`: no trusted profile and MoI too slow to wait on
    (`RAG_REORDER_AUTO_COLD_MAX_S`): placed by a prior (another passage count's profile) or
    left in the retriever's order, its MoI run learned from in the background; `holdout`:
    drawn into the randomized holdout (`RAG_REORDER_HOLDOUT_RATE`): the control order
    (`RAG_REORDER_HOLDOUT_ORDER`) instead of the placement; `pass_through`: `outcome_policy`
    `act` found the placement does not help this key: the retriever's order, no ranking
    (docs/outcomes.md)."""
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
    arm: Literal["placed", "holdout", "pass_through"] | None = None
    """The randomized holdout's arm that served it (null: not in the experiment: the holdout
    is off, the path is not a placed one, or the request was exempt)."""


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
    context: ContextOut | None = None
    """With the request's `context`: the kept passages in prompt order, their tokens and the
    budget, the tokenizer that counted, and every dropped passage with why."""
    truncated: list[TruncatedOut] = Field(default_factory=list)
    """The passages cut to the per-passage token limit (`truncate` `end`), in passage order;
    empty when none was. Nothing is cut without being listed here. Everything else (indices,
    ids, the rerank routes' `document.text`) refers to the passage as sent, in full."""
    diagnostics: DiagnosticsOut
    usage: UsageOut
    timing: TimingOut
    cached: bool = False
    """Served from the response cache (`RAG_REORDER_CACHE_MAX_BYTES`, docs/cache.md): a
    byte-identical request's answer, under this request's `id`; `usage` and `timing` are
    then this request's (no model call: zeros and the lookup's time)."""


class ReorderResponse(ReorderMeta):
    id: str
    model: str
    feedback_id: str | None = None
    """The token `POST /v1/feedback` takes for this served request (an outcome, the
    generator's answer): made by the server, unguessable, valid for the caller it was served
    to within `RAG_REORDER_FEEDBACK_TTL_S`. Null while feedback is off."""
