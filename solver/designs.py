"""``plan``: seeded, reproducible permutation designs (docs/method.md and the MoI paper 3.2-3.3).

Passage ``i`` is the retriever's ``i``-th passage; index order is the reference ordering
``phi`` of the paper's cyclic designs. Prompts are distinct rows (counted, not draws).

Variable pruning (the MoI paper 3.3.1, Table 6) is defined here as follows. Retriever scores are
standardised (``z = (r - mean) / std``; uniform scores give ``z = 0``) and turned into weights
``w = softmax(z)``, so the rule is invariant to the scores' shift and scale. Each prompt keeps
the shortest prefix of its ordering whose weight reaches ``L / N`` (the share a uniform
retriever gives ``L`` passages), clamped to ``[ceil(L / 2), L]``. Uniform scores therefore
give fixed pruning at ``L``; prompts that lead with passages the retriever scores highly are
shorter, and prompts that lead with weak passages keep all ``L``.
"""

from __future__ import annotations

import functools
import math
from itertools import permutations as all_permutations
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solver.errors import DesignError

IntArray = NDArray[np.int64]
DesignKind = Literal["random", "cyclic", "pruned_random", "pruned_cyclic", "hybrid", "adaptive"]
KINDS: tuple[DesignKind, ...] = (
    "random",
    "cyclic",
    "pruned_random",
    "pruned_cyclic",
    "hybrid",
    "adaptive",
)
# Below this many possible rows, sample without replacement from the full list.
_ENUMERATE_LIMIT = 40_320  # 8!


def default_prompt_passages(n_passages: int) -> int:
    """Default ``L`` of pruned designs: ``ceil(N / 2)`` (at least 1, below N when N > 1)."""
    return max(1, min(math.ceil(n_passages / 2), n_passages - 1))


def plan(
    kind: DesignKind,
    n_passages: int,
    *,
    num_prompts: int | None = None,
    prompt_passages: int | None = None,
    seed: int = 0,
    retriever_scores: ArrayLike | None = None,
) -> IntArray:
    """Build a design: an ``M x L`` array of passage indices, ``-1`` marking an empty slot.

    Args:
        kind: ``random`` (M distinct full permutations, default 3N), ``cyclic`` (the N
            rotations of the retriever order), ``pruned_random`` (M >= 2N distinct prompts of
            L < N passages, default L = ceil(N/2), passages and slots balanced),
            ``pruned_cyclic`` (N windows of L consecutive passages of the rotated order, paper
            Eq. 5-6), ``hybrid`` (the N rotations plus random permutations, default M = 2N).
        n_passages: N >= 1.
        num_prompts: M (distinct prompts). Capped defaults; an explicit value that the kind
            cannot produce is an error.
        prompt_passages: L for pruned kinds.
        seed: random seed; the same arguments always give the same design.
        retriever_scores: N scores; with a pruned kind, switches on variable pruning (see the
            module docstring) and the prompts become ragged.

    Raises:
        DesignError: an unknown kind or arguments the kind cannot satisfy.
    """
    if retriever_scores is None:
        # A function of its arguments alone, and the same few designs serve every request
        # (N and the defaults repeat): building pruned_random's balanced rows took 11% of the
        # service's CPU at GPU speed (issue 57, results/bench/paced_profile.md). A copy, so
        # no caller can change the cached one.
        return _planned(kind, int(n_passages), num_prompts, prompt_passages, seed).copy()
    return _plan(kind, n_passages, num_prompts, prompt_passages, seed, retriever_scores)


@functools.lru_cache(maxsize=256)
def _planned(
    kind: DesignKind, n: int, num_prompts: int | None, prompt_passages: int | None, seed: int
) -> IntArray:
    return _plan(kind, n, num_prompts, prompt_passages, seed, None)


