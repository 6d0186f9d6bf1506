"""Validated permutation designs and their identifiability.

A design is an ``M x L`` integer array: row ``i`` lists the passages of prompt ``i`` slot by
slot, ``-1`` marks an empty slot (only at the end of a row: ragged prompts from variable
pruning). The model is ``s_i = b + sum_j a_j u[pi_i(j)]`` with ``sum_j a_j = 1``; the intercept
``b`` only exists for ragged designs (with equal-length prompts it is the mean of ``u``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solver.errors import DesignError

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
Identification = Literal["full", "up_to_scale", "none"]

# Fixed seed for the generic point of the rank test: the test must be deterministic.
_RANK_SEED = 20240611


@dataclass(frozen=True, eq=False)
class Design:
    """A validated design over ``n_passages`` passages (see the module docstring)."""

    perms: IntArray
    n_passages: int

    @property
    def prompts(self) -> int:
        return int(self.perms.shape[0])

    @property
    def slots(self) -> int:
        return int(self.perms.shape[1])

    @cached_property
    def lengths(self) -> IntArray:
        return np.asarray((self.perms >= 0).sum(axis=1), dtype=np.int64)

    @cached_property
    def ragged(self) -> bool:
        return bool(np.any(self.lengths != self.slots))

    @cached_property
    def shown(self) -> BoolArray:
        shown = np.zeros(self.n_passages, dtype=bool)
        shown[self.perms[self.perms >= 0]] = True
        return shown

    @cached_property
    def same_set(self) -> bool:
        """Every prompt shows the same passages: the fit is then symmetric under
        ``(a~, u~) -> (lambda a~, u~ / lambda)``, reversal included (docs/method.md)."""
        if self.ragged:
            return False
        srt = np.sort(self.perms, axis=1)
        return bool(np.all(srt == srt[0]))

    @cached_property
    def distinct_prompts(self) -> int:
        return len({row.tobytes() for row in self.perms})

    def subset(self, rows: BoolArray) -> Design:
        """The design restricted to ``rows`` (columns trimmed to the new longest prompt)."""
        perms = self.perms[rows]
        width = int((perms >= 0).sum(axis=1).max()) if perms.shape[0] else 0
        return Design(np.ascontiguousarray(perms[:, :width]), self.n_passages)

    def compact(self) -> tuple[Design, IntArray]:
        """Renumber shown passages ``0..n_shown-1``; returns the design and the old indices."""
        old = np.flatnonzero(self.shown).astype(np.int64)
        remap = np.full(self.n_passages + 1, -1, dtype=np.int64)
        remap[old] = np.arange(old.shape[0])
        return Design(remap[self.perms], int(old.shape[0])), old

    @cached_property
    def extended(self) -> IntArray:
        """``perms`` with empty slots pointing at an extra index ``n`` that holds zero."""
        return np.where(self.perms >= 0, self.perms, self.n_passages)

    @cached_property
    def _flat(self) -> IntArray:
        # Flat positions (i, pi_i(j)) in an M x (N + 1) matrix, slot-major within each row.
        rows = np.arange(self.prompts, dtype=np.int64)[:, None] * (self.n_passages + 1)
        return np.ascontiguousarray((rows + self.extended).ravel())

    @cached_property
    def slot_incidence(self) -> FloatArray:
        """``M x (N * L)``: 1 at ``(i, q * L + j)`` where prompt ``i`` shows passage ``q`` in
        slot ``j`` (the layout of the bilinear model's cross second derivatives)."""
        n, slots = self.n_passages, self.slots
        inc = np.zeros((self.prompts, (n + 1) * slots))
        ri, rj = np.indices(self.extended.shape)
        inc[ri.ravel(), (self.extended * slots + rj).ravel()] = 1.0
        return np.ascontiguousarray(inc[:, : n * slots])

    @cached_property
    def _slot_of_flat(self) -> IntArray:
        return np.tile(np.arange(self.slots, dtype=np.int64), self.prompts)

    def u_matrix(self, a: FloatArray) -> FloatArray:
        """``X(a)`` (M x N): entry (i, p) is the coefficient of the slot showing p in prompt i,
        0 where prompt i does not show p. Also ``d prediction / d u``."""
        return np.asarray(self.u_matrices(a[None, :])[0], dtype=np.float64)

    def u_matrices(self, a: FloatArray) -> FloatArray:
        """``u_matrix`` for each row of ``a`` (``P x L``): ``P x M x N``."""
        m, n = self.prompts, self.n_passages
        ju = np.zeros((a.shape[0], m * (n + 1)))
        ju[:, self._flat] = a[:, self._slot_of_flat]
        return ju.reshape(a.shape[0], m, n + 1)[:, :, :n]


def as_design(permutations: ArrayLike, n_passages: int | None = None) -> Design:
    """Validate a permutation array.

    Args:
        permutations: ``M x L`` integers, ``-1`` for trailing empty slots.
        n_passages: total passages (default: largest index + 1).

    Raises:
        DesignError: not a non-empty 2-D integer array, index out of range, ``-1`` before a
            filled slot, an empty prompt, or a passage repeated within one prompt.
    """
    arr = np.asarray(permutations)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise DesignError(
            f"permutations must be a non-empty 2-D array (prompts x slots), got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise DesignError(f"permutations must hold integers, got dtype {arr.dtype}")
    perms = np.ascontiguousarray(arr, dtype=np.int64)
    top = int(perms.max())
    n = top + 1 if n_passages is None else int(n_passages)
    if n < 1:
        raise DesignError("a design needs at least one passage")
    bad = (perms < -1) | (perms >= n)
    if np.any(bad):
        i, j = np.argwhere(bad)[0]
        raise DesignError(
            f"permutations[{i}][{j}] = {perms[i, j]} is not a passage index in [0, {n - 1}] "
            "(-1 marks an empty slot)"
        )
    filled = perms >= 0
    if not np.all(filled[:, 0]):
        i = int(np.flatnonzero(~filled[:, 0])[0])
        raise DesignError(f"prompt {i} shows no passage")
    gap = filled[:, 1:] & ~filled[:, :-1]
    if np.any(gap):
        i = int(np.argwhere(gap)[0][0])
        raise DesignError(f"prompt {i} has an empty slot (-1) before a filled one")
    srt = np.sort(perms, axis=1)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if np.any(dup):
        i, j = np.argwhere(dup)[0]
        raise DesignError(f"prompt {i} shows passage {srt[i, j + 1]} more than once")
    return Design(perms, n)


@dataclass(frozen=True)
class Identifiability:
    """What a design can identify, from the rank of the model's Jacobian at a generic point.

    ``level``: ``full`` (bias and utilities, orientation from the data), ``up_to_scale``
    (same-set designs such as random full-length permutations: the bias shape up to
    ``lambda``, orientation only from a reference profile), ``none`` (e.g. cyclic: any bias
    fits, so a calibrated profile is required).
    """

    level: Identification
    rank: int
    parameters: int
    prompts: int
    distinct_prompts: int
    shown_passages: int
    slots: int
    reason: str


@lru_cache(maxsize=256)
def sum_zero_basis(slots: int) -> FloatArray:
    """Orthonormal basis (``slots x slots-1``) of vectors summing to zero (cached, read-only)."""
    q, _ = np.linalg.qr(np.eye(slots) - 1.0 / slots)
    basis = np.ascontiguousarray(q[:, : slots - 1])
    basis.setflags(write=False)
    return basis


def identifiability(design: Design) -> Identifiability:
    """Rank test of the bilinear model on the shown passages.

    The model is polynomial in its parameters, so the Jacobian's rank at a random point is
    its generic rank; a fixed seed keeps the verdict deterministic. Verdicts are cached per
    design: designs are seeded, so a service sees the same few again and again.
    """
    key = (design.perms.shape, design.n_passages, design.perms.tobytes())
    return _identifiability_cached(key, design)


_CACHE: dict[tuple[tuple[int, ...], int, bytes], Identifiability] = {}
_CACHE_SIZE = 1024


def _identifiability_cached(
    key: tuple[tuple[int, ...], int, bytes], design: Design
) -> Identifiability:
    hit = _CACHE.get(key)
    if hit is None:
        hit = _rank_test(design)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))  # oldest first: dicts keep insertion order
        _CACHE[key] = hit
    return hit


