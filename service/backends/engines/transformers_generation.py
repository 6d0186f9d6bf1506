"""Greedy generation on a transformers model: lockstep batches (one prefill, one forward per
token, finished rows pruned) and the score ids of a generation read from its prefill
(``TransformersBackend``'s generation half).
"""

from __future__ import annotations

import copy
import math
import threading

import torch
from transformers import PreTrainedModel

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    checked_span,
)
from service.backends.engines.transformers_forward import SpanScoring, token_logprobs
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer


class GreedyGeneration(SpanScoring):
    """The generation methods of ``TransformersBackend`` (a mixin: it sets the attributes)."""

    # Finished rows leave a lockstep generation batch (``_greedy``). Only
    # ``bench/generation.py`` turns it off, to measure what it saves side by side.
    prune_finished: bool = True
    _tokenizer: HFPromptTokenizer
    _max_model_len: int
    _accepts_logits_to_keep: bool
    _cache_name: str

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
