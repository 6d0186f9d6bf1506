"""Span scoring on a transformers model: padded forwards, the LM head on the scored rows only,
and the retry that keeps one failing prompt from failing its batch (``TransformersBackend``'s
scoring half; ``transformers_generation`` is the other).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    checked_span,
)
from service.backends.scheduling.batching import HeadMode

logger = logging.getLogger(__name__)

Req = TypeVar("Req", SpanRequest, GenerationRequest)
Res = TypeVar("Res", ScoreResult, GenerateResult)


class SpanScoring:
    """The forward-side methods of ``TransformersBackend`` (a mixin: it sets the attributes)."""

    _device: torch.device
    _head_mode: HeadMode

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
