"""A generator's position profile from its answers: per-slot accuracy with the gold passage
moved through every slot among the same distractors (the lost-in-the-middle measurement),
for generators that give no prompt log-probabilities.

Input: a questions x slots matrix of 0/1 (the answer held a gold string), every question
measured at every slot, so slots are compared within questions. Output:

- per-slot accuracy with a 95% percentile bootstrap interval over questions;
- Cochran's Q test of "every slot has the same accuracy" (the repeated-measures test for
  matched binary data; chi-square with slots - 1 degrees of freedom): a curve that cannot be
  told from flat must not drive a placement;
- a smoothed curve (least squares, a quadratic in the slot's position: a fall, a rise or a U,
  the shapes position bias takes) and the placement weights, the smoothed accuracy normalised
  to sum 1: ``bias_matched`` puts the best passage where the generator answers best.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

FloatArray = NDArray[np.float64]
_FLOOR = 1e-3
"""Smallest placement weight: a slot where the generator never answered still ranks."""


@dataclass(frozen=True)
class AnswerProfileFit:
    slots: int
    questions: int
    accuracy: tuple[float, ...]
    """Per slot, the share of questions answered correctly with the gold passage there."""
    low: tuple[float, ...]
    high: tuple[float, ...]
    """95% percentile bootstrap interval of each slot's accuracy, questions resampled."""
    smoothed: tuple[float, ...]
    coefficients: tuple[float, ...]
    """The placement weights: ``smoothed`` floored at 0.001 and normalised to sum 1."""
    cochran_q: float
    p_flat: float
    """Cochran's Q test's p-value for "all slots answer alike"."""
    r2: float
    """How much of the per-slot accuracy's spread the smoothed curve explains."""
    alpha: float

    @property
    def distinguishable(self) -> bool:
        """The curve differs from flat at level ``alpha``."""
        return self.p_flat < self.alpha


def cochran_q(correct: ArrayLike) -> tuple[float, float]:
    """Cochran's Q statistic and its chi-square p-value for a questions x slots 0/1 matrix.

    Questions answered alike at every slot carry no information and cancel out; with none
    left the statistic is 0 and p is 1.
    """
    x = np.asarray(correct, dtype=np.float64)
    k = x.shape[1]
    cols = x.sum(axis=0)
    rows = x.sum(axis=1)
    total = rows.sum()
    denom = k * total - np.sum(rows**2)
    if k < 2 or denom <= 0:
        return 0.0, 1.0
    q = (k - 1) * (k * np.sum(cols**2) - total**2) / denom
    return float(q), float(stats.chi2.sf(q, k - 1))


def smooth(accuracy: ArrayLike) -> FloatArray:
    """Least-squares quadratic in the slot's position, clipped to [0, 1] (2 slots: as
    measured)."""
    y = np.asarray(accuracy, dtype=np.float64)
    n = y.size
    if n < 3:
        return y.copy()
    t = np.linspace(0.0, 1.0, n)
    coef = np.polyfit(t, y, deg=2)
    out: FloatArray = np.clip(np.polyval(coef, t), 0.0, 1.0)
    return out


def fit_answer_profile(
    correct: ArrayLike, *, resamples: int = 2000, seed: int = 0, alpha: float = 0.05
) -> AnswerProfileFit:
    """The profile of a questions x slots 0/1 matrix (module docstring).

    Raises:
        ValueError: fewer than 2 slots or 1 question, or values other than 0 and 1.
    """
    x = np.asarray(correct, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 2:
        raise ValueError(f"need a questions x slots matrix with >= 2 slots, got {x.shape}")
    if not np.isin(x, (0.0, 1.0)).all():
        raise ValueError("answers must be scored 0 or 1")
    n_q, n_s = x.shape
    accuracy = x.mean(axis=0)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n_q, size=(resamples, n_q))
    boot = x[picks].mean(axis=1)  # resamples x slots
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    smoothed = smooth(accuracy)
    weights = np.maximum(smoothed, _FLOOR)
    coefficients = weights / weights.sum()
    spread = float(np.sum((accuracy - accuracy.mean()) ** 2))
    r2 = 1.0 - float(np.sum((accuracy - smoothed) ** 2)) / spread if spread > 0 else 1.0
    q, p = cochran_q(x)
    return AnswerProfileFit(
        slots=n_s,
        questions=n_q,
        accuracy=tuple(float(a) for a in accuracy),
        low=tuple(float(v) for v in low),
        high=tuple(float(v) for v in high),
        smoothed=tuple(float(v) for v in smoothed),
        coefficients=tuple(float(c) for c in coefficients),
        cochran_q=q,
        p_flat=p,
        r2=r2,
        alpha=alpha,
    )
