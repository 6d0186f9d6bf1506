"""Levenberg-Marquardt for the bilinear model ``s_i = b_g(i) + sum_j a_j u[pi_i(j)]``.

The bias lives on an affine subspace ``a = a0 + B beta``: ``B`` spans the directions that keep
``sum a = 1`` (and, for same-set designs, the linear gauge that fixes ``lambda``; and zero for
coefficients held at the bound ``a_j = 0``), so every step is feasible for the equality
constraints and the normal equations are small and dense (``N + L`` unknowns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.linalg as sla
from numpy.typing import NDArray

from solver.design import Design, sum_zero_basis

FloatArray = NDArray[np.float64]

_MAX_ITER = 200
_FTOL = 1e-12
_XTOL = 1e-12
_GTOL = 1e-12


@dataclass(frozen=True, eq=False)
class Problem:
    """A design with standardised scores and optional per-group intercepts."""

    design: Design
    s: FloatArray
    groups: FloatArray | None  # M x G one-hot; None: no intercept (equal-length prompts)

    @property
    def n_intercepts(self) -> int:
        return 0 if self.groups is None else int(self.groups.shape[1])


@dataclass(frozen=True, eq=False)
class Affine:
    """Feasible set for the bias: ``a = a0 + basis @ beta``."""

    a0: FloatArray
    basis: FloatArray  # L x k, orthonormal columns


@dataclass(eq=False)
class State:
    u: FloatArray
    a: FloatArray
    b: FloatArray
    cost: float  # residual sum of squares (standardised units)
    iterations: int = 0
    converged: bool = False


def affine(a0: FloatArray, constraints: FloatArray) -> Affine:
    """Affine set through ``a0`` orthogonal to each row of ``constraints``."""
    basis = sla.null_space(constraints) if constraints.size else np.eye(a0.shape[0])
    return Affine(a0, np.ascontiguousarray(basis))


def simplex(slots: int) -> Affine:
    """``sum a = 1`` through the uniform profile (the basis is cached per slot count)."""
    return Affine(np.full(slots, 1.0 / slots), sum_zero_basis(slots))


def predict(
    prob: Problem, u: FloatArray, a: FloatArray, b: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Predicted scores and the ``M x L`` matrix of utilities shown in each slot."""
    u_ext = np.empty(u.shape[0] + 1)
    u_ext[:-1] = u
    u_ext[-1] = 0.0
    shown = u_ext[prob.design.extended]
    pred = shown @ a
    if prob.groups is not None:
        pred = pred + prob.groups @ b
    return pred, shown


def jacobian(prob: Problem, a: FloatArray, shown: FloatArray, aff: Affine) -> FloatArray:
    cols = [prob.design.u_matrix(a), shown @ aff.basis]
    if prob.groups is not None:
        cols.append(prob.groups)
    return np.hstack(cols)


def x_matrix(prob: Problem, a: FloatArray) -> FloatArray:
    """The linear system of the utilities (and intercepts) for a fixed bias ``a``."""
    x = prob.design.u_matrix(a)
    return x if prob.groups is None else np.hstack([x, prob.groups])


