"""The betting confidence sequence (solver.confseq): valid whenever it is read, and tight."""

from __future__ import annotations

import numpy as np
import pytest

from solver.confseq import GRID, confidence_sequence, excluded, interval, ipw_stream


def stream(
    rng: np.random.Generator, n: int, h: float, base: float, delta: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arm = (rng.random(n) < h).astype(int)
    y = np.where(arm == 0, rng.random(n) < base + delta, rng.random(n) < base).astype(float)
    return ipw_stream(y, arm, np.full(n, 1 - h), np.full(n, h))


def test_the_weighted_stream_has_the_difference_of_means_as_its_mean() -> None:
    rng = np.random.default_rng(0)
    z, lo, hi = stream(rng, 200_000, 0.1, 0.4, 0.2)
    assert z.mean() == pytest.approx(0.2, abs=0.02)
    assert (z >= lo).all() and (z <= hi).all()
    assert lo[0] == pytest.approx(-10.0) and hi[0] == pytest.approx(1 / 0.9)


def test_monitored_after_every_outcome_it_misses_the_truth_at_most_alpha_of_the_time() -> None:
    """The always-valid promise: over whole streams read after each outcome, the share of
    streams that ever exclude the true value stays at or under alpha (0.05). A fixed-n
    interval read after every outcome misses far more often (about 0.3 here)."""
    rng = np.random.default_rng(1)
    truth = int(np.argmin(np.abs(GRID - 0.0)))
    ever, naive = 0, 0
    streams, n = 200, 500
    for _ in range(streams):
        z, lo, hi = stream(rng, n, 0.2, 0.5, 0.0)
        ever += bool(excluded(z, lo, hi, 0.05)[:, truth].any())
        t = np.arange(1, n + 1)
        mean = np.cumsum(z) / t
        sd = np.sqrt(np.maximum(np.cumsum(z**2) / t - mean**2, 1e-12))
        naive += bool((np.abs(mean[20:]) > 1.96 * sd[20:] / np.sqrt(t[20:])).any())
    assert ever / streams <= 0.05
    assert naive / streams > 0.15  # what the sequence guards against


def test_it_narrows_onto_a_real_difference() -> None:
    rng = np.random.default_rng(2)
    z, lo, hi = stream(rng, 2000, 0.5, 0.4, 0.2)
    cs = confidence_sequence(z, lo, hi, 0.05)
    assert 0.0 < cs.lower < 0.2 < cs.upper < 0.4
    assert cs.n == 2000


def test_no_outcome_claims_nothing_and_bad_input_is_refused() -> None:
    empty = np.zeros(0)
    assert confidence_sequence(empty, empty, empty, 0.05).lower == -1.0
    assert interval(np.ones(GRID.size, dtype=bool)) == (-1.0, 1.0)
    with pytest.raises(ValueError, match="rewards"):
        ipw_stream(np.array([1.5]), np.array([0]), np.array([0.9]), np.array([0.1]))
    with pytest.raises(ValueError, match="probabilities"):
        ipw_stream(np.array([1.0]), np.array([0]), np.array([0.0]), np.array([0.1]))
    with pytest.raises(ValueError, match="alpha"):
        confidence_sequence(np.ones(3), -np.ones(3), np.ones(3), 1.5)
