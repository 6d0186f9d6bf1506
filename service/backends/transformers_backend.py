"""``LogprobBackend`` on a transformers causal LM, on CPU or one CUDA device.

With ``service.model_assets.gguf`` (the GGUF conversion) and the distillation's training
(``offline.distill.train``), the only module of the project that imports torch and
transformers (an import-linter contract keeps it so); it also imports peft, to apply a distilled
scorer's LoRA adapter (``RAG_REORDER_ADAPTER``), merged into the weights once at load.

Scoring packs the requests of every concurrent call into shared padded batches under
``batch_token_budget`` (``service.backends.scheduler``, with the packing rule of
``service.backends.batching``) and runs the vocabulary-sized LM head only on the rows whose
log-probs are asked for: on SmolLM2 the head is ~20% of a forward and the full-vocabulary
log-softmax over every prompt row is what makes prompt-log-prob serving run out of memory (see
docs/operations.md).

Errors: a malformed request (span out of range, unknown token id, prompt over the context)
raises ``InvalidRequest``/``LimitExceeded`` for the whole call before any forward runs -- a
caller bug, not a broken backend. A forward that fails (out of memory, non-finite output) yields
``PromptFailure`` for the prompts concerned; the others are still scored.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import logging
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TypeVar, cast

import anyio
import anyio.to_thread
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    checked_span,
    out_of_vocab,
)
from service.backends.batching import HeadMode, plan_generation_batches
from service.backends.hf_tokenizer import HFPromptTokenizer
from service.backends.scheduler import ForwardScheduler
from service.errors import BackendUnavailable, InvalidRequest, LimitExceeded
from service.model_assets import resolve_model
from service.model_assets.adapter import adapted_model_id, configured_adapter
from service.settings import Settings

logger = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
Req = TypeVar("Req", SpanRequest, GenerationRequest)
Res = TypeVar("Res", ScoreResult, GenerateResult)
_Model = TypeVar("_Model", bound=torch.nn.Module)
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]

# Head output plus its float32 copy for the log-softmax, per batch: the planner keeps
# rows x vocab x 8 bytes under this, because that tensor, not the KV state, is what blows up.
_LOGITS_BYTES_BUDGET = 1 << 30
# Padded prompt tokens per forward batch when the settings leave it open. A GPU needs large
# batches to stay busy; a CPU does not, and there a large padded batch is slower
# (bench/results/batch_budget.json: SmolLM2 on 2 cores, 4096 against 16384).
_CUDA_BATCH_TOKENS = 16384
_CPU_BATCH_TOKENS = 4096
_DEFAULT_CONTEXT = 2048


class TransformersBackend:
    """Scores spans and generates greedily with a local transformers model.

    Forwards are blocking, so they run in a worker thread, one at a time (an ``anyio.Lock``
    serialises them; a second forward would only compete for the same cores or GPU memory).
    Scoring goes through a ``ForwardScheduler``: the prompts of all concurrent ``score`` calls
    share forwards (continuous micro-batching), and a cancelled call drops its prompts not yet
    in a forward. Generation keeps its own lockstep batches per call, taking the same lock
    per batch, so it interleaves with the shared scoring forwards.
    """

    # Finished rows leave a lockstep generation batch (``_greedy``). Only
    # ``bench/generation.py`` turns it off, to measure what it saves side by side.
    prune_finished: bool = True

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
        self._vocab_size = _weight_rows(model.get_input_embeddings())
        forward_params = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in forward_params
        # transformers 5.2x renamed the KV cache's argument and output field from
        # ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40); older
        # releases know only the old one. The same name serves both directions.
        self._cache_name = "cache" if "cache" in forward_params else "past_key_values"
        supported, head_vocab = _probe_head(model, self._device, self._accepts_logits_to_keep)
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
        torch_device = _resolve_device(device)
        torch_dtype = _resolve_dtype(dtype, torch_device)
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
            model = _merged(model, adapter)
        model.train(False)  # eval mode; PreTrainedModel.eval() is untyped
        model.requires_grad_(False)
        tokenizer = HFPromptTokenizer(hf_tokenizer, extra_eos_token_ids=_generation_eos_ids(model))
        context = _context_length(model, max_model_len)
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
        reqs = list(requests)
        for req in reqs:
            self._validate_prompt(req.request_id, req.token_ids, reserve=0)
            _validate_span(req)
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
        for req in reqs:
            self._validate_prompt(req.request_id, req.token_ids, reserve=1)
            if req.max_new_tokens < 1:
                raise InvalidRequest(
                    f"request {req.request_id!r}: max_new_tokens must be >= 1, "
                    f"got {req.max_new_tokens}",
                    param="max_new_tokens",
                )
            if req.score_ids:
                self._validate_score_ids(req)
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

    def _validate_prompt(self, request_id: str, token_ids: Sequence[int], *, reserve: int) -> None:
        n = len(token_ids)
        if n == 0:
            raise InvalidRequest(f"request {request_id!r}: empty prompt", param="token_ids")
        if n + reserve > self._max_model_len:
            raise LimitExceeded("token_ids", self._max_model_len - reserve, n, what="prompt tokens")
        # An out-of-range id is an index error on CPU and a device-side assert on CUDA, which
        # poisons the CUDA context for every later request: check before any forward.
        bad = out_of_vocab(token_ids, self._vocab_size)
        if bad is not None:
            raise InvalidRequest(
                f"request {request_id!r}: token ids must be in [0, {self._vocab_size}), got {bad}",
                param="token_ids",
            )

    def _validate_score_ids(self, req: GenerationRequest) -> None:
        n, m = len(req.token_ids), len(req.score_ids)
        if n + m > self._max_model_len:
            raise LimitExceeded(
                "score_ids",
                self._max_model_len - n,
                m,
                what=f"score tokens after a {n}-token prompt in a {self._max_model_len}-token "
                "context",
            )
        bad = out_of_vocab(req.score_ids, self._vocab_size)
        if bad is not None:
            raise InvalidRequest(
                f"request {req.request_id!r}: score ids must be in [0, {self._vocab_size}), "
                f"got {bad}",
                param="score_ids",
            )

    def _score_batch(self, model: PreTrainedModel, batch: list[SpanRequest]) -> list[ScoreResult]:
        def forward(part: list[SpanRequest]) -> list[ScoreResult]:
            flat = self._forward_span_logprobs(model, part)
            results: list[ScoreResult] = []
            start = 0
            for req in part:
                end = start + req.span_end - req.span_start
                results.append(checked_span(req.request_id, flat[start:end]))
                start = end
            return results

        return self._isolating_failures(forward, batch, "prompt")

    def _forward_span_logprobs(
        self, model: PreTrainedModel, batch: list[SpanRequest]
    ) -> list[float]:
        """Span log-probs of ``batch``, concatenated in batch order."""
        width = max(len(req.token_ids) for req in batch)
        # Right padding: causal attention keeps real rows blind to the pad tail, so positions
        # and values match an unpadded forward. Pad id 0 is any valid id; it is masked out.
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows_b: list[int] = []
        rows_t: list[int] = []
        targets: list[int] = []
        for b, req in enumerate(batch):
            n = len(req.token_ids)
            input_ids[b, :n] = torch.tensor(req.token_ids, dtype=torch.long)
            attention_mask[b, :n] = 1
            # The logits at position t predict token t + 1.
            rows_b.extend([b] * (req.span_end - req.span_start))
            rows_t.extend(range(req.span_start - 1, req.span_end - 1))
            targets.extend(req.token_ids[req.span_start : req.span_end])
        kwargs: dict[str, object] = {
            "input_ids": input_ids.to(self._device),
            "attention_mask": attention_mask.to(self._device),
            # No KV cache: scoring never continues a prompt, so the cache would be pure waste.
            "use_cache": False,
        }
        rows = self._head_rows(model, kwargs, (len(batch), width), rows_b, rows_t)
        target = torch.tensor(targets, dtype=torch.long, device=self._device)
        values: list[float] = token_logprobs(rows, target).cpu().tolist()
        return values

    def _head_rows(
        self,
        model: PreTrainedModel,
        kwargs: dict[str, object],
        shape: tuple[int, int],
        rows_b: list[int],
        rows_t: list[int],
    ) -> torch.Tensor:
        """Logits of ``model(**kwargs)`` at the positions ``(rows_b[k], rows_t[k])``, as a
        ``(len(rows_b), vocab)`` tensor, with no more rows through the LM head than the head
        mode needs. ``shape`` is the input's ``(batch, positions)``; the pairs must come in
        (batch, position) order."""
        b_idx = torch.tensor(rows_b, dtype=torch.long)
        t_idx = torch.tensor(rows_t, dtype=torch.long)
        if self._head_mode == "mask":
            keep = torch.zeros(shape, dtype=torch.bool)
            keep[b_idx, t_idx] = True
            # Boolean logits_to_keep flattens kept rows in (batch, position) order, the order
            # the pairs come in.
            rows: torch.Tensor = model(**kwargs, logits_to_keep=keep.to(self._device)).logits
            return rows
        if self._head_mode == "positions":
            positions = sorted(set(rows_t))
            column = {t: k for k, t in enumerate(positions)}
            keep_at = torch.tensor(positions, dtype=torch.long).to(self._device)
            logits = model(**kwargs, logits_to_keep=keep_at).logits
            u_idx = torch.tensor([column[t] for t in rows_t], dtype=torch.long)
            rows = logits[b_idx.to(self._device), u_idx.to(self._device)]
            return rows
        logits = model(**kwargs).logits
        rows = logits[b_idx.to(self._device), t_idx.to(self._device)]
        return rows

    def _steps(self, req: GenerationRequest) -> int:
        """Tokens ``req`` may generate: its budget, cut where the context ends."""
        return min(req.max_new_tokens, self._max_model_len - len(req.token_ids))

    def _generate_batch(
        self,
        model: PreTrainedModel,
        batch: list[GenerationRequest],
        cancelled: threading.Event | None = None,
    ) -> list[GenerateResult]:
        return self._isolating_failures(
            lambda part: self._greedy(model, part, cancelled), batch, "generation"
        )

    def _isolating_failures(
        self,
        run: Callable[[list[Req]], list[Res]],
        batch: list[Req],
        what: str,
    ) -> list[Res | PromptFailure]:
        """``run(batch)`` under inference mode; a failed forward (out of memory, a kernel
        error) is retried request by request, so only the request that fails alone gets a
        ``PromptFailure`` and the others are still served."""
        try:
            with torch.inference_mode():
                return list(run(batch))
        except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            if len(batch) > 1:
                logger.warning(
                    "%s batch of %d failed (%s); retrying one by one",
                    what,
                    len(batch),
                    type(exc).__name__,
                )
                return [self._isolating_failures(run, [req], what)[0] for req in batch]
            rid = batch[0].request_id
            logger.warning("%s %s failed: %s", what, rid, type(exc).__name__)
            return [PromptFailure(rid, f"forward failed: {type(exc).__name__}")]

    def _greedy(
        self,
        model: PreTrainedModel,
        batch: list[GenerationRequest],
        cancelled: threading.Event | None = None,
    ) -> list[GenerateResult]:
        """Greedy decoding of ``batch`` in lockstep: one prefill, then one forward per token.

        Prompts are left-padded so every row's next token sits in the last column; the
        attention mask hides the pads and explicit position ids start each row at 0, so a row
        decodes as it would alone. One host sync per step reads every row's token at once,
        instead of one decode loop (and one sync per token) per request; a finished row
        leaves the batch and its KV cache. Rows with score ids
        get them scored from the same prefill (``_score_after_prefill``) before decoding.
        Once ``cancelled`` is set (its caller left) decoding stops at the next step, and the
        rows end as they are (``length``): nobody reads them.
        """
        rows = len(batch)
        width = max(len(r.token_ids) for r in batch)
        steps = [self._steps(r) for r in batch]
        stops = [r.stop_token_ids | self._tokenizer.eos_token_ids for r in batch]
        input_ids = torch.zeros((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for b, req in enumerate(batch):
            n = len(req.token_ids)
            input_ids[b, width - n :] = torch.tensor(req.token_ids, dtype=torch.long)
            mask[b, width - n :] = 1
        input_ids, mask = input_ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        kwargs: dict[str, object] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            "use_cache": True,
        }
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = model(**kwargs)
        scored: list[tuple[float, ...] | PromptFailure | None] = [None] * rows
        if any(r.score_ids for r in batch):
            # Under logits_to_keep=1 the prefill's logits are (rows, 1, vocab), else (rows,
            # width, vocab): the last column is each prompt's last position either way.
            scored = self._score_after_prefill(
                model, batch, out.logits[:, -1], getattr(out, self._cache_name), mask, positions
            )
        tokens: list[list[int]] = [[] for _ in batch]
        values: list[list[float]] = [[] for _ in batch]
        # A row whose score ids failed is finished before it starts: the request fails whole.
        finished: list[GenerateResult | None] = [
            s if isinstance(s, PromptFailure) else None for s in scored
        ]

        def generation(b: int, reason: str) -> Generation:
            score = scored[b]
            return Generation(
                batch[b].request_id,
                tuple(tokens[b]),
                tuple(values[b]),
                reason,
                score_logprobs=score if isinstance(score, tuple) else None,
            )

        # ``active[i]``: the request of the batch's row i. A row leaves the batch (and its
        # KV cache) once it is finished: one answer that runs to the token budget would
        # otherwise keep every finished row of its batch in each decode forward. On
        # Gemma-3's 262k-token head, that row's LM head alone costs as much as its layers.
        active = list(range(rows))
        last = positions[:, -1:]
        for step in range(max(steps)):
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            best = torch.argmax(logp, dim=-1)
            picked = logp.gather(1, best[:, None]).squeeze(1)
            best_host, picked_host = best.tolist(), picked.tolist()
            for i, b in enumerate(active):
                if finished[b] is not None:
                    continue
                req = batch[b]
                token, value = int(best_host[i]), float(picked_host[i])
                if not math.isfinite(value):
                    finished[b] = PromptFailure(req.request_id, "non-finite log-prob in generation")
                    continue
                tokens[b].append(token)
                values[b].append(value)
                if token in stops[b]:
                    finished[b] = generation(b, "stop")
                elif len(tokens[b]) >= steps[b]:
                    finished[b] = generation(b, "length")
            keep = [i for i, b in enumerate(active) if finished[b] is None]
            if not keep or step + 1 >= max(steps):
                break
            if cancelled is not None and cancelled.is_set():
                break
            cache = getattr(out, self._cache_name)
            if self.prune_finished and len(keep) < len(active):
                kept = torch.tensor(keep, dtype=torch.long, device=mask.device)
                cache.batch_select_indices(kept)
                mask, last, best = mask[kept], last[kept], best[kept]
                active = [active[i] for i in keep]
            mask = torch.cat(
                [mask, torch.ones((len(active), 1), dtype=mask.dtype, device=mask.device)], 1
            )
            last = last + 1
            out = model(
                input_ids=best[:, None],
                attention_mask=mask,
                position_ids=last,
                use_cache=True,
                **{self._cache_name: cache},
            )
        return [f if f is not None else generation(b, "length") for b, f in enumerate(finished)]

    def _score_after_prefill(
        self,
        model: PreTrainedModel,
        batch: list[GenerationRequest],
        last_logits: torch.Tensor,
        cache: object,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> list[tuple[float, ...] | PromptFailure | None]:
        """Log-probs of each row's ``score_ids`` after its prompt, from ``_greedy``'s prefill
        (its ``(rows, vocab)`` logits at the last position, its KV ``cache``, the left-padded
        ``mask`` and ``positions``) and at most one more forward.

        The first score id is predicted by the prompt's last position, which the prefill
        already ran through the LM head. The others are predicted by the score ids before
        them: those are fed as one right-padded block after the prompts (mask 0 on the pads,
        positions continuing each row's), on a copy of the prefill's KV cache, so each row
        sees its own prompt and score ids only and decoding goes on from the untouched cache.
        The last score id is never fed: nothing reads what it predicts.

        Returns:
            Per row: the checked log-probs, ``PromptFailure`` when one is not finite (or is
            positive), or ``None`` for a row without score ids.
        """
        device = self._device
        rows = len(batch)
        wanted = [b for b, r in enumerate(batch) if r.score_ids]
        found: list[list[float]] = [[] for _ in batch]
        first_ids = torch.tensor([batch[b].score_ids[0] for b in wanted], device=device)
        first = token_logprobs(last_logits[torch.tensor(wanted, device=device)], first_ids)
        for b, value in zip(wanted, first.cpu().tolist(), strict=True):
            found[b].append(value)
        fed = max(len(r.score_ids) for r in batch) - 1
        if fed > 0:
            ids = torch.zeros((rows, fed), dtype=torch.long)
            tail = torch.zeros((rows, fed), dtype=torch.long)
            rows_b: list[int] = []
            rows_t: list[int] = []
            targets: list[int] = []
            for b, req in enumerate(batch):
                k = len(req.score_ids) - 1
                if k <= 0:
                    continue
                ids[b, :k] = torch.tensor(req.score_ids[:-1], dtype=torch.long)
                tail[b, :k] = 1
                # The logits at block position j predict score id j + 1.
                rows_b.extend([b] * k)
                rows_t.extend(range(k))
                targets.extend(req.score_ids[1:])
            kwargs: dict[str, object] = {
                "input_ids": ids.to(device),
                "attention_mask": torch.cat([mask, tail.to(device)], dim=1),
                "position_ids": positions[:, -1:] + 1 + torch.arange(fed, device=device),
                # A copy, because the forward appends to the cache it is given. deepcopy works
                # for every cache class; cropping back does not (Gemma-3's sliding-window
                # layers have already dropped the tokens a crop would need).
                self._cache_name: copy.deepcopy(cache),
                "use_cache": True,
            }
            logits = self._head_rows(model, kwargs, (rows, fed), rows_b, rows_t)
            target = torch.tensor(targets, dtype=torch.long, device=device)
            rest: list[float] = token_logprobs(logits, target).cpu().tolist()
            del kwargs, logits  # the copied cache: freed before decoding grows the original
            for b, value in zip(rows_b, rest, strict=True):
                found[b].append(value)
        out: list[tuple[float, ...] | PromptFailure | None] = []
        for b, req in enumerate(batch):
            if not req.score_ids:
                out.append(None)
                continue
            checked = checked_span(req.request_id, found[b])
            if isinstance(checked, PromptFailure):
                out.append(PromptFailure(req.request_id, f"score_ids: {checked.reason}"))
            else:
                out.append(checked.logprobs)
        return out


def _forget_orphan(
    orphans: set[asyncio.Task[list[GenerateResult]]],
) -> Callable[[asyncio.Task[list[GenerateResult]]], None]:
    def forget(task: asyncio.Task[list[GenerateResult]]) -> None:
        orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Nobody awaits it any more; its caller already left.
            logger.warning("an abandoned generation batch failed: %r", task.exception())

    return forget


def _merged(model: _Model, adapter: Path) -> _Model:
    """``model`` with a LoRA adapter folded into its weights: a merged model runs at the base
    model's speed (no extra low-rank matmuls per layer) and keeps every forward path
    (``logits_to_keep``, the KV cache) of the base class."""
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BackendUnavailable(
            f"cannot load adapter {adapter.name!r}: {type(exc).__name__}"
        ) from exc
    # merge_and_unload returns the base model object itself, its LoRA layers folded in.
    return cast(_Model, peft_model.merge_and_unload())


def default_batch_token_budget(device: torch.device) -> int:
    """The forward-batch budget for ``device`` when the settings leave it open."""
    return _CUDA_BATCH_TOKENS if device.type == "cuda" else _CPU_BATCH_TOKENS


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[k, targets[k]]`` per row, in float32, without the full softmax.

    Args:
        logits: ``(rows, vocab)`` in any float dtype.
        targets: ``(rows,)`` token ids.

    Returns:
        ``(rows,)`` float32 log-probs in nats.
    """
    logits = logits.float()
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    return picked - torch.logsumexp(logits, dim=-1)


def _validate_span(req: SpanRequest) -> None:
    n = len(req.token_ids)
    if not 1 <= req.span_start < req.span_end <= n:
        raise InvalidRequest(
            f"request {req.request_id!r}: span [{req.span_start}, {req.span_end}) must satisfy "
            f"1 <= span_start < span_end <= {n} (the first token has no log-prob)",
            param="span_start",
        )


def _probe_head(
    model: PreTrainedModel, device: torch.device, accepts_logits_to_keep: bool
) -> tuple[list[HeadMode], int]:
    """Head modes this model supports (best first) and the head's width, by tiny forwards."""
    ids = torch.zeros((2, 3), dtype=torch.long, device=device)
    with torch.inference_mode():
        head_vocab = int(model(input_ids=ids, use_cache=False).logits.shape[-1])
    if not accepts_logits_to_keep:
        return ["full"], head_vocab
    modes: list[HeadMode] = []
    # Three kept rows in a batch of two: a flattened (3, vocab) output proves per-row selection.
    keep = torch.tensor([[False, True, False], [True, False, True]], device=device)
    with torch.inference_mode():
        try:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
            if logits.ndim == 2 and logits.shape[0] == 3:
                modes.append("mask")
        except (RuntimeError, IndexError, TypeError, ValueError):
            pass
        try:
            positions = torch.tensor([0, 2], device=device)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=positions).logits
            if logits.ndim == 3 and tuple(logits.shape[:2]) == (2, 2):
                modes.append("positions")
        except (RuntimeError, IndexError, TypeError, ValueError):
            pass
    modes.append("full")
    return modes, head_vocab


def _weight_rows(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise BackendUnavailable("the model's input embeddings have no weight matrix")
    return int(weight.shape[0])


def _resolve_device(device: DeviceName) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("device 'cuda' requested but no CUDA device is visible")
    return torch.device(device)


def _resolve_dtype(dtype: DtypeName, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # CPU kernels are fastest and exact in float32; bfloat16 halves GPU memory and time.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _generation_eos_ids(model: PreTrainedModel) -> list[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _context_length(model: PreTrainedModel, requested: int | None) -> int:
    native = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(native, int):
        native = None
    if requested is None:
        if native is None:
            logger.warning("model declares no context length; using %d", _DEFAULT_CONTEXT)
        return native or _DEFAULT_CONTEXT
    if native is not None and requested > native:
        logger.warning(
            "max_model_len %d is over the model's context %d; using %d", requested, native, native
        )
        return native
    return requested