def _rank_test(design: Design) -> Identifiability:
    comp, _ = design.compact()
    m, n, slots = comp.prompts, comp.n_passages, comp.slots
    params = n + (slots - 1) + (1 if comp.ragged else 0)
    rng = np.random.default_rng(_RANK_SEED)
    a = rng.uniform(0.5, 1.5, slots)
    a /= a.sum()
    u_ext = np.append(rng.standard_normal(n), 0.0)
    cols = [comp.u_matrix(a)]
    if slots > 1:
        cols.append(u_ext[comp.extended] @ sum_zero_basis(slots))
    if comp.ragged:
        cols.append(np.ones((m, 1)))
    jac = np.hstack(cols)
    sv = np.linalg.svd(jac, compute_uv=False)
    tol = sv[0] * max(jac.shape) * 1e-10 if sv.size else 0.0
    rank = int((sv > tol).sum())
    distinct = comp.distinct_prompts
    if rank >= params:
        level: Identification = "full"
        reason = "the design identifies the bias and the utilities, orientation included"
    elif rank == params - 1 and comp.same_set:
        level = "up_to_scale"
        reason = (
            "every prompt shows the same passages: the bias shape is identified up to scale "
            "and sign, so a reference profile orients it"
        )
    else:
        level = "none"
        reason = (
            f"the design has rank {rank} for {params} parameters ({distinct} distinct prompts): "
            "it cannot separate position bias from utility (cyclic designs never can)"
        )
    return Identifiability(level, rank, params, m, distinct, n, slots, reason)
