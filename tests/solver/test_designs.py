from __future__ import annotations

import math

import numpy as np
import pytest

import solver
from solver import DesignError, plan


def _distinct(p: np.ndarray) -> int:
    return len({r.tobytes() for r in p})


@pytest.mark.parametrize("n", [2, 3, 5, 20, 50])
def test_random_design_is_distinct_full_permutations(n: int) -> None:
    p = plan("random", n, seed=3)
    assert p.shape == (min(3 * n, math.factorial(n)), n)
    assert _distinct(p) == p.shape[0]
    assert np.all(np.sort(p, axis=1) == np.arange(n))


def test_designs_are_seeded_and_reproducible() -> None:
    for kind in solver.KINDS:
        if kind == "adaptive":  # planned round by round (tests/solver/test_adaptive.py)
            continue
        a = plan(kind, 12, seed=7)
        assert np.array_equal(a, plan(kind, 12, seed=7))
    assert not np.array_equal(plan("random", 12, seed=1), plan("random", 12, seed=2))
    assert not np.array_equal(plan("pruned_random", 12, seed=1), plan("pruned_random", 12, seed=2))


def test_cyclic_is_the_rotations_of_the_retriever_order() -> None:
    p = plan("cyclic", 5)
    assert p.tolist()[2] == [2, 3, 4, 0, 1]  # paper 000 Eq. 10
    assert p.shape == (5, 5)
    with pytest.raises(DesignError, match="exactly N = 5"):
        plan("cyclic", 5, num_prompts=7)


def test_pruned_cyclic_windows_follow_paper_eq_5_6() -> None:
    p = plan("pruned_cyclic", 6, prompt_passages=3)
    assert p.tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 0], [5, 0, 1]]


def test_pruned_random_defaults_and_balance() -> None:
    n = 20
    p = plan("pruned_random", n, seed=0)
    assert p.shape == (2 * n, math.ceil(n / 2))
    assert _distinct(p) == p.shape[0]
    counts = np.bincount(p.ravel(), minlength=n)
    assert counts.min() >= counts.max() - 1  # each passage shown M L / N times, +-1
    # each passage visits several slots rather than sitting in one
    slots_seen = [len(set(np.argwhere(p == i)[:, 1])) for i in range(n)]
    assert min(slots_seen) >= 3


def test_hybrid_is_cyclic_plus_distinct_random() -> None:
    p = plan("hybrid", 8, seed=1)
    assert p.shape == (16, 8)
    assert np.array_equal(p[:8], plan("cyclic", 8))
    assert _distinct(p) == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "random", "n_passages": 3, "num_prompts": 7}, "exceeds the 6 distinct"),
        ({"kind": "pruned_random", "n_passages": 5, "prompt_passages": 5}, r"\[1, 4\]"),
        ({"kind": "random", "n_passages": 5, "prompt_passages": 3}, "pruned designs only"),
        ({"kind": "random", "n_passages": 0}, "n_passages must be >= 1"),
        ({"kind": "zigzag", "n_passages": 5}, "unknown design kind"),
        ({"kind": "hybrid", "n_passages": 5, "num_prompts": 3}, "num_prompts >= N"),
        (
            {"kind": "random", "n_passages": 5, "retriever_scores": [1, 2, 3, 4, 5]},
            "pruned designs only",
        ),
    ],
)
def test_plan_rejects_what_it_cannot_build(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(DesignError, match=match):
        plan(**kwargs)  # type: ignore[arg-type]


def test_small_n_edge_cases() -> None:
    assert plan("random", 1).tolist() == [[0]]
    assert plan("pruned_random", 1).tolist() == [[0]]
    p = plan("pruned_random", 2)
    assert p.shape == (2, 1) and sorted(p.ravel().tolist()) == [0, 1]


class TestVariablePruning:
    n, L = 12, 6

    def test_uniform_scores_reduce_to_fixed_pruning(self) -> None:
        p = plan("pruned_random", self.n, prompt_passages=self.L, retriever_scores=[3.0] * self.n)
        assert np.all(p >= 0) and p.shape[1] == self.L
        q = plan("pruned_cyclic", self.n, prompt_passages=self.L, retriever_scores=[1.0] * self.n)
        assert np.array_equal(q, plan("pruned_cyclic", self.n, prompt_passages=self.L))

    def test_lengths_are_clamped_and_slots_trail(self) -> None:
        scores = np.linspace(10, 0, self.n) ** 2
        p = plan("pruned_random", self.n, prompt_passages=self.L, retriever_scores=scores, seed=2)
        lengths = (p >= 0).sum(axis=1)
        assert lengths.min() >= math.ceil(self.L / 2) and lengths.max() <= self.L
        assert len(set(lengths.tolist())) > 1  # ragged
        for row, k in zip(p, lengths, strict=True):
            assert np.all(row[k:] == -1) and np.all(row[:k] >= 0)

    def test_strong_leading_passages_give_shorter_prompts(self) -> None:
        scores = np.zeros(self.n)
        scores[0] = 10.0  # the retriever is sure about passage 0
        p = plan("pruned_cyclic", self.n, prompt_passages=self.L, retriever_scores=scores)
        lengths = (p >= 0).sum(axis=1)
        assert lengths[0] == math.ceil(self.L / 2)  # the prompt that leads with passage 0
        assert lengths[1] == self.L  # passage 0 not in the window

    def test_invariant_to_shift_and_scale_of_scores(self) -> None:
        s = np.random.default_rng(0).normal(size=self.n)
        a = plan("pruned_random", self.n, prompt_passages=self.L, retriever_scores=s, seed=4)
        b = plan(
            "pruned_random", self.n, prompt_passages=self.L, retriever_scores=3 * s + 7, seed=4
        )
        assert np.array_equal(a, b)
