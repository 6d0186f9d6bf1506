"""Planning forward batches: which requests share a padded forward, under token and row budgets.

Pure bookkeeping over request shapes (no torch), apart from the backend that runs the forwards,
so that the packing rules can be read, tested and benchmarked on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from service.backends.base import SpanRequest

HeadMode = Literal["auto", "mask", "positions", "full"]
"""Which rows reach the LM head. ``mask``: exactly the scored rows (a 2-D boolean
``logits_to_keep``, recent transformers); ``positions``: the union of scored positions across the
batch (1-D ``logits_to_keep``, older transformers); ``full``: every row (models without
``logits_to_keep``, and the baseline for benchmarks); ``auto``: the best one the model supports."""


class BatchFill:
    """One forward batch as it grows: padded tokens and LM-head rows against the budgets.

    The one packing rule shared by ``plan_batches`` (one call's prompts) and the scheduler
    (``service.backends.scheduling.scheduler``: every in-flight call's prompts), so a request
    scored alone batches exactly as before the scheduler existed.
    """

    def __init__(self, *, token_budget: int, row_budget: int, head_mode: HeadMode) -> None:
        self.token_budget = token_budget
        self.row_budget = row_budget
        self.head_mode: HeadMode = head_mode
        self.size = 0
        self.width = 0
        self._span_rows = 0
        self._union: set[int] = set()

    @property
    def padded_tokens(self) -> int:
        """``size * longest prompt``: what the forward computes, padding included."""
        return self.size * self.width

    def fits(self, req: SpanRequest) -> bool:
        """Whether ``req`` joins without breaking a budget; an empty batch takes anything
        (a request over a budget on its own still gets a batch of one)."""
        if self.size == 0:
            return True
        size = self.size + 1
        width = max(self.width, len(req.token_ids))
        if self.head_mode == "mask":
            rows = self._span_rows + req.span_end - req.span_start
        elif self.head_mode == "positions":
            rows = size * len(self._union | _positions(req))
        else:
            rows = size * width
        return size * width <= self.token_budget and rows <= self.row_budget

    def add(self, req: SpanRequest) -> None:
        self.size += 1
        self.width = max(self.width, len(req.token_ids))
        self._span_rows += req.span_end - req.span_start
        # Only the positions mode needs the union; the others skip building the sets.
        if self.head_mode == "positions":
            self._union |= _positions(req)


def _positions(req: SpanRequest) -> set[int]:
    return set(range(req.span_start - 1, req.span_end - 1))


def plan_batches(
    requests: Sequence[SpanRequest],
    *,
    token_budget: int,
    row_budget: int,
    head_mode: HeadMode = "mask",
) -> list[list[int]]:
    """Group request indices into forward batches, longest prompts first.

    Sorting by length keeps padding small; a batch grows while its padded size stays within
    ``token_budget`` and the rows sent to the LM head stay within ``row_budget``. A request
    over either budget on its own still gets a batch of one (requests are never split).

    Args:
        requests: validated span requests.
        token_budget: max ``batch_size * longest_prompt``.
        row_budget: max rows reaching the LM head, as ``head_mode`` counts them.
        head_mode: ``mask`` counts span rows, ``positions`` batch size times the union of span
            positions, ``full``/``auto`` every padded row.

    Returns:
        Lists of indices into ``requests``; every index appears exactly once.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    fill = BatchFill(token_budget=token_budget, row_budget=row_budget, head_mode=head_mode)
    for i in longest_first(requests):
        if not fill.fits(requests[i]):
            batches.append(current)
            current = []
            fill = BatchFill(token_budget=token_budget, row_budget=row_budget, head_mode=head_mode)
        current.append(i)
        fill.add(requests[i])
    if current:
        batches.append(current)
    return batches


def longest_first(requests: Sequence[SpanRequest]) -> list[int]:
    """Indices of ``requests``, longest prompt first (stable among equal lengths)."""
    return sorted(range(len(requests)), key=lambda i: -len(requests[i].token_ids))


def plan_generation_batches(
    shapes: Sequence[tuple[int, int]],
    *,
    token_budget: int,
    scored: Sequence[int] = (),
) -> list[list[int]]:
    """Group generation requests, given as ``(prompt tokens, tokens to generate)``, into
    lockstep batches, longest prompts first.

    A row's tokens are its prompt, its score ids (``GenerationRequest.score_ids``, forwarded
    after the prompt) and its generation: a batch's cost is its size times the sum of the
    longest of each. That bounds both caches the batch builds (prompt + score ids for the
    scoring forward, prompt + generation for decoding); it grows while that stays within
    ``token_budget``. A request over the budget on its own still gets a batch of one.

    Args:
        shapes: ``(prompt tokens, tokens to generate)`` per request.
        token_budget: max ``batch size * (longest prompt + most score ids + most steps)``.
        scored: score ids per request, in the order of ``shapes``; empty: none anywhere.

    Returns:
        Lists of indices into ``shapes``; every index appears exactly once.

    Raises:
        ValueError: ``scored`` is neither empty nor one count per shape.
    """
    if scored and len(scored) != len(shapes):
        raise ValueError(f"{len(scored)} score counts for {len(shapes)} requests")
    extra = list(scored) if scored else [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: -shapes[i][0])
    batches: list[list[int]] = []
    current: list[int] = []
    width = steps = scores = 0
    for i in order:
        (n, k), m = shapes[i], extra[i]
        cost = (len(current) + 1) * (max(width, n) + max(scores, m) + max(steps, k))
        if current and cost <= token_budget:
            current.append(i)
            width, steps, scores = max(width, n), max(steps, k), max(scores, m)
            continue
        if current:
            batches.append(current)
        current, width, steps, scores = [i], n, k, m
    if current:
        batches.append(current)
    return batches