def _plan(
    kind: DesignKind,
    n_passages: int,
    num_prompts: int | None,
    prompt_passages: int | None,
    seed: int,
    retriever_scores: ArrayLike | None,
) -> IntArray:
    n = int(n_passages)
    if n < 1:
        raise DesignError(f"n_passages must be >= 1, got {n_passages}")
    if kind not in KINDS:
        raise DesignError(f"unknown design kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "adaptive":
        # Its rows depend on the scores of earlier rounds: solver.adaptive plans them.
        raise DesignError("an adaptive design is planned round by round (solver.adaptive)")
    if num_prompts is not None and num_prompts < 1:
        raise DesignError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    pruned = kind in ("pruned_random", "pruned_cyclic")
    if not pruned and prompt_passages not in (None, n):
        raise DesignError(f"prompt_passages applies to pruned designs only; {kind} shows all {n}")
    if retriever_scores is not None and not pruned:
        raise DesignError("retriever_scores (variable pruning) applies to pruned designs only")
    if kind == "random":
        m = num_prompts if num_prompts is not None else min(3 * n, math.factorial(n))
        return _random_rows(rng, n, n, m, exclude=None)
    if kind == "cyclic":
        if num_prompts not in (None, n):
            raise DesignError(f"a cyclic design has exactly N = {n} prompts, not {num_prompts}")
        return _rotations(n)
    if kind == "hybrid":
        m = num_prompts if num_prompts is not None else min(2 * n, math.factorial(n))
        if m < n:
            raise DesignError(f"a hybrid design needs num_prompts >= N = {n}, got {m}")
        cyc = _rotations(n)
        extra = _random_rows(rng, n, n, m - n, exclude=cyc) if m > n else cyc[:0]
        return np.vstack([cyc, extra])
    if n == 1:
        return np.zeros((1, 1), dtype=np.int64)
    L = default_prompt_passages(n) if prompt_passages is None else int(prompt_passages)
    if not 1 <= L < n:
        raise DesignError(f"prompt_passages must be in [1, {n - 1}] for N = {n}, got {L}")
    if kind == "pruned_cyclic":
        if num_prompts not in (None, n):
            raise DesignError(f"a pruned cyclic design has exactly N = {n} prompts")
        base = _rotations(n)
        if retriever_scores is None:
            return np.ascontiguousarray(base[:, :L])
        return _variable_prune(base, L, _weights(retriever_scores, n))
    available = math.perm(n, L)
    m = num_prompts if num_prompts is not None else min(2 * n, available)
    if retriever_scores is None:
        return _balanced_rows(rng, n, L, m)
    # Variable pruning: prune full random orderings, then keep distinct rows.
    w = _weights(retriever_scores, n)
    rows: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(50 * m + 100):
        row = _variable_prune(rng.permutation(n)[None, :], L, w)[0]
        key = tuple(int(v) for v in row)
        if key not in seen:
            seen.add(key)
            rows.append(key)
            if len(rows) == m:
                return np.asarray(rows, dtype=np.int64)
    raise DesignError(
        f"could not draw {m} distinct variably pruned prompts for N = {n}, L = {L}; "
        "ask for fewer prompts"
    )


def _rotations(n: int) -> IntArray:
    """Row k is the reference order shifted left by k (the MoI paper Eq. 9)."""
    idx = np.arange(n, dtype=np.int64)
    return (idx[None, :] + idx[:, None]) % n


def _random_rows(
    rng: np.random.Generator, n: int, length: int, m: int, exclude: IntArray | None
) -> IntArray:
    """``m`` distinct random arrangements of ``length`` of ``n`` passages, none in ``exclude``."""
    taken = set() if exclude is None else {tuple(int(v) for v in r) for r in exclude}
    available = math.perm(n, length) - len(taken)
    if m > available:
        raise DesignError(
            f"num_prompts = {m + (0 if exclude is None else len(taken))} exceeds the "
            f"{math.perm(n, length)} distinct prompts of {length} of {n} passages"
        )
    if math.perm(n, length) <= _ENUMERATE_LIMIT:
        pool = [p for p in all_permutations(range(n), length) if p not in taken]
        pick = rng.choice(len(pool), size=m, replace=False)
        return np.asarray([pool[i] for i in pick], dtype=np.int64).reshape(m, length)
    rows: list[tuple[int, ...]] = []
    while len(rows) < m:
        row = tuple(int(v) for v in rng.permutation(n)[:length])
        if row not in taken:
            taken.add(row)
            rows.append(row)
    return np.asarray(rows, dtype=np.int64).reshape(m, length)


def _balanced_rows(rng: np.random.Generator, n: int, L: int, m: int) -> IntArray:
    """Distinct pruned prompts in which every passage is shown about ``m L / N`` times and
    visits the slots evenly: each prompt takes the least-shown passages (random tie-break)
    and seats each in its least-visited free slot."""
    if m > math.perm(n, L):
        raise DesignError(
            f"num_prompts = {m} exceeds the {math.perm(n, L)} distinct prompts of {L} of {n} "
            "passages"
        )
    shown = np.zeros(n)
    visits = np.zeros((n, L))
    rows: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    attempts = 0
    while len(rows) < m:
        attempts += 1
        jitter = rng.random(n) if attempts < 20 * m else rng.random(n) * 1e6
        chosen = np.argsort(shown + jitter * 0.999, kind="stable")[:L]
        row = np.full(L, -1, dtype=np.int64)
        free = np.ones(L, dtype=bool)
        for p in rng.permutation(chosen):
            load = np.where(free, visits[p] + rng.random(L) * 0.5, np.inf)
            j = int(np.argmin(load))
            row[j] = p
            free[j] = False
        key = tuple(int(v) for v in row)
        if key in seen:
            continue
        seen.add(key)
        rows.append(key)
        shown[row] += 1
        visits[row, np.arange(L)] += 1
    return np.asarray(rows, dtype=np.int64)


def _weights(retriever_scores: ArrayLike, n: int) -> NDArray[np.float64]:
    r = np.asarray(retriever_scores, dtype=np.float64)
    if r.ndim != 1 or r.shape[0] != n or not np.all(np.isfinite(r)):
        raise DesignError(f"retriever_scores must be {n} finite numbers")
    sd = float(r.std())
    z = (r - r.mean()) / sd if sd > 0 else np.zeros(n)
    w = np.exp(z - z.max())
    return np.asarray(w / w.sum())


def _variable_prune(orders: IntArray, L: int, w: NDArray[np.float64]) -> IntArray:
    """Keep the shortest prefix whose weight reaches L/N, within [ceil(L/2), L]."""
    n = orders.shape[1]
    target = L / n
    lo = max(1, math.ceil(L / 2))
    cum = np.cumsum(w[orders[:, :L]], axis=1)
    # First prefix length whose cumulative weight reaches the target (tolerance for the
    # uniform case, where it is reached exactly at L).
    reach = np.argmax(cum >= target * (1 - 1e-12), axis=1) + 1
    reach = np.where(cum[:, -1] >= target * (1 - 1e-12), reach, L)
    keep = np.clip(reach, lo, L)
    out = np.full((orders.shape[0], L), -1, dtype=np.int64)
    for i, k in enumerate(keep):
        out[i, :k] = orders[i, :k]
    return out
