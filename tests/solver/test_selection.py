"""The distractor rule and budget packing (solver.selection): a passage is dropped only on a
gap its error resolves, the covariance of the difference is used where the fit has one, and
the packing skips what does not fit for what does."""

from __future__ import annotations

import numpy as np
import pytest

from solver.selection import distractor_verdicts, normal_cdf, pack_budget


def verdicts(u, se, cov=None, **kw):
    kw.setdefault("fraction", 1.0)
    kw.setdefault("confidence", 0.9)
    kw.setdefault("rule", "not_credibly_below")
    ranking = sorted(range(len(u)), key=lambda i: -u[i])
    return {
        v.index: v
        for v in distractor_verdicts(
            ranking, np.asarray(u, float), np.asarray(se, float), cov, **kw
        )
    }


def test_credibly_below_the_mean_is_dropped_uncertain_is_kept() -> None:
    u = [2.0, 0.0, -1.0, -1.0]  # mean 0: floor 0 with fraction 1
    v = verdicts(u, [0.1, 0.1, 0.1, 5.0])
    assert v[0].keep and v[1].keep  # the best; one on the floor
    assert not v[2].keep and v[2].probability > 0.99  # 1.0 below, error ~0.14
    assert v[3].keep  # as far below, but its error does not resolve it
    assert v[2].floor == pytest.approx(0.0)


def test_fraction_moves_the_floor_towards_the_best() -> None:
    u = [2.0, 1.5, 0.5, -4.0]  # mean 0; fraction 0.5: floor 1.0
    v = verdicts(u, [0.05] * 4, fraction=0.5)
    assert [v[i].keep for i in range(4)] == [True, True, False, False]


def test_credibly_above_keeps_only_resolved_passages() -> None:
    u = [2.0, 1.0, 0.9, -3.9]
    v = verdicts(u, [0.1, 0.1, 2.0, 0.1], rule="credibly_above")
    # floor = mean = 0: 1.0 is above by 10 errors; 0.9 with error 2 is not resolved.
    assert [v[i].keep for i in range(4)] == [True, True, False, False]


def test_covariance_of_the_difference_is_used() -> None:
    u = [1.0, -0.5, -0.5]
    se = [0.5, 0.5, 0.5]
    # Utilities that move together (correlation 0.99) resolve a gap their errors alone do not.
    cov = np.full((3, 3), 0.99 * 0.25)
    np.fill_diagonal(cov, 0.25)
    floor = 0.0  # mean 0, fraction 1
    alone = verdicts(u, se)
    together = verdicts(u, se, cov)
    assert alone[1].keep and not together[1].keep
    sd = np.sqrt(0.25 + 0.25 - 2 * 0.99 * 0.25)
    assert together[1].probability == pytest.approx(normal_cdf((floor + 0.5) / sd))


def test_non_finite_is_kept() -> None:
    v = verdicts([1.0, -5.0, 0.0], [0.1, float("nan"), 0.1])
    assert v[1].keep


def test_pack_budget_skips_what_does_not_fit() -> None:
    assert pack_budget([3, 1, 2, 0], [5, 9, 3, 2], 10) == [3, 2, 0]
    assert pack_budget([0], [11], 10) == []