def solve_u(prob: Problem, a: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Least-squares utilities (and intercepts) for a fixed bias.

    Normal equations with a vanishing ridge (1e-10 of the mean eigenvalue): ~10x cheaper than
    an SVD at these sizes, and close to the min-norm solution where the system is singular.
    """
    n = prob.design.n_passages
    x = x_matrix(prob, a)
    xtx = x.T @ x
    di = np.arange(xtx.shape[0])
    xtx[di, di] += 1e-10 * max(float(np.trace(xtx)) / xtx.shape[0], 1e-300)
    sol = np.asarray(np.linalg.solve(xtx, x.T @ prob.s), dtype=np.float64)
    return sol[:n], sol[n:]


def start(prob: Problem, a: FloatArray) -> State:
    u, b = solve_u(prob, a)
    pred, _ = predict(prob, u, a, b)
    r = pred - prob.s
    return State(u, a.copy(), b, float(r @ r))


def run(prob: Problem, st: State, aff: Affine, max_iter: int = _MAX_ITER) -> State:
    """Minimise the residual sum of squares from ``st`` over ``a`` in ``aff`` (updates ``st``).

    Marquardt-scaled damping with Nielsen's update; stops on relative cost change, step size
    or gradient, else after ``max_iter`` iterations (``converged`` stays False).
    """
    n = prob.design.n_passages
    k = aff.basis.shape[1]
    beta = aff.basis.T @ (st.a - aff.a0)
    a = aff.a0 + aff.basis @ beta
    pred, shown = predict(prob, st.u, a, st.b)
    r = pred - prob.s
    cost = float(r @ r)
    mu = -1.0
    nu = 2.0
    theta = np.concatenate([st.u, beta, st.b])
    scale = max(1.0, float(prob.s @ prob.s))
    converged = cost <= 1e-28 * scale
    it = 0
    while it < max_iter and not converged:
        it += 1
        jac = jacobian(prob, a, shown, aff)
        g = jac.T @ r
        if float(np.abs(g).max(initial=0.0)) <= _GTOL * scale:
            converged = True
            break
        h = jac.T @ jac
        dg = np.diagonal(h).copy()
        diag = np.maximum(dg, 1e-12 * max(1.0, float(dg.max())))
        di = np.arange(h.shape[0])
        if mu < 0:
            mu = 1e-3
        accepted = False
        while not accepted:
            lhs = h.copy()
            lhs[di, di] += mu * diag
            try:
                step = np.linalg.solve(lhs, -g)
            except np.linalg.LinAlgError:
                mu *= nu
                nu *= 2.0
                if mu > 1e16:
                    break
                continue
            cand = theta + step
            u_c = cand[:n]
            a_c = aff.a0 + aff.basis @ cand[n : n + k]
            b_c = cand[n + k :]
            pred_c, shown_c = predict(prob, u_c, a_c, b_c)
            r_c = pred_c - prob.s
            cost_c = float(r_c @ r_c)
            predicted = -(2.0 * float(g @ step) + float(step @ h @ step))
            rho = (cost - cost_c) / predicted if predicted > 0 else -1.0
            if rho > 0:
                accepted = True
                small_step = math.sqrt(float(step @ step)) <= _XTOL * (
                    math.sqrt(float(theta @ theta)) + _XTOL
                )
                small_drop = (cost - cost_c) <= _FTOL * max(cost_c, 1e-300)
                theta, a, shown, r = cand, a_c, shown_c, r_c
                cost = cost_c
                mu *= max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3)
                nu = 2.0
                if small_step or small_drop or cost <= 1e-28 * scale:
                    converged = True
            else:
                mu *= nu
                nu *= 2.0
                if mu > 1e16:
                    break
        if not accepted:
            # No descent direction left at machine precision: a stationary point.
            converged = True
            break
    st.u = theta[:n].copy()
    st.a = a.copy()
    st.b = theta[n + k :].copy()
    st.cost = cost
    st.iterations += it
    st.converged = converged
    return st


def run_nonneg(
    prob: Problem, st: State, max_iter: int = _MAX_ITER, active: NDArray[np.bool_] | None = None
) -> State:
    """``run`` on the simplex ``a >= 0, sum a = 1`` by an active set on the bounds.

    Coefficients that go negative are held at zero and the fit is repeated; a held
    coefficient is released when the Lagrangian says raising it lowers the cost. ``active``
    starts with those coefficients held (a warm start from a nearby solution's bounds: without
    it, a start on a bound first wanders through the infeasible side).
    """
    slots = st.a.shape[0]
    active = np.zeros(slots, dtype=bool) if active is None else active.copy()
    for _ in range(2 * slots + 2):
        if not np.any(active):
            st = run(prob, st, simplex(slots), max_iter)
        else:
            rows = [np.ones(slots)] + [np.eye(slots)[j] for j in np.flatnonzero(active)]
            a0 = np.where(active, 0.0, np.maximum(st.a, 0.0))
            a0 = a0 / a0.sum() if a0.sum() > 0 else np.where(active, 0.0, 1.0) / (~active).sum()
            st.a = a0
            st = run(prob, st, affine(a0, np.vstack(rows)), max_iter)
        neg = st.a < -1e-12
        if np.any(neg):
            active |= neg
            continue
        st.a = np.maximum(st.a, 0.0)
        if not np.any(active):
            return st
        # KKT: on free coefficients the gradient equals the multiplier of sum a = 1.
        pred, shown = predict(prob, st.u, st.a, st.b)
        grad = shown.T @ (pred - prob.s)
        lam = float(grad[~active].mean())
        release = active & (grad < lam - 1e-9 * max(1.0, abs(lam)))
        if not np.any(release):
            return st
        active &= ~(release & (grad == grad[release].min()))
    return st
