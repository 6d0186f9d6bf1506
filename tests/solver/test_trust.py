"""``solver.trust``: the pooled fit, the trust verdicts and the drift test, on known truth."""

from __future__ import annotations

import numpy as np
import pytest

import solver
from solver import trust
from tests.solver.conftest import bias_shape, synthesize

N = 10


def runs_of(
    bias: np.ndarray, k: int, rng: np.random.Generator, *, noise: float = 0.1, seeds: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` pruned-random runs of N passages (``seeds`` distinct designs), one shared bias."""
    out = []
    for r in range(k):
        perms = solver.plan("pruned_random", N, seed=r % seeds)
        u = rng.normal(size=N) * 2.0
        out.append((perms, synthesize(perms, u, bias, noise, rng)))
    return out


def test_pooled_fit_matches_calibrate_and_recovers_the_truth(rng: np.random.Generator) -> None:
    truth = bias_shape("recency", 5)
    runs = runs_of(truth, 12, rng, seeds=3)
    fast = trust.pooled_fit(runs)
    slow = solver.calibrate(runs).coefficients
    # The same objective: variable projection finds calibrate's optimum.
    np.testing.assert_allclose(fast, slow, atol=2e-3)
    np.testing.assert_allclose(fast, truth, atol=0.03)
    assert fast.sum() == pytest.approx(1.0)


def test_pooled_fit_over_designs_of_several_shapes_matches_calibrate(
    rng: np.random.Generator,
) -> None:
    # Designs of 9 and of 10 passages (their X(a) differ in shape) pooled in one fit: the
    # objective is evaluated per shape on stacked designs, and must still be calibrate's.
    truth = bias_shape("recency", 5)
    runs = []
    for r in range(12):
        n = 9 + r % 2
        perms = solver.plan("pruned_random", n, prompt_passages=5, seed=r % 4)
        runs.append((perms, synthesize(perms, rng.normal(size=n) * 2.0, truth, 0.1, rng)))
    assert len({p.shape for p, _ in runs}) == 2
    fast = trust.pooled_fit(runs)
    np.testing.assert_allclose(fast, solver.calibrate(runs).coefficients, atol=2e-3)
    np.testing.assert_allclose(fast, truth, atol=0.03)


def test_a_clear_profile_is_shaped_with_its_strongest_slots(rng: np.random.Generator) -> None:
    t = trust.assess(runs_of(bias_shape("recency", 5), 8, rng), placement_slots=N)
    assert t.verdict == "shaped" and t.trusted
    assert t.flat_p < 0.05 and t.stability >= 0.9
    assert t.top_slots == (9, 8)  # a rising profile puts the best passages last
    assert t.spread_upper >= t.spread > 0.5
    assert t.covariance.shape == (5, 5)


def test_a_flat_profile_needs_enough_runs_to_exclude_the_effect(
    rng: np.random.Generator,
) -> None:
    flat = np.full(5, 0.2)
    few = trust.assess(runs_of(flat, 8, rng, noise=1.0), placement_slots=N)
    assert few.verdict == "undecided"  # not distinguishable, nor shown flat yet
    assert few.spread_upper > 0.1
    many = trust.assess(runs_of(flat, 150, rng, noise=0.05), placement_slots=N)
    assert many.verdict == "flat" and many.trusted
    assert many.flat_p >= 0.05 and many.spread_upper < 0.1


def test_fewer_runs_than_the_minimum_are_undecided(rng: np.random.Generator) -> None:
    runs = runs_of(bias_shape("recency", 5), 4, rng)
    t = trust.assess(runs, placement_slots=N)
    assert t.verdict == "undecided" and "fewer than 5" in t.reason
    assert trust.assess(runs, placement_slots=N, rules=trust.TrustRules(min_runs=3)).trusted


def test_unstable_placement_is_not_trusted(rng: np.random.Generator) -> None:
    # Two strong last slots of almost equal weight: clearly not flat, but which of them is
    # strongest flips between resamples, so the placement is not stable.
    a = np.array([0.1, 0.1, 0.1, 0.35, 0.35])
    t = trust.assess(runs_of(a, 8, rng, noise=0.3), placement_slots=N)
    assert t.flat_p < 0.05
    assert t.stability < 0.9 and t.verdict == "undecided"
    assert "place the same top" in t.reason


def test_assessment_is_deterministic(rng: np.random.Generator) -> None:
    runs = runs_of(bias_shape("U", 5), 6, rng)
    a = trust.assess(runs, placement_slots=N, seed=3)
    b = trust.assess(runs, placement_slots=N, seed=3)
    assert a.verdict == b.verdict and a.stability == b.stability
    np.testing.assert_array_equal(a.covariance, b.covariance)


def test_failed_ragged_and_constant_runs_are_left_out(rng: np.random.Generator) -> None:
    runs = runs_of(bias_shape("recency", 5), 6, rng)
    bad_scores = runs[0][1].copy()
    bad_scores[3] = np.nan
    ragged = runs[1][0].copy()
    ragged[0, -1] = -1
    extra = [
        (runs[0][0], bad_scores),
        (ragged, runs[1][1]),
        (runs[2][0], np.zeros_like(runs[2][1])),
    ]
    assert trust.assess(runs + extra, placement_slots=N).runs == 6


def test_designs_that_cannot_orient_the_bias_are_refused(rng: np.random.Generator) -> None:
    perms = solver.plan("random", N, seed=0)
    s = synthesize(perms, rng.normal(size=N), bias_shape("recency", N), 0.1, rng)
    with pytest.raises(solver.UnidentifiableDesign):
        trust.assess([(perms, s)] * 6, placement_slots=N)
    with pytest.raises(solver.SolverError):
        trust.pooled_fit([])


def test_drift_needs_a_disagreement_that_changes_the_placement(
    rng: np.random.Generator,
) -> None:
    old = trust.assess(runs_of(bias_shape("recency", 5), 10, rng), placement_slots=N)
    same = runs_of(bias_shape("recency", 5), 10, rng)
    flipped = runs_of(bias_shape("primacy", 5), 10, rng)
    few = flipped[:4]

    def check(newer: list[tuple[np.ndarray, np.ndarray]]) -> trust.Drift:
        return trust.drift(old.coefficients, old.covariance, old.verdict, newer, placement_slots=N)

    assert not check(same).drifted
    moved = check(flipped)
    assert moved.drifted and moved.p < 0.001 and moved.top_slots == (0, 1)
    assert not check(few).drifted and "fewer than 8" in check(few).reason


def test_a_flat_profile_drifts_when_newer_runs_are_shaped(rng: np.random.Generator) -> None:
    flat = trust.assess(runs_of(np.full(5, 0.2), 150, rng, noise=0.05), placement_slots=N)
    assert flat.verdict == "flat"
    shaped = runs_of(bias_shape("recency", 5), 10, rng)
    d = trust.drift(flat.coefficients, flat.covariance, "flat", shaped, placement_slots=N)
    assert d.drifted and "no longer flat" in d.reason


def _peaked_runs(count: int, noise: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Runs of a profile peaked at the fourth of five slots: placing 10 passages, its two
    strongest slots are clear (7, then 6); placing 9, the second is a tie of slots 5 and 7
    (both halfway to the peak), settled only by noise."""
    bias = np.array([1.0, 1.0, 1.0, 46.0, 1.0]) / 50.0
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        perms = solver.plan("pruned_random", 10, seed=0)
        out.append((perms, synthesize(perms, rng.normal(size=10) * 2, bias, noise, rng)))
    return out


def test_stability_is_checked_for_every_passage_count_placed() -> None:
    runs = _peaked_runs(10, 0.5)
    even = trust.assess(runs, placement_slots=10)
    assert even.verdict == "shaped" and even.top_slots == (7, 6)
    both = trust.assess(runs, placement_slots=10, also_slots=(9,))
    assert both.verdict == "undecided" and both.stability < 0.9
    assert "of 9 passages" in both.reason
    assert both.top_slots == (7, 6) and both.placement_slots == 10


def test_a_trusted_profile_holds_while_its_refit_keeps_its_top_slots_and_shape() -> None:
    rules = trust.TrustRules()  # trusting needs 90% stability, keeping 80%
    shaped = {"flat_p": 0.001, "stability": 0.85, "top": (9, 0), "rules": rules}
    ok, why = trust.holds("shaped", (9, 0), **shaped)
    assert ok and why.startswith("kept:") and "85%" in why
    for change, words in [
        ({"stability": 0.79}, "under the 80%"),
        ({"top": (0, 9)}, "top slots (0, 9) are not the profile's (9, 0)"),
        ({"flat_p": 0.2}, "no longer told from flat"),
    ]:
        ok, why = trust.holds("shaped", (9, 0), **{**shaped, **change})
        assert not ok and words in why, (change, why)
    # A flat profile holds while no slot preference shows, whatever its top slots.
    assert trust.holds("flat", (3,), flat_p=0.4, stability=0.1, top=(7,), rules=rules)[0]
    assert not trust.holds("flat", (3,), flat_p=0.01, stability=1.0, top=(3,), rules=rules)[0]
    assert not trust.holds("undecided", (3,), flat_p=0.001, stability=1.0, top=(3,), rules=rules)[0]


def test_the_stacked_designs_take_memory_by_prompt_cell_not_by_passage_and_slot() -> None:
    """200 pooled runs of 100 passages (``auto_max_runs``' default at ``max_passages``'): the
    stacked designs build every ``X(a)`` exactly, within tens of MB. A one-hot map of
    (design, prompt, passage) x slot took 1.7 GB here before (found in review)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    runs, prompts, n, slots = 200, 200, 100, 50
    every = rng.permuted(np.tile(np.arange(n), (runs * prompts, 1)), axis=1)
    designs = list(every[:, :slots].reshape(runs, prompts, slots))
    tracemalloc.start()
    try:
        stack = trust._Stack(designs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB to stack the designs"
    a = rng.random(slots)
    x = stack.matrices(a)
    w = np.zeros((runs, prompts, n))
    want = np.zeros(slots)
    for b in (0, 117, 199):
        xb = np.zeros((prompts, n))
        for i in range(prompts):
            xb[i, designs[b][i]] = a
        assert np.array_equal(x[b], xb)
        w[b] = rng.random((prompts, n))
        want += w[b][np.arange(prompts)[:, None], designs[b]].sum(axis=0)
    assert np.allclose(stack.slot_sums(w), want, rtol=1e-12, atol=1e-9)
