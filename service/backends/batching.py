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
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].token_ids))
    batches: list[list[int]] = []
    current: list[int] = []
    width = span_rows = 0
    union: set[int] = set()
    for i in order:
        req = requests[i]
        n = len(req.token_ids)
        span = req.span_end - req.span_start
        # Only the positions mode needs the union; the others skip building the sets.
        positions = (
            set(range(req.span_start - 1, req.span_end - 1)) if head_mode == "positions" else set()
        )
        if current:
            size = len(current) + 1
            cand_width = max(width, n)
            cand_union = union | positions
            if head_mode == "mask":
                rows = span_rows + span
            elif head_mode == "positions":
                rows = size * len(cand_union)
            else:
                rows = size * cand_width
            if size * cand_width <= token_budget and rows <= row_budget:
                current.append(i)
                width, span_rows, union = cand_width, span_rows + span, cand_union
                continue
            batches.append(current)
        current, width, span_rows, union = [i], n, span, positions
    if current:
        batches.append(current)
    return batches


def plan_generation_batches(
    shapes: Sequence[tuple[int, int]], *, token_budget: int
) -> list[list[int]]:
    """Group generation requests, given as ``(prompt tokens, tokens to generate)``, into
    lockstep batches, longest prompts first.

    A batch's cost is its size times its longest prompt plus its longest generation (the KV
    cache it ends with); it grows while that stays within ``token_budget``. A request over
    the budget on its own still gets a batch of one.

    Returns:
        Lists of indices into ``shapes``; every index appears exactly once.
    """
    order = sorted(range(len(shapes)), key=lambda i: -shapes[i][0])
    batches: list[list[int]] = []
    current: list[int] = []
    width = steps = 0
    for i in order:
        n, k = shapes[i]
        if current and (len(current) + 1) * (max(width, n) + max(steps, k)) <= token_budget:
            current.append(i)
            width, steps = max(width, n), max(steps, k)
            continue
        if current:
            batches.append(current)
        current, width, steps = [i], n, k
    if current:
        batches.append(current)
    return batches
