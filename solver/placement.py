"""``place``: the final prompt order from a fit."""

from __future__ import annotations

from typing import Literal

import numpy as np

from solver.errors import SolverError
from solver.fit import Fit
from solver.profiles import resample

Placement = Literal["descending_utility", "bias_matched"]
PLACEMENTS: tuple[Placement, ...] = ("descending_utility", "bias_matched")


def place(fit: Fit, how: Placement = "descending_utility") -> list[int]:
    """Passage indices in prompt order (slot 0 first).

    ``descending_utility`` (paper 000): the fit's order. ``bias_matched``: the k-th best
    passage goes into the slot with the k-th largest bias coefficient (ties: earlier slot
    first), so a U-shaped or recency-heavy bias gets its strongest slots filled with the best
    passages. A profile fitted on L < N slots (pruned designs) is resampled to N slots by
    relative position first; never-shown passages rank last and so take the weakest slots.

    Raises:
        SolverError: unknown placement.
    """
    order = list(fit.order)
    if how == "descending_utility":
        return order
    if how != "bias_matched":
        raise SolverError(f"unknown placement {how!r}; expected one of {', '.join(PLACEMENTS)}")
    n = len(order)
    coef = resample(fit.position_bias, n)
    slots_by_strength = np.lexsort((np.arange(n), -np.round(coef, 12)))
    out = [0] * n
    for rank, slot in enumerate(slots_by_strength):
        out[int(slot)] = order[rank]
    return out
