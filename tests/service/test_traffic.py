"""The live-traffic sample behind calibration from traffic (``service.traffic``)."""

from __future__ import annotations

import numpy as np
import pytest

from service.traffic import TrafficSampler

PERMS = np.array([[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1]])
SCORES = np.array([-3.0, -2.5, -2.0, -2.8])


def offer(s: TrafficSampler, kind: str = "random", **kw: np.ndarray) -> str | None:
    return s.offer(
        model="m",
        template="t",
        kind=kind,
        perms=kw.get("perms", PERMS),
        scores=kw.get("scores", SCORES),
    )


def test_keeps_copies_grouped_by_design_and_slots() -> None:
    s = TrafficSampler(1.0, 10)
    perms = PERMS.copy()
    assert s.offer(model="m", template="t", kind="hybrid", perms=perms, scores=SCORES) == "random"
    perms[0, 0] = 9  # the caller's array changing later does not change the sample
    assert offer(s, "pruned_random", perms=PERMS[:, :2]) == "pruned_random"
    (run,) = s.runs("m", "t", "random", 3)
    assert run[0][0, 0] == 0 and np.array_equal(run[1], SCORES)
    assert [(c.key.design, c.key.slots, c.runs) for c in s.counts()] == [
        ("pruned_random", 2, 1),
        ("random", 3, 1),
    ]
    assert s.runs("m", "other-template", "random", 3) == []


@pytest.mark.parametrize(
    ("kind", "perms", "scores"),
    [
        ("cyclic", PERMS, SCORES),  # identifies no bias
        ("pruned_cyclic", PERMS[:, :2], SCORES),
        ("pruned_random", np.array([[0, 1], [2, -1], [1, 0], [2, 0]]), SCORES),  # ragged
        ("random", PERMS, np.array([-3.0, np.nan, -2.0, -2.8])),  # a failed prompt
        ("random", PERMS[:1], SCORES[:1]),  # one prompt
        # two prompts of 2 of 4 passages: identifies no bias on its own
        ("pruned_random", np.array([[0, 1], [2, 3]]), SCORES[:2]),
    ],
)
def test_refuses_runs_that_cannot_serve_a_calibration(
    kind: str, perms: np.ndarray, scores: np.ndarray
) -> None:
    s = TrafficSampler(1.0, 10)
    assert offer(s, kind, perms=perms, scores=scores) is None
    assert s.counts() == []


def test_rate_draws_that_share_and_zero_keeps_nothing() -> None:
    s = TrafficSampler(0.25, 10_000, seed=1)
    kept = sum(offer(s) is not None for _ in range(4000))
    assert 900 < kept < 1100  # binomial(4000, 0.25): mean 1000, sd 27
    off = TrafficSampler(0.0, 10)
    assert not off.enabled and offer(off) is None


def test_ring_keeps_the_latest_runs() -> None:
    s = TrafficSampler(1.0, 3)
    for k in range(5):
        offer(s, scores=SCORES + k)
    runs = s.runs("m", "t", "random", 3)
    assert [r[1][0] for r in runs] == [-1.0, 0.0, 1.0]  # offers 2, 3, 4


@pytest.mark.parametrize(("rate", "max_runs"), [(-0.1, 1), (1.5, 1), (0.5, 0)])
def test_bad_settings_are_refused(rate: float, max_runs: int) -> None:
    with pytest.raises(ValueError):
        TrafficSampler(rate, max_runs)
