"""Bias-profile shapes: the generic primacy prior, multistart shapes, validation, resampling."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solver.errors import InvalidReference

FloatArray = NDArray[np.float64]

# A profile whose centred part is this small cannot orient a fit (it is uniform).
_UNIFORM_TOL = 1e-9


def primacy_profile(slots: int) -> FloatArray:
    """The generic primacy prior: ``a_j`` proportional to ``1 / (j + 1)``, summing to 1.

    The MoI paper (Figure 6) reports monotonically decreasing coefficients for LLaMA-3 and Phi-3;
    only the sign of the centred profile is used to orient full-length designs, so any
    decreasing shape orients them the same way.
    """
    a = 1.0 / np.arange(1, slots + 1, dtype=np.float64)
    return np.asarray(a / a.sum(), dtype=np.float64)


def start_shapes(slots: int) -> list[FloatArray]:
    """Deterministic multistart shapes: primacy, recency, U and inverted U (each sums to 1)."""
    x = np.linspace(-1.0, 1.0, slots) if slots > 1 else np.zeros(1)
    prim = primacy_profile(slots)
    shapes = [prim, prim[::-1].copy(), 0.5 + x**2, 1.5 - x**2]
    return [s / s.sum() for s in shapes]


def validate_reference(
    reference: ArrayLike, slots: int, *, allow_uniform: bool = False
) -> FloatArray:
    """Check a reference profile and return it normalised to sum 1.

    Raises:
        InvalidReference: wrong length, non-finite, negative, zero sum, or (unless
            ``allow_uniform``) uniform, which carries no orientation.
    """
    a = np.asarray(reference, dtype=np.float64)
    if a.ndim != 1 or a.shape[0] != slots:
        raise InvalidReference(
            f"reference_bias has {a.size} coefficients; the design has {slots} prompt slots"
        )
    if not np.all(np.isfinite(a)):
        raise InvalidReference("reference_bias contains a non-finite coefficient")
    if np.any(a < 0):
        raise InvalidReference("reference_bias coefficients must be >= 0")
    total = float(a.sum())
    if total <= 0:
        raise InvalidReference("reference_bias must have a positive sum")
    a = a / total
    if not allow_uniform and slots > 1 and float(np.abs(a - 1.0 / slots).max()) < _UNIFORM_TOL:
        raise InvalidReference(
            "reference_bias is uniform: it cannot orient the fit (the same objective holds for "
            "the reversed ranking); pass a calibrated or primacy-shaped profile"
        )
    return a


def resample(profile: ArrayLike, slots: int) -> FloatArray:
    """Resample a profile to ``slots`` slots by relative position (linear), summing to 1.

    Used to place N passages with a profile fitted on L < N slots (pruned designs): slot j of
    the final prompt takes the coefficient at relative position ``j / (slots - 1)``.
    """
    a = np.asarray(profile, dtype=np.float64)
    if a.shape[0] == slots:
        return np.asarray(a / a.sum(), dtype=np.float64)
    if a.shape[0] == 1:
        return np.full(slots, 1.0 / slots)
    src = np.linspace(0.0, 1.0, a.shape[0])
    dst = np.linspace(0.0, 1.0, slots) if slots > 1 else np.zeros(1)
    out = np.interp(dst, src, a)
    return np.asarray(out / out.sum(), dtype=np.float64)
