"""``/info``, ``/v1/models`` and the probes' wire models: the model, limits, capacity,
CPUs, ``auto``'s state and the score mode.
"""

from __future__ import annotations

from typing import Literal

from app.schemas.base import ResultsOrder, Strategy, _Model
from app.schemas.feedback import UpliftOut
from app.schemas.profiles import TrustOut


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
    admitted on an idle engine and re-measures it, or, over twice its deadline even at
    `best_tokens_per_s` with the rate canary on, gets 503 while the canary re-measures."""
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


class DenseOut(_Model):
    """The `dense` encoder (all-MiniLM-L6-v2, `auto`'s default ranker) since start: where it
    runs, how concurrent requests shared its forwards, and its cache (`RAG_REORDER_DENSE_*`)."""

    device: str
    torch_threads: int
    batch_tokens: int
    requests: int
    texts: int
    """Texts asked for (each request's query and passages)."""
    cache_hits: int
    """Texts answered from the cache, without a forward."""
    cache_entries: int
    cache_capacity: int
    forwards: int
    rows: int
    """Texts embedded by the forwards (cache misses, a repeated text once)."""
    tokens: int
    padded_tokens: int
    """Rows x longest text, summed over forwards (what the forwards computed)."""
    max_requests_per_forward: int


class LimitsOut(_Model):
    max_body_bytes: int
    max_passages: int
    max_passage_chars: int
    max_passage_tokens: int | None
    """The per-passage token limit (null: none); a request's `truncate` `end` cuts to it."""
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


class GeneratorProfileOut(_Model):
    """The generator's profile for one passage count, as learned online from its answers."""

    passages: int
    """N: the passages shown (the profile's slots)."""
    answers: int
    """Sampled requests the generator answered (pooled: every replica, across restarts)."""
    attributed: float
    """Their summed weight attributed to a passage (an answer held by m passages: 1/m each)."""
    unattributed: int
    """Answers no passage supports (no weight)."""
    verdict: Literal["shaped", "flat", "undecided"] | None
    """The trust rule's verdict (null before the first answer); `undecided`: cannot tell yet."""
    reason: str
    flat_p: float | None
    """p-value of the randomisation test against no slot preference."""
    share: list[float]
    """Each slot's share of the attributed weight (the estimate)."""
    low: list[float]
    high: list[float]
    """Bootstrap interval of each slot's share."""
    profile: str | None
    """Id of the stored profile of the generator for this passage count (null: none)."""
    placing: bool
    """Whether `auto` places requests of this passage count by it (stored with trust)."""
    kept: str | None = None
    """Why it is still placed by though `verdict` (the last refit) is `undecided`: a trusted
    profile stays trusted while the refit keeps its top slots in `generator_keep_stability` of
    resampled fits (null: not so kept)."""


class GeneratorOnlineOut(_Model):
    """`auto`'s online learning of the generator's profile (`RAG_REORDER_GENERATOR_URL`)."""

    url: str | None
    """The generator's API (credentials and query values shown as `***`); null without
    `RAG_REORDER_GENERATOR_URL` (answers by feedback only)."""
    model: str
    template: str
    sample_rate: float
    max_calls_per_hour: int
    calls: int
    """HTTP calls sent since start, retries included."""
    queued: int
    """Samples waiting for the generator now."""
    samples: dict[str, int]
    """Requests drawn since start: taken, dropped (queue full), over_budget."""
    failures: dict[str, int]
    answers: dict[str, int]
    """Answers since start (sampled and fed back) by attribution: contained, overlap, none."""
    ties: dict[str, int]
    """Answers since start held by several passages: the tie broken by the scoring model's
    likelihood of the answer under each (`broken`), or the weight split (`split`)."""
    feedback: dict[str, int]
    """`POST /v1/feedback` answers since start: used (a random placement), unused."""
    kept_for_feedback: int | None
    """Served requests kept for feedback now (`RAG_REORDER_FEEDBACK_*`), by every process
    that shares them (`kept_for_feedback_scope`); null: the state store cannot be reached."""
    kept_for_feedback_bytes: int | None
    """Their size as `RAG_REORDER_FEEDBACK_MAX_BYTES` bounds it; null as above."""
    kept_for_feedback_scope: Literal["process", "folder", "deployment"]
    """Who shares them and their bounds: this process (no state store), the profile folder
    (every worker of the host), or the deployment (Redis)."""
    profiles: list[GeneratorProfileOut]


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
    generator_online: GeneratorOnlineOut | None = None
    """The generator's profile learned from its answers (null without
    `RAG_REORDER_GENERATOR_URL`)."""
    outcomes: OutcomesOut | None = None
    """The randomized holdout and the placement's uplift per key (null while the holdout is
    off: `RAG_REORDER_HOLDOUT_RATE` 0 or feedback off; docs/outcomes.md)."""


class OutcomesOut(_Model):
    """`auto`'s randomized holdout and what the outcomes reported say."""

    holdout_rate: float
    holdout_order: Literal["retriever", "shuffle"]
    policy: Literal["report", "act"]
    alpha: float
    margin: float
    placed_share: float
    """`act`: the share of a passed-through key still placed."""
    keys: list[UpliftOut]


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
    dense: DenseOut | None = None
    """The `dense` encoder's figures (null until a request used it)."""
