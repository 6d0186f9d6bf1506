"""An always-valid confidence sequence for the mean of a bounded stream, by betting.

``auto``'s randomized holdout (``service.learning.outcomes``) asks: on this key, is the
placed order's mean outcome above the control's? Outcomes arrive one by one and the answer is
watched after every one of them, so a fixed-n interval read repeatedly would be wrong far more
often than its level (optional stopping). A confidence sequence ``C_t`` holds the true value
at *every* t at once with probability at least ``1 - alpha``, whenever it is read.

The stream. Each outcome ``y`` in [0, 1] comes from an arm drawn by the server with known
probabilities: placed with ``p_placed``, control with ``p_control``. Weighted by its arm's
inverse probability,

    z = y / p_placed      (placed)        z = -y / p_control     (control)    z = 0 (other)

has conditional mean ``mu_placed - mu_control`` whatever the probabilities were at that
request (each is recorded when it is served), and lies in ``[-1/p_control, 1/p_placed]``:
one bounded stream, whose bounds may change from one outcome to the next (``outcome_policy
act`` changes the shares) but are known before its outcome is.

The sequence (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by
betting", JRSS-B 2024, the hedged capital process with predictable plug-in bets, section 4):
for each candidate value ``m`` a gambler bets on ``z_t > m`` and another on ``z_t < m``,

    K+_t(m) = prod (1 + l+_i(m) (z_i - m))      K-_t(m) = prod (1 - l-_i(m) (z_i - m))

with bets ``l_i`` fixed before ``z_i`` is seen (from the earlier outcomes' variance) and
capped so no wealth can go negative (``c / (m - lo_i)``, ``c / (hi_i - m)``). At the true
mean both are nonnegative martingales; so is their mix ``theta K+ + (1 - theta) K-``, and by
Ville's inequality it passes ``1/alpha`` at any time with probability at most ``alpha``.
``C_t`` is every ``m`` whose mix is below ``1/alpha`` at ``t``: the true value leaves it
at some ``t`` with probability at most ``alpha``. Evaluated on a grid of ``m``; the bounds
returned are widened by one grid step, so the grid never narrows them.

Why not the reference package: ``confseq`` (Howard, Waudby-Smith) on PyPI is a source
distribution only (0.0.11, a C++ extension built against Boost at install time, no wheel),
which the service's image and CI could not install without a compiler toolchain; its betting
CS is this one, for a stream in [0, 1] with fixed bounds, so it would also need the
per-outcome rescaling that varying arm shares make. This is ~60 lines of numpy, checked by
its tests against the coverage it promises (``tests/solver/test_confseq.py``) and by
``bench/outcomes_null.py`` (1,000+ streams monitored after every outcome).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GRID = np.round(np.linspace(-1.0, 1.0, 401), 10)
"""Candidate differences of two means in [0, 1]: steps of 0.005."""
_STEP = float(GRID[1] - GRID[0])
_CAP = 0.5
"""Largest share of the wealth a bet may stake (WSR's c): keeps a loss from ruining it."""
_THETA = 0.5
_ROWS = 2048
"""Outcomes processed at once (memory: rows x grid doubles)."""


@dataclass(frozen=True)
class Sequence:
    """The confidence sequence after the last outcome."""

    n: int
    estimate: float
    """The weighted mean of the stream (the uplift's point estimate)."""
    lower: float
    upper: float
    """``[lower, upper]`` holds the true value, at every n at once, w.p. >= 1 - alpha."""


def ipw_stream(
    reward: np.ndarray, arm: np.ndarray, p_placed: np.ndarray, p_control: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The single bounded stream of a two-arm experiment (module docstring).

    Args:
        reward: outcomes in [0, 1].
        arm: 0 placed, 1 control, anything else an arm of neither (weight 0).
        p_placed, p_control: each outcome's arm probabilities when it was served, in (0, 1].

    Returns:
        ``(z, lo, hi)``: the weighted outcomes and each one's bounds.
    """
    reward = np.asarray(reward, dtype=np.float64)
    arm = np.asarray(arm)
    pp = np.asarray(p_placed, dtype=np.float64)
    pc = np.asarray(p_control, dtype=np.float64)
    if reward.size and (reward.min() < 0 or reward.max() > 1):
        raise ValueError("rewards must be in [0, 1]")
    if pp.size and (pp.min() <= 0 or pc.min() <= 0 or pp.max() > 1 or pc.max() > 1):
        raise ValueError("arm probabilities must be in (0, 1]")
    z = np.where(arm == 0, reward / pp, np.where(arm == 1, -reward / pc, 0.0))
    return z, -1.0 / pc, 1.0 / pp


def bets(z: np.ndarray, alpha: float, prior_var: float = 1.0) -> np.ndarray:
    """The predictable plug-in bets (WSR eq. 26): ``l_t`` from ``z_1..z_{t-1}`` only."""
    n = z.size
    t = np.arange(1, n + 1, dtype=np.float64)
    means = np.cumsum(z) / (t + 1)  # mu_t, shrunk to 0 by one pseudo-outcome
    prev_mean = np.concatenate(([0.0], means[:-1]))
    dev = (z - prev_mean) ** 2
    var = (prior_var + np.cumsum(dev)) / (t + 1)
    prev_var = np.concatenate(([prior_var], var[:-1]))
    return np.sqrt(2.0 * math.log(2.0 / alpha) / (prev_var * t * np.log1p(t)))


def excluded(
    z: np.ndarray, lo: np.ndarray, hi: np.ndarray, alpha: float
) -> np.ndarray:  # fmt: skip
    """``out[t, g]``: whether ``GRID[g]`` is outside the sequence after outcome ``t``: its
    mixed wealth is at or above ``1/alpha`` then. Shape ``(n, len(GRID))``. Not the running
    intersection (tighter, and as valid): after a change of the generator it empties for good,
    while this one follows the pooled stream back."""
    n = z.size
    lam = bets(z, alpha)
    threshold = math.log(1.0 / alpha)
    out = np.zeros((n, GRID.size), dtype=bool)
    up = np.zeros(GRID.size)
    down = np.zeros(GRID.size)
    for start in range(0, n, _ROWS):
        s = slice(start, min(n, start + _ROWS))
        m = GRID[None, :]
        zs, ls = z[s, None], lam[s, None]
        # Capped so that the worst outcome costs at most _CAP of the wealth: never ruin.
        lp = np.minimum(ls, _CAP / np.maximum(m - lo[s, None], 1e-12))
        lm = np.minimum(ls, _CAP / np.maximum(hi[s, None] - m, 1e-12))
        lp = np.where(m > lo[s, None], lp, 0.0)
        lm = np.where(m < hi[s, None], lm, 0.0)
        cup = up + np.cumsum(np.log1p(lp * (zs - m)), axis=0)
        cdown = down + np.cumsum(np.log1p(-lm * (zs - m)), axis=0)
        hedged = np.logaddexp(cup + math.log(_THETA), cdown + math.log(1.0 - _THETA))
        out[s] = hedged >= threshold
        up, down = cup[-1], cdown[-1]
    return out


def _excluded_now(z: np.ndarray, lo: np.ndarray, hi: np.ndarray, alpha: float) -> np.ndarray:
    """The last row of ``excluded`` alone: the wealths' sums, no running history (what the
    service reads after each outcome; ``excluded`` is for simulations that read every row)."""
    lam = bets(z, alpha)
    up = np.zeros(GRID.size)
    down = np.zeros(GRID.size)
    m = GRID[None, :]
    for start in range(0, z.size, _ROWS):
        s = slice(start, min(z.size, start + _ROWS))
        zs, ls, los, his = z[s, None], lam[s, None], lo[s, None], hi[s, None]
        lp = np.where(m > los, np.minimum(ls, _CAP / np.maximum(m - los, 1e-12)), 0.0)
        lm = np.where(m < his, np.minimum(ls, _CAP / np.maximum(his - m, 1e-12)), 0.0)
        d = zs - m
        up += np.log1p(lp * d).sum(axis=0)
        down += np.log1p(-lm * d).sum(axis=0)
    hedged = np.logaddexp(up + math.log(_THETA), down + math.log(1.0 - _THETA))
    out: np.ndarray = hedged >= math.log(1.0 / alpha)
    return out


def interval(row: np.ndarray) -> tuple[float, float]:
    """The bounds of one row of ``excluded``, widened by a grid step (clipped to [-1, 1]).
    An empty row (every value excluded: possible only on the event of probability <= alpha,
    or after the generator changed) gives the whole range: nothing is claimed."""
    kept = np.flatnonzero(~row)
    if kept.size == 0:
        return -1.0, 1.0
    lower = max(-1.0, float(GRID[kept[0]]) - _STEP)
    upper = min(1.0, float(GRID[kept[-1]]) + _STEP)
    return lower, upper


def confidence_sequence(
    z: np.ndarray, lo: np.ndarray, hi: np.ndarray, alpha: float
) -> Sequence:  # fmt: skip
    """The sequence after the whole stream (``n = 0``: the whole range, estimate 0)."""
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    n = int(z.size)
    if n == 0:
        return Sequence(0, 0.0, -1.0, 1.0)
    lower, upper = interval(_excluded_now(z, lo, hi, alpha))
    estimate = float(np.clip(z.mean(), -1.0, 1.0))
    return Sequence(n, estimate, lower, upper)
