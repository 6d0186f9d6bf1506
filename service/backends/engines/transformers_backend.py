"""``LogprobBackend`` on a transformers causal LM, on CPU or one CUDA device.

Three modules beside this one hold its halves: ``transformers_loading`` (device, dtype, the
adapter merge, the head probe), ``transformers_forward`` (span scoring) and
``transformers_generation`` (greedy generation); with the GGUF conversion, the adapter merge,
the embedding encoder and the distillation's training, they are the only modules that import
torch and transformers (an import-linter contract keeps it so). peft is imported to apply a
distilled scorer's LoRA adapter (``RAG_REORDER_ADAPTER``), merged into the weights once at load.

Scoring packs the requests of every concurrent call into shared padded batches under
``batch_token_budget`` (``service.backends.scheduling.scheduler``, with the packing rule of
``service.backends.scheduling.batching``) and runs the vocabulary-sized LM head only on the rows
whose log-probs are asked for: on SmolLM2 the head is ~20% of a forward and the full-vocabulary
log-softmax over every prompt row is what makes prompt-log-prob serving run out of memory (see
docs/operations.md).

Errors: a malformed request (span out of range, unknown token id, prompt over the context)
raises ``InvalidRequest``/``LimitExceeded`` for the whole call before any forward runs -- a
caller bug, not a broken backend. A forward that fails (out of memory, non-finite output) yields
``PromptFailure`` for the prompts concerned; the others are still scored.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    ScoreResult,
    SpanRequest,
    check_generations,
    check_scoring,
)
from service.backends.engines.transformers_forward import token_logprobs
from service.backends.engines.transformers_generation import GreedyGeneration
from service.backends.engines.transformers_loading import (
    DeviceName,
    DtypeName,
    context_length,
    default_batch_token_budget,
    generation_eos_ids,
    merged,
    probe_head,
    resolve_device,
    resolve_dtype,
    weight_rows,
)
from service.backends.scheduling.batching import HeadMode, plan_generation_batches
from service.backends.scheduling.scheduler import ForwardScheduler
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.config.settings import Settings
from service.errors import BackendUnavailable
from service.model_assets import resolve_model
from service.model_assets.adapter import adapted_model_id, configured_adapter

__all__ = [
    "DeviceName",
    "DtypeName",
    "TransformersBackend",
    "default_batch_token_budget",
    "token_logprobs",
]

logger = logging.getLogger(__name__)

# Head output plus its float32 copy for the log-softmax, per batch: the planner keeps
# rows x vocab x 8 bytes under this, because that tensor, not the KV state, is what blows up.
_LOGITS_BYTES_BUDGET = 1 << 30


class TransformersBackend(GreedyGeneration):
    """Scores spans and generates greedily with a local transformers model.

    Forwards are blocking, so they run in a worker thread, one at a time (an ``anyio.Lock``
    serialises them; a second forward would only compete for the same cores or GPU memory).
    Scoring goes through a ``ForwardScheduler``: the prompts of all concurrent ``score`` calls
    share forwards (continuous micro-batching), and a cancelled call drops its prompts not yet
    in a forward. Generation keeps its own lockstep batches per call, taking the same lock
    per batch, so it interleaves with the shared scoring forwards.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: HFPromptTokenizer,
        *,
        model_id: str,
        max_model_len: int,
        batch_token_budget: int,
        head_mode: HeadMode = "auto",
    ) -> None:
        """Wrap an already loaded model; most callers want ``from_settings`` or ``load``.

        Args:
            model: a causal LM in eval mode on its device.
            tokenizer: the model's tokenizer, adapted.
            model_id: the name reported by ``model_id``.
            max_model_len: longest prompt (plus generated tokens) accepted.
            batch_token_budget: at most this many padded tokens per forward batch; a single
                longer prompt still runs, alone.
            head_mode: which rows reach the LM head (see ``HeadMode``); ``auto`` probes.

        Raises:
            ValueError: ``head_mode`` asks for ``logits_to_keep`` the model does not support.
        """
        self._model: PreTrainedModel | None = model
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._max_model_len = max_model_len
        self._batch_token_budget = batch_token_budget
        self._device = next(model.parameters()).device
        self._vocab_size = weight_rows(model.get_input_embeddings())
        forward_params = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in forward_params
        # transformers 5.2x renamed the KV cache's argument and output field from
        # ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40); older
        # releases know only the old one. The same name serves both directions.
        self._cache_name = "cache" if "cache" in forward_params else "past_key_values"
        supported, head_vocab = probe_head(model, self._device, self._accepts_logits_to_keep)
        if head_mode == "auto":
            head_mode = supported[0]
        elif head_mode not in supported:
            raise ValueError(f"head_mode {head_mode!r} unsupported here; supported: {supported}")
        self._head_mode: HeadMode = head_mode
        self._max_logit_rows = max(1, _LOGITS_BYTES_BUDGET // (head_vocab * 8))
        self._lock = anyio.Lock()
        self._scheduler = ForwardScheduler(
            self._run_score_batch,
            token_budget=batch_token_budget,
            row_budget=self._max_logit_rows,
            head_mode=self._head_mode,
            engine_lock=self._lock,
        )
        # Engine jobs whose caller was cancelled: they finish (or stop at their next decode
        # step) in the background, holding the lock; kept here so they are not collected.
        self._orphans: set[asyncio.Task[list[GenerateResult]]] = set()

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings) -> TransformersBackend:
        """Resolve (converting once if needed) and load the configured model. Blocks seconds.

        Args:
            settings: model, cache_dir, device, dtype, batch_token_budget, max_model_len.

        Returns:
            A ready backend.

        Raises:
            BackendUnavailable: the model cannot be found, converted or loaded, or the
                configured adapter does not fit it.
        """
        manifest = configured_adapter(settings)
        return cls.load(
            resolve_model(settings),
            model_id=adapted_model_id(settings.model, manifest),
            adapter=settings.adapter,
            device=settings.device,
            dtype=settings.dtype,
            batch_token_budget=settings.batch_token_budget,
            max_model_len=settings.max_model_len,
        )

    @classmethod
    def load(
        cls,
        folder: Path,
        *,
        model_id: str | None = None,
        device: DeviceName = "auto",
        dtype: DtypeName = "auto",
        batch_token_budget: int | None = None,
        max_model_len: int | None = None,
        head_mode: HeadMode = "auto",
        adapter: Path | None = None,
    ) -> TransformersBackend:
        """Load a transformers model folder (config, weights, tokenizer). Blocks seconds.

        Args:
            folder: local model folder.
            model_id: reported name; default the folder name.
            device: ``auto`` uses CUDA when available.
            dtype: ``auto`` is float32 on CPU and bfloat16 on CUDA.
            batch_token_budget: padded tokens per forward batch; default by device
                (``default_batch_token_budget``).
            max_model_len: context length; default (and upper bound) the model's own.
            head_mode: see ``HeadMode``.
            adapter: a peft LoRA adapter folder to merge into the weights.

        Returns:
            A ready backend.

        Raises:
            BackendUnavailable: the folder or the adapter cannot be loaded, or the device is
                missing.
        """
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        try:
            # device_map puts the weights straight on the device, without a CPU copy first.
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch_dtype, device_map=str(torch_device)
            )
            hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as exc:
            raise BackendUnavailable(
                f"cannot load model {model_id or folder.name!r}: {type(exc).__name__}"
            ) from exc
        if adapter is not None:
            model = merged(model, adapter)
        model.train(False)  # eval mode; PreTrainedModel.eval() is untyped
        model.requires_grad_(False)
        tokenizer = HFPromptTokenizer(hf_tokenizer, extra_eos_token_ids=generation_eos_ids(model))
        context = context_length(model, max_model_len)
        budget = batch_token_budget or default_batch_token_budget(torch_device)
        logger.info(
            "loaded %s on %s (%s), context %d, %d padded tokens per forward batch",
            model_id or folder.name,
            torch_device,
            torch_dtype,
            context,
            budget,
        )
        return cls(
            model,
            tokenizer,
            model_id=model_id or folder.name,
            max_model_len=context,
            batch_token_budget=budget,
            head_mode=head_mode,
        )

    def with_batch_token_budget(self, budget: int) -> TransformersBackend:
        """The same loaded weights behind another forward-batch budget (bench/batch_budget.py
        compares budgets without loading the model once per budget). The two backends share
        the model but not their lock, so use one at a time; closing one leaves the other open.

        Raises:
            BackendUnavailable: this backend is closed.
        """
        return TransformersBackend(
            self._require_open(),
            self._tokenizer,
            model_id=self._model_id,
            max_model_len=self._max_model_len,
            batch_token_budget=budget,
            head_mode=self._head_mode,
        )

    # --- LogprobBackend -------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def batch_token_budget(self) -> int:
        """Padded prompt tokens per forward batch."""
        return self._batch_token_budget

    @property
    def tokenizer(self) -> HFPromptTokenizer:
        return self._tokenizer

    @property
    def device(self) -> str:
        """The torch device the model runs on, e.g. ``cpu`` or ``cuda:0``."""
        return str(self._device)

    @property
    def head_mode(self) -> HeadMode:
        """Which rows reach the LM head (never ``auto`` once built)."""
        return self._head_mode

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Log-probs of each request's span tokens, one result per request, in order.

        Args:
            requests: prompts with the span to score.

        Returns:
            ``SpanLogprobs`` per request, or ``PromptFailure`` where its forward failed or gave
            non-finite or positive log-probs.

        Raises:
            InvalidRequest: a span is out of range or a token id is not in the vocabulary.
            LimitExceeded: a prompt is longer than ``max_model_len``.
            BackendUnavailable: the backend is closed.
        """
        self._require_open()
        check_scoring(requests, limit=self._max_model_len, vocab_size=self._vocab_size)
        # Tokens after a span's end cannot change its log-probs (causal model): not forwarded.
        reqs = [r if len(r.token_ids) == r.span_end else _cut_at_span_end(r) for r in requests]
        return await self._scheduler.score(reqs)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Greedy continuations, one result per request, in order.

        A generation stops after a stop id (the request's or the tokenizer's eos ids); that id
        is the last of ``token_ids`` and has its log-prob, as in vLLM's output token ids. A
        request's ``score_ids`` are scored from the same prefill as its answer (``_greedy``).

        Args:
            requests: prompts with ``max_new_tokens >= 1``.

        Returns:
            ``Generation`` per request (``finish_reason`` ``stop`` or ``length``; ``length``
            also when the context is full; ``score_logprobs`` when it had ``score_ids``), or
            ``PromptFailure`` where a forward failed or gave a non-finite log-prob.

        Raises:
            InvalidRequest: empty prompt, unknown token id (prompt or score ids), or
                ``max_new_tokens < 1``.
            LimitExceeded: the prompt leaves no room in ``max_model_len`` to generate, or the
                prompt plus its score ids do not fit in it.
            BackendUnavailable: the backend is closed.
        """
        self._require_open()
        reqs = list(requests)
        # Room for the first answer token; the score ids are teacher-forced, no answer after.
        check_generations(
            reqs,
            limit=self._max_model_len - 1,
            scored_limit=self._max_model_len,
            vocab_size=self._vocab_size,
        )
        results: dict[int, GenerateResult] = {}
        for batch in plan_generation_batches(
            [(len(r.token_ids), self._steps(r)) for r in reqs],
            token_budget=self._batch_token_budget,
            scored=[len(r.score_ids) for r in reqs],
        ):
            done = await self._run_generation([reqs[i] for i in batch])
            for i, result in zip(batch, done, strict=True):
                results[i] = result
        return [results[i] for i in range(len(reqs))]

    async def aclose(self) -> None:
        """Release the model (waits for a running forward); later calls raise."""
        async with self._lock:
            if self._model is None:
                return
            self._model = None
            gc.collect()
            if self._device.type == "cuda":
                torch.cuda.empty_cache()

    @property
    def scheduler(self) -> ForwardScheduler:
        """Packs the span requests of all concurrent ``score`` calls into shared forwards."""
        return self._scheduler

    # --- internals ------------------------------------------------------------------------

    async def _run_score_batch(self, batch: list[SpanRequest]) -> list[ScoreResult]:
        # The scheduler holds the lock (it packs the forward once the engine is free).
        model = self._require_open()
        return await anyio.to_thread.run_sync(self._score_batch, model, batch)

    async def _run_generation(self, batch: list[GenerationRequest]) -> list[GenerateResult]:
        """One lockstep generation batch, in a task of its own that holds the engine lock.

        A blocking call in a worker thread cannot be interrupted, and awaiting it in the
        caller's task made a cancelled caller (deadline, client gone) wait for the whole
        generation: a 504 189 s after a 120 s deadline (issue 44). Here the caller awaits the
        job shielded, so its cancellation returns at once; the job sees the cancel flag
        between decode steps and stops, and until then it keeps the lock, so the engine still
        runs one thing at a time.
        """
        cancelled = threading.Event()

        async def job() -> list[GenerateResult]:
            async with self._lock:
                model = self._require_open()
                if cancelled.is_set():
                    return []  # the caller left while the engine was busy: nothing to run
                return await anyio.to_thread.run_sync(self._generate_batch, model, batch, cancelled)

        task = asyncio.get_running_loop().create_task(job(), name="generation-batch")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled.set()
            self._orphans.add(task)
            task.add_done_callback(_forget_orphan(self._orphans))
            raise

    def _require_open(self) -> PreTrainedModel:
        if self._model is None:
            raise BackendUnavailable("the transformers backend is closed")
        return self._model


def _cut_at_span_end(req: SpanRequest) -> SpanRequest:
    return SpanRequest(req.request_id, req.token_ids[: req.span_end], req.span_start, req.span_end)


def _forget_orphan(
    orphans: set[asyncio.Task[list[GenerateResult]]],
) -> Callable[[asyncio.Task[list[GenerateResult]]], None]:
    def forget(task: asyncio.Task[list[GenerateResult]]) -> None:
        orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Nobody awaits it any more; its caller already left.
            logger.warning("an abandoned generation batch failed: %r", task.exception())

    return forget
