from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import kendalltau

from solver import SolverError, UnidentifiableDesign, calibrate, fit, place, plan, primacy_profile
from tests.solver.conftest import bias_shape, synthesize


def _runs(kind: str, n: int, shape: str, noise: float, count: int) -> tuple[list, np.ndarray]:
    rng = np.random.default_rng(77)
    runs = []
    a = None
    for r in range(count):
        perms = plan(kind, n, seed=r)  # type: ignore[arg-type]
        a = bias_shape(shape, perms.shape[1])
        runs.append((perms, synthesize(perms, rng.standard_normal(n), a, noise, rng)))
    assert a is not None
    return runs, a


@pytest.mark.parametrize("shape", ["primacy", "U"])
def test_calibration_from_pruned_runs_recovers_the_shape(shape: str) -> None:
    runs, a = _runs("pruned_random", 20, shape, 0.1, 20)
    prof = calibrate(runs)
    assert prof.identification == "full" and prof.runs == 20 and prof.slots == 10
    assert np.abs(prof.coefficients - a).max() < 0.03


def test_calibration_from_random_runs_then_cyclic_serving() -> None:
    runs, a = _runs("random", 20, "primacy", 0.1, 20)
    prof = calibrate(runs)
    assert prof.identification == "up_to_scale"
    # The scale is not identified in full-length runs: compare shapes (centred, normalised).
    c = prof.coefficients - prof.coefficients.mean()
    t = a - a.mean()
    assert float(c @ t / np.linalg.norm(c) / np.linalg.norm(t)) > 0.99
    rng = np.random.default_rng(1)
    perms = plan("cyclic", 20)
    u = rng.standard_normal(20)
    served = fit(perms, synthesize(perms, u, a, 0.01, rng), reference_bias=prof.coefficients)
    assert kendalltau(served.utilities, u)[0] > 0.9


def test_calibration_refuses_cyclic_runs() -> None:
    rng = np.random.default_rng(0)
    runs = [(plan("cyclic", 8), rng.normal(size=8))]
    with pytest.raises(UnidentifiableDesign, match="cyclic"):
        calibrate(runs)


def test_calibration_needs_one_slot_count() -> None:
    a, _ = _runs("pruned_random", 10, "primacy", 0.1, 1)
    b, _ = _runs("pruned_random", 12, "primacy", 0.1, 1)
    with pytest.raises(SolverError, match="slot counts"):
        calibrate(a + b)
    with pytest.raises(SolverError, match="at least one"):
        calibrate([])


def test_descending_utility_placement_is_the_order() -> None:
    rng = np.random.default_rng(3)
    perms = plan("pruned_random", 8, seed=3)
    f = fit(perms, synthesize(perms, rng.standard_normal(8), bias_shape("primacy", 4), 0.0, rng))
    assert place(f) == list(f.order) == place(f, "descending_utility")


def test_bias_matched_placement_fills_strong_slots_first() -> None:
    rng = np.random.default_rng(4)
    n = 6
    perms = plan("random", n, seed=4)
    recency = bias_shape("recency", n)
    f = fit(
        perms, synthesize(perms, rng.standard_normal(n), recency, 0.0, rng), reference_bias=recency
    )
    placed = place(f, "bias_matched")
    # Recency: the best passage goes last, the second best next to last, ...
    assert placed == list(f.order)[::-1]
    u_shape = np.array([0.3, 0.1, 0.05, 0.05, 0.2, 0.3])
    f2 = fit(
        perms,
        synthesize(perms, rng.standard_normal(n), u_shape / u_shape.sum(), 0.0, rng),
        reference_bias=primacy_profile(n),
    )
    placed2 = place(f2, "bias_matched")
    assert sorted(placed2) == list(range(n))
    coef = f2.position_bias
    # Utility decreases along slots sorted by decreasing coefficient.
    by_slot = [f2.utilities[placed2[j]] for j in np.argsort(-coef, kind="stable")]
    assert all(x >= y for x, y in itertools.pairwise(by_slot))


def test_bias_matched_resamples_a_pruned_profile() -> None:
    rng = np.random.default_rng(5)
    perms = plan("pruned_random", 10, seed=5)  # L = 5 slots fitted, 10 passages placed
    f = fit(perms, synthesize(perms, rng.standard_normal(10), bias_shape("primacy", 5), 0.0, rng))
    assert place(f, "bias_matched") == list(f.order)  # decreasing profile: same as descending
    with pytest.raises(SolverError, match="unknown placement"):
        place(f, "sideways")  # type: ignore[arg-type]


def test_place_ranking_by_hand() -> None:
    """Any ranking (best first) placed three ways, each worked out by hand."""
    from solver import place_ranking

    ranking = [3, 0, 4, 1, 2]  # passage 3 best, 2 worst
    assert place_ranking(ranking, "descending_utility") == ranking
    # litm: ranks 0, 2, 4 fill the front left to right, ranks 1, 3 the back right to left.
    assert place_ranking(ranking, "litm") == [3, 4, 2, 1, 0]
    assert place_ranking([7, 8], "litm") == [7, 8] and place_ranking([5], "litm") == [5]
    # A U-shaped bias: slots by strength 4 (.35), 0 (.30), 3 (.15), 1 (.12), 2 (.08).
    bias = [0.30, 0.12, 0.08, 0.15, 0.35]
    # Rank 0 (passage 3) -> slot 4, rank 1 (0) -> slot 0, rank 2 (4) -> slot 3,
    # rank 3 (1) -> slot 1, rank 4 (2) -> slot 2.
    assert place_ranking(ranking, "bias_matched", bias) == [0, 1, 2, 4, 3]
    # A 3-slot recency profile resampled to 5 slots by relative position:
    # [.2, .3, .5] -> [.2, .25, .3, .4, .5] (before renormalising): strength 4, 3, 2, 1, 0.
    assert place_ranking(ranking, "bias_matched", [0.2, 0.3, 0.5]) == [2, 1, 4, 0, 3]
    # Ties go to the earlier slot: a flat bias keeps the ranking.
    assert place_ranking(ranking, "bias_matched", [0.2] * 5) == ranking
    with pytest.raises(SolverError, match="needs a position-bias profile"):
        place_ranking(ranking, "bias_matched")
    with pytest.raises(SolverError, match="unknown placement"):
        place_ranking(ranking, "middle")  # type: ignore[arg-type]


def test_place_ranking_reuses_a_profiles_slot_order() -> None:
    """The slot order of a profile at a passage count is computed once: ``auto``'s profile
    path places every request by the same profile. Rankings, and profiles passed as a list or
    an array, are placed as computed afresh."""
    from solver import place_ranking, resample
    from solver.placement import _slots_by_strength

    bias = np.array([0.11, 0.17, 0.19, 0.23, 0.3])  # a 5-slot profile placing 10 passages
    coef = resample(bias, 10)
    strongest = sorted(range(10), key=lambda s: (-coef[s], s))
    rng = np.random.default_rng(3)
    before = _slots_by_strength.cache_info()
    for _ in range(20):
        ranking = [int(i) for i in rng.permutation(10)]
        placed = place_ranking(ranking, "bias_matched", bias)
        assert [placed[slot] for slot in strongest] == ranking
        assert place_ranking(ranking, "bias_matched", bias.tolist()) == placed
    after = _slots_by_strength.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 39
