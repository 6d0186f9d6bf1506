"""``place`` and ``place_ranking``: the final prompt order from a fit or from any ranking."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import numpy as np

from solver.errors import SolverError
from solver.fit import Fit
from solver.profiles import resample

Placement = Literal["descending_utility", "bias_matched", "litm"]
PLACEMENTS: tuple[Placement, ...] = ("descending_utility", "bias_matched", "litm")


def place(fit: Fit, how: Placement = "descending_utility") -> list[int]:
    """Passage indices in prompt order (slot 0 first), from a fit's order and its own bias.

    See ``place_ranking``; ``bias_matched`` uses the fit's ``position_bias``.

    Raises:
        SolverError: unknown placement.
    """
    return place_ranking(fit.order, how, fit.position_bias)


def place_ranking(
    ranking: Sequence[int],
    how: Placement,
    bias: Sequence[float] | np.ndarray | None = None,
) -> list[int]:
    """Passage indices in prompt order (slot 0 first) for a ranking (best first).

    ``descending_utility`` (the MoI paper): the ranking itself. ``litm`` (lost in the middle): rank
    ``k`` goes to the front half when ``k`` is even, to the back half when odd, the back
    filled right to left: ``[r0, r2, r4, ..., r5, r3, r1]``. ``bias_matched``: the k-th best
    passage goes into the slot with the k-th largest bias coefficient (ties: earlier slot
    first), so a U-shaped or recency-heavy bias gets its strongest slots filled with the best
    passages. A profile of L != N slots (pruned designs, a generator calibrated at another
    length) is resampled to N slots by relative position first.

    Raises:
        SolverError: unknown placement, or ``bias_matched`` without a usable bias.
    """
    order = [int(i) for i in ranking]
    if how == "descending_utility":
        return order
    if how == "litm":
        return order[0::2] + order[1::2][::-1]
    if how != "bias_matched":
        raise SolverError(f"unknown placement {how!r}; expected one of {', '.join(PLACEMENTS)}")
    if bias is None or len(bias) == 0:
        raise SolverError("bias_matched placement needs a position-bias profile")
    n = len(order)
    out = [0] * n
    for rank, slot in enumerate(
        _slots_by_strength(tuple(np.asarray(bias, dtype=float).tolist()), n)
    ):
        out[slot] = order[rank]
    return out


@lru_cache(maxsize=256)
def _slots_by_strength(bias: tuple[float, ...], n: int) -> tuple[int, ...]:
    """The ``n`` slots strongest first under ``bias`` resampled to ``n`` (ties: earlier slot
    first). Cached: ``auto``'s profile path places every request by the same few profiles, and
    the resampling and sort were most of its placement's time (70 us of numpy a 10-passage
    request against a few us for a lookup; bench/cpu_stages.py --workload auto_scores)."""
    coef = resample(np.asarray(bias, dtype=np.float64), n)
    return tuple(int(s) for s in np.lexsort((np.arange(n), -np.round(coef, 12))))
