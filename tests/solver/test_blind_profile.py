"""``solver.blind_profile``: attributing answers to passages, and the position-based estimate
over randomised placements with auto's trust rule."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import solver.blind_profile as blind
from solver.blind_profile import (
    attribute,
    break_tie,
    drift,
    fit_blind_profile,
    flat_test,
    normalize,
    slot_weights,
)
from solver.trust import TrustRules

PASSAGES = (
    "Google Glass shows a head-up display in front of the eye.",
    "The Eiffel Tower is in Paris, France, built by Gustave Eiffel.",
    "Paris is the capital of France; the Louvre is in Paris.",
    "Kerosene lamps burn kerosene drawn up a wick.",
)


def test_normalize_drops_case_punctuation_and_articles() -> None:
    assert normalize("The  Head-Up Display!") == "head up display"


def test_an_answer_contained_in_one_passage_is_attributed_to_it() -> None:
    got = attribute("A head-up display.", PASSAGES, question="what does google glass show")
    assert got.passages == (0,) and got.kind == "contained" and got.weight == 1.0


def test_an_answer_contained_in_several_passages_is_split_between_them() -> None:
    got = attribute("Paris", PASSAGES, question="where is the eiffel tower")
    assert got.passages == (1, 2) and got.kind == "contained"
    w = slot_weights([(3, 2, 1, 0)], [got.passages])
    assert w.tolist() == [[0.0, 0.5, 0.5, 0.0]]


def test_a_sentence_answer_is_attributed_by_its_content_words_not_the_question() -> None:
    # Not contained verbatim; its words beyond the question's are in passage 1 only.
    got = attribute(
        "The tower was built by Gustave Eiffel.", PASSAGES, question="who built the tower"
    )
    assert got.passages == (1,) and got.kind == "overlap" and got.overlap == 1.0
    # Below the threshold: no passage supports it.
    none = attribute("It was built by Gustave Klimt and Egon Schiele.", PASSAGES)
    assert none.passages == () and none.kind == "none" and none.weight == 0.0


def test_refusals_and_echoes_of_the_question_carry_no_weight() -> None:
    assert attribute("I don't know.", PASSAGES).kind == "none"
    assert attribute("", PASSAGES).kind == "none"
    assert attribute("Kerosene lamps", PASSAGES, question="how do kerosene lamps work").kind == (
        "none"
    )
    with pytest.raises(ValueError, match="threshold"):
        attribute("x", PASSAGES, threshold=0.0)


def test_slot_weights_refuse_a_passage_that_was_not_shown() -> None:
    with pytest.raises(ValueError, match="not shown"):
        slot_weights([(0, 1)], [(2,)])


def _simulate(theta: np.ndarray, questions: int, seed: int) -> np.ndarray:
    """A position-based generator: each question's useful passage (one of N) lands in a
    random slot; the answer comes from it with probability theta[slot] / max(theta), else
    from nowhere."""
    rng = np.random.default_rng(seed)
    n = theta.size
    w = np.zeros((questions, n))
    for i in range(questions):
        slot = int(rng.integers(n))
        if rng.random() < theta[slot] / theta.max():
            w[i, slot] = 1.0
    return w


def test_a_u_shaped_generator_is_recovered_and_trusted() -> None:
    theta = np.array([0.2, *[0.05] * 8, 0.4])
    fit = fit_blind_profile(_simulate(theta, 400, seed=1), seed=0)
    assert fit.verdict == "shaped", fit.reason
    assert fit.top_slots == (9, 0)
    assert abs(fit.share[9] - 0.4) < 0.08 and abs(fit.share[0] - 0.2) < 0.08
    assert all(lo <= s <= hi for lo, s, hi in zip(fit.low, fit.share, fit.high, strict=True))
    assert abs(sum(fit.coefficients) - 1.0) < 1e-9 and min(fit.coefficients) > 0
    assert fit.questions == 400 and fit.single == fit.attributed and fit.multiple == 0
    # A close second slot is not a stable placement: the same rule says "cannot tell yet".
    close = np.array([0.08, *[0.06] * 7, 0.1, 0.4])
    unsure = fit_blind_profile(_simulate(close, 400, seed=1), seed=0)
    assert unsure.verdict == "undecided" and "resampled fits place the same top 2" in unsure.reason


def test_few_answers_are_undecided_and_say_why() -> None:
    theta = np.array([0.4, 0.2, 0.2, 0.2])
    fit = fit_blind_profile(_simulate(theta, 3, seed=2))
    assert fit.verdict == "undecided" and "fewer than 5" in fit.reason
    empty = fit_blind_profile(np.zeros((7, 4)))
    assert empty.verdict == "undecided" and "no answer was attributed" in empty.reason


def test_a_flat_generator_is_shown_flat_with_enough_answers() -> None:
    theta = np.full(4, 0.25)
    fit = fit_blind_profile(_simulate(theta, 4000, seed=3), rules=TrustRules(flat_effect=0.3))
    assert fit.verdict == "flat", fit.reason


def test_the_flatness_test_holds_its_level_on_few_answers() -> None:
    # 15 answers over 10 slots from a generator with no slot preference, each supported by 1-3
    # passages (its weight split), as on the live SmolLM2 run. A Wald test on the bootstrap
    # covariance (near-zero variance in sparse slots) rejected 132 of these 200 samples at
    # alpha = 0.05, and read p = 2e-10 on the live run; the randomisation test is exact.
    rejected = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        w = np.zeros((15, 10))
        for row in w:
            k = int(rng.integers(1, 4))
            row[rng.choice(10, size=k, replace=False)] = 1.0 / k
        rejected += flat_test(w, rng) < 0.05
    assert rejected <= 20, rejected  # 10 expected; 20 is beyond 3 sd
    # The same number of answers all from two slots is far from flat.
    skewed = np.zeros((15, 10))
    skewed[:8, 9] = skewed[8:, 0] = 1.0
    assert flat_test(skewed, np.random.default_rng(0)) < 0.01


def test_a_refit_s_peak_memory_is_bounded_whatever_the_resamples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 90, item 5: the flatness test and the bootstrap copied resamples x answers x
    slots at once (999 x 400 x 50 doubles, 160 MB, here; +1.5 GB at 2,000 x 100). Chunked,
    the peak is about ``CHUNK_BYTES`` (16 MiB), and the figures of a seed are unchanged:
    one resample a chunk gives exactly what one chunk of all of them (the old code) gives."""
    theta = np.linspace(1.0, 2.0, 50)
    w = _simulate(theta / theta.sum(), 400, seed=4)
    tracemalloc.start()
    try:
        fit = fit_blind_profile(w, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"peak {peak / 2**20:.0f} MiB"  # 3 x CHUNK_BYTES
    monkeypatch.setattr(blind, "CHUNK_BYTES", 1 << 40)  # all at once, as before
    assert fit_blind_profile(w, seed=0) == fit
    monkeypatch.setattr(blind, "CHUNK_BYTES", 1)  # one resample at a time
    assert fit_blind_profile(w, seed=0) == fit


def test_bad_weight_matrices_are_refused() -> None:
    with pytest.raises(ValueError, match="sum to at most 1"):
        fit_blind_profile([[0.7, 0.7]])
    with pytest.raises(ValueError, match=">= 2 slots"):
        fit_blind_profile([[1.0]])


def test_a_tie_goes_to_the_likeliest_passage_and_exact_ties_stay_split() -> None:
    tied = attribute("Paris", PASSAGES)
    assert tied.passages == (1, 2) and tied.tied == 0
    one = break_tie(tied, [-7.5, -2.0])
    assert one.passages == (2,) and one.tied == 2 and one.kind == tied.kind
    assert break_tie(tied, [-3.0, -3.0]).passages == (1, 2)
    single = attribute("Google Glass", PASSAGES)
    assert break_tie(single, []) is single  # nothing to break
    with pytest.raises(ValueError, match="need 2 finite"):
        break_tie(tied, [-1.0])
    with pytest.raises(ValueError, match="need 2 finite"):
        break_tie(tied, [-1.0, float("nan")])


def test_the_drift_test_holds_its_level_and_catches_a_reversed_generator() -> None:
    """``drift``: the newest answers against the older ones by randomisation. From an
    unchanged generator, p-values are uniform (few below 0.05, none at the drift level); the
    same generator's slots mirrored is a drift that places other top slots; a held ``flat``
    profile drifts only when the newest answers are not flat."""
    theta = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0])
    theta /= theta.sum()
    ps = []
    for seed in range(20):
        older, newer = _simulate(theta, 600, seed=seed), _simulate(theta, 100, seed=100 + seed)
        found = drift(older, newer, held="shaped", held_top=(9, 8), seed=seed)
        assert not found.drifted, found.reason
        ps.append(found.p)
    assert sum(p < 0.05 for p in ps) <= 4 and min(ps) > 0.001, ps
    mirrored = _simulate(theta[::-1], 100, seed=7)
    found = drift(_simulate(theta, 600, seed=8), mirrored, held="shaped", held_top=(9, 8))
    assert found.drifted and found.p <= 0.001 and found.top_slots[0] == 0, found.reason
    assert "place slots" in found.reason
    flat = np.full(10, 0.1)
    still = drift(_simulate(flat, 600, seed=9), _simulate(flat, 100, seed=10), held="flat",
                  held_top=(0, 1))  # fmt: skip
    assert not still.drifted
    shaped_now = drift(_simulate(flat, 600, seed=9), _simulate(theta, 300, seed=11),
                       held="flat", held_top=(0, 1))  # fmt: skip
    assert shaped_now.drifted and "no longer flat" in shaped_now.reason
    few = drift(_simulate(theta, 600, seed=12), mirrored[:5], held="shaped", held_top=(9, 8))
    assert not few.drifted and "fewer than 8" in few.reason
