"""The answer-calibrated profile's fit on hand-made answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from solver.answer_profile import cochran_q, fit_answer_profile, smooth


def test_cochran_q_on_a_hand_computed_example() -> None:
    # Column sums 4, 2, 1; row sums 2, 1, 3, 1; total 7; k = 3:
    # Q = 2 (3 (16 + 4 + 1) - 49) / (3 * 7 - (4 + 1 + 9 + 1)) = 28 / 6.
    x = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    q, p = cochran_q(x)
    assert q == pytest.approx(28 / 6)
    assert p == pytest.approx(math.exp(-q / 2))  # chi-square with 2 df


def test_a_primacy_generator_is_told_from_flat_and_placed_first() -> None:
    # 40 questions: always right with the gold passage first, half the time elsewhere.
    x = np.zeros((40, 5))
    x[:, 0] = 1
    x[::2, 1:] = 1
    fit = fit_answer_profile(x, resamples=500)
    assert fit.accuracy == pytest.approx((1.0, 0.5, 0.5, 0.5, 0.5))
    assert fit.distinguishable and fit.p_flat < 1e-6
    assert int(np.argmax(fit.coefficients)) == 0 and sum(fit.coefficients) == pytest.approx(1.0)
    for a, lo, hi in zip(fit.accuracy, fit.low, fit.high, strict=True):
        assert lo <= a <= hi
    assert fit.high[0] == fit.low[0] == 1.0 and fit.low[1] < 0.5 < fit.high[1]


def test_questions_answered_alike_everywhere_say_nothing() -> None:
    x = np.zeros((30, 4))
    x[:17] = 1  # right at every slot, or wrong at every slot
    fit = fit_answer_profile(x, resamples=200)
    assert (fit.cochran_q, fit.p_flat) == (0.0, 1.0) and not fit.distinguishable
    assert fit.coefficients == pytest.approx((0.25,) * 4)


def test_the_smoothed_curve_keeps_a_u_shape_and_floors_a_dead_slot() -> None:
    s = smooth([0.8, 0.4, 0.3, 0.4, 0.8])
    assert int(np.argmin(s)) == 2 and s[0] > s[1] and s[4] > s[3]
    x = np.zeros((10, 3))
    x[:, 2] = 1  # only the last slot is ever answered
    fit = fit_answer_profile(x, resamples=100)
    assert min(fit.coefficients) > 0 and int(np.argmax(fit.coefficients)) == 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [([[1, 0, 1]][0], "matrix"), ([[1]], ">= 2 slots"), ([[1, 0.5]], "scored 0 or 1")],
)
def test_bad_input_is_refused(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_answer_profile(bad)  # type: ignore[arg-type]
