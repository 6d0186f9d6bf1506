"""Paired statistics of the evaluation: bootstrap intervals, Wilcoxon tests, per-slot bands.

Every comparison is paired by question (docs/method.md): the unit of resampling is the question,
and a strategy is only compared on the questions where both it and the baseline have a value.

Rules the papers leave loose, decided here:

- Bootstrap intervals are percentile intervals of the resampled mean (10,000 resamples by
  default), with a fixed seed so reruns print the same interval.
- The Wilcoxon signed-rank test is two-sided, discards zero differences (``zero_method =
  "wilcox"``, Wilcoxon's original rule) and lets scipy choose the exact or the normal
  distribution. When every difference is zero (or there is none) the two orders are
  indistinguishable on those questions and the p-value is reported as 1.0, not as an error.
- ``paired_test`` is the test a verdict rests on, and names itself: when every non-zero
  difference has one size (a binary metric: accuracy, exact match) the exact sign test
  (McNemar's exact test: wins against losses, binomial at 1/2), since the signed-rank test on
  all-tied ranks falls back to a normal approximation that is far off for few discordant
  questions (4 wins, 0 losses: 0.046 against the exact 0.125); else Wilcoxon, exact up to 50
  non-zero differences without tied sizes, its normal approximation beyond, and said so.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy_stats

DEFAULT_RESAMPLES = 10_000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with a two-sided confidence interval."""

    mean: float
    low: float
    high: float


@dataclass(frozen=True)
class PairedComparison:
    """``variant - baseline`` on one metric, over the questions where both have a value."""

    metric: str
    variant: str
    baseline: str
    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    p_value: float
    wins: int  # questions where the variant is higher
    losses: int  # questions where it is lower


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> Interval:
    """Mean of ``values`` and its percentile bootstrap interval (resampling the values).

    For paired differences pass ``variant - baseline`` per question: this is the paired
    bootstrap.

    Args:
        values: one value per question; NaN is not allowed.
        resamples: bootstrap resamples.
        level: coverage of the interval, in (0, 1).
        seed: seed of the resampling.

    Returns:
        The mean and the interval; all NaN for an empty input.

    Raises:
        ValueError: NaN in ``values``, or a bad ``level`` / ``resamples``.
    """
    x = np.asarray(values, dtype=np.float64)
    _check(x, level, resamples)
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - level) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Interval(float(x.mean()), float(low), float(high))


def bootstrap_mean_band(
    rows: np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column mean of ``rows`` (questions x slots) and a pointwise bootstrap band.

    Whole rows (questions) are resampled, so the band keeps the correlation between slots of
    one question.

    Returns:
        ``(mean, low, high)``, each one value per column.

    Raises:
        ValueError: ``rows`` is not 2-D or holds NaN.
    """
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError("rows must be a questions x slots matrix")
    _check(x, level, resamples)
    if x.shape[0] == 0:
        nan = np.full(x.shape[1], math.nan)
        return nan, nan.copy(), nan.copy()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(resamples, x.shape[0]))
    means = x[idx].mean(axis=1)  # resamples x slots
    alpha = (1.0 - level) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha], axis=0)
    return x.mean(axis=0), low, high


def mean_stderr(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n)); the error is NaN below two values."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def wilcoxon_p(diffs: Sequence[float] | np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired differences (module rules).

    Returns:
        The p-value; 1.0 when there is no non-zero difference.
    """
    x = np.asarray(diffs, dtype=np.float64)
    if x.size == 0 or not np.any(x != 0):
        return 1.0
    with warnings.catch_warnings():
        # scipy warns that the normal approximation is rough for few pairs; the p-value is
        # still what it is, and the report prints n beside it.
        warnings.simplefilter("ignore")
        res = _scipy_stats.wilcoxon(x, zero_method="wilcox", alternative="two-sided")
    p = float(res.pvalue)
    return p if math.isfinite(p) else 1.0


SIGN_TEST = "exact sign test (McNemar)"
WILCOXON_EXACT = "Wilcoxon signed-rank, exact"
WILCOXON_NORMAL = "Wilcoxon signed-rank, normal approximation"
_EXACT_WILCOXON_MAX = 50


def paired_test(diffs: Sequence[float] | np.ndarray) -> tuple[float, str]:
    """Two-sided p-value of paired differences and the test that gave it (module rules).

    Returns:
        ``(p, test)``: ``test`` is ``SIGN_TEST``, ``WILCOXON_EXACT`` or ``WILCOXON_NORMAL``;
        p is 1.0 (sign test) when no difference is non-zero.
    """
    x = np.asarray(diffs, dtype=np.float64)
    nonzero = x[x != 0]
    sizes = np.unique(np.abs(nonzero))
    if sizes.size <= 1:
        wins = int(np.sum(nonzero > 0))
        if nonzero.size == 0:
            return 1.0, SIGN_TEST
        return float(_scipy_stats.binomtest(wins, int(nonzero.size)).pvalue), SIGN_TEST
    exact = nonzero.size <= _EXACT_WILCOXON_MAX and sizes.size == nonzero.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the approximation is named in the result
        res = _scipy_stats.wilcoxon(
            nonzero, zero_method="wilcox", method="exact" if exact else "approx"
        )
    p = float(res.pvalue)
    return (p if math.isfinite(p) else 1.0), WILCOXON_EXACT if exact else WILCOXON_NORMAL


def paired_comparison(
    metric: str,
    variant: str,
    baseline: str,
    pairs: Sequence[tuple[float, float]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> PairedComparison:
    """Compare ``(variant value, baseline value)`` pairs, one per question.

    Returns:
        Mean difference with its paired bootstrap interval and the Wilcoxon p-value.
    """
    d = np.asarray([a - b for a, b in pairs], dtype=np.float64)
    ci = bootstrap_mean_ci(d, resamples=resamples, level=level, seed=seed)
    return PairedComparison(
        metric=metric,
        variant=variant,
        baseline=baseline,
        n=int(d.size),
        mean_diff=ci.mean,
        ci_low=ci.low,
        ci_high=ci.high,
        p_value=wilcoxon_p(d),
        wins=int(np.sum(d > 0)),
        losses=int(np.sum(d < 0)),
    )


def _check(x: np.ndarray, level: float, resamples: int) -> None:
    if np.isnan(x).any():
        raise ValueError("values must not contain NaN")
    if not 0.0 < level < 1.0:
        raise ValueError("level must be in (0, 1)")
    if resamples < 1:
        raise ValueError("resamples must be >= 1")
