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
# run_batch's looser ``tol`` counts only on steps this short relative to the parameters.
_SHORT_STEP = 1e-3
# ``run`` damps Gauss-Newton's ``J^T J`` until an accepted step lowers the cost by at most this
# (relative), then the exact Hessian. Gauss-Newton converges only linearly when the residuals
# are large (real scores: r^2 around 0.8): on the 48 committed SmolLM2 fits it took 12 steps to
# within 1e-4 of its optimum and 30 more to stop, and stopped on the 1e-12 drop rule with the
# utilities still up to 2.4e-4 from it. Near the optimum the exact Hessian is positive definite
# and converges quadratically: on those fits and 24 fits of structureless scores, 1,682 steps
# instead of 3,646, every objective equal or lower (by up to 3e-11 relative), the same orders,
# confidences and warnings (tests/solver/test_fit.py). From a far start it stays Gauss-Newton
# (``run_batch``'s docstring: the exact Hessian there settled some fits in worse optima).
_EXACT_FROM = 1e-3


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

    Marquardt-scaled damping with Nielsen's update, Gauss-Newton's matrix until a step gains
    little (``_EXACT_FROM``), the exact Hessian after; stops on relative cost change, step
    size or gradient, else after ``max_iter`` iterations (``converged`` stays False).
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
    exact = False
    it = 0
    while it < max_iter and not converged:
        it += 1
        jac = jacobian(prob, a, shown, aff)
        g = jac.T @ r
        if float(np.abs(g).max(initial=0.0)) <= _GTOL * scale:
            converged = True
            break
        h = jac.T @ jac
        if exact and k:
            _add_cross(h, r, prob.design.slot_incidence, aff.basis, n)
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
                exact = exact or (cost - cost_c) <= _EXACT_FROM * max(cost_c, 1e-300)
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
        nxt = _next_active(prob, st.u, st.a, st.b, active)
        if nxt is None:
            st.a = np.maximum(st.a, 0.0)
            return st
        active = nxt
    return st


def _next_active(
    prob: Problem,
    u: FloatArray,
    a: FloatArray,
    b: FloatArray,
    active: NDArray[np.bool_],
    weights: FloatArray | None = None,
) -> NDArray[np.bool_] | None:
    """``run_nonneg``'s bound update after a round: the coefficients to hold next round, or
    ``None`` when the round's solution is the answer. Coefficients gone negative join the held
    ones; else a held one is released when the Lagrangian says raising it lowers the cost
    (``weights``: the prompts' weights, for a copy of ``run_nonneg_batch``)."""
    neg = a < -1e-12
    if np.any(neg):
        return np.asarray(active | neg, dtype=bool)
    if not np.any(active):
        return None
    # KKT: on free coefficients the gradient equals the multiplier of sum a = 1.
    pred, shown = predict(prob, u, np.maximum(a, 0.0), b)
    resid = pred - prob.s if weights is None else (pred - prob.s) * weights
    grad = shown.T @ resid
    lam = float(grad[~active].mean())
    release = active & (grad < lam - 1e-9 * max(1.0, abs(lam)))
    if not np.any(release):
        return None
    return np.asarray(active & ~(release & (grad == grad[release].min())), dtype=bool)


@dataclass(eq=False)
class Batch:
    """``P`` weighted copies of one problem (``run_batch``), a row per copy: their current
    parameters, and per copy the bias's affine set ``a = a0 + basis @ beta`` (``basis`` is
    ``P x L x k``; a copy with fewer free directions pads with zero columns)."""

    u: FloatArray  # P x N
    a: FloatArray  # P x L
    b: FloatArray  # P x G
    a0: FloatArray  # P x L
    basis: FloatArray  # P x L x k
    cost: FloatArray  # P
    iterations: NDArray[np.int64]  # P
    converged: NDArray[np.bool_]  # P


def batch(st: State, copies: int, aff: Affine) -> Batch:
    """``copies`` copies of ``st``, each on ``aff``."""
    return Batch(
        np.tile(st.u, (copies, 1)),
        np.tile(st.a, (copies, 1)),
        np.tile(st.b, (copies, 1)),
        np.tile(aff.a0, (copies, 1)),
        np.tile(aff.basis, (copies, 1, 1)),
        np.full(copies, st.cost),
        np.zeros(copies, dtype=np.int64),
        np.zeros(copies, dtype=bool),
    )


def run_batch(
    prob: Problem,
    weights: FloatArray,
    bt: Batch,
    rows: NDArray[np.int64] | None = None,
    max_iter: int = _MAX_ITER,
    tol: float = _FTOL,
) -> Batch:
    """Minimise every copy's weighted residual sum of squares from where ``bt`` stands
    (updates ``bt``; ``rows``: only these copies). Copy ``p`` weights its prompts by
    ``weights[p]`` (0 or 1: a 0 drops that prompt). ``tol`` above ``run``'s 1e-12: a copy
    also stops when an accepted step lowers its cost by at most ``tol`` relative and moves
    its parameters by at most 1e-3 relative (a long step that gains little is a refit walking
    off along a valley, which must still reach the iteration limit and be reported).

    The same Levenberg-Marquardt as ``run`` (Marquardt-scaled damping, Nielsen's update, the
    same stopping rules, per copy), with two differences. The arithmetic is stacked: the
    delete-one jackknife's ``M`` refits then cost one pass of tiny-matrix operations instead
    of ``M``. And the damped matrix is the exact Hessian of the bilinear model, ``J^T J`` plus
    the residual-weighted cross term between ``u`` and ``a``: each refit starts at the full
    fit's optimum, a point where the exact Hessian is positive definite, and converges
    quadratically. Gauss-Newton converges only linearly when the residuals are large, as on
    real scores (r^2 around 0.8), and its refits one at a time sometimes stopped at the
    iteration limit where these converge (bench/jackknife_cost.py: 8 of 150 at N = 50). A
    fit from a far start begins with Gauss-Newton (``run``, until ``_EXACT_FROM``): there the
    exact Hessian can be indefinite, and when tried from the start (2026-11-23) the same
    damping settled some of SmolLM2's default fits in worse optima than Gauss-Newton's.
    """
    d = prob.design
    n = d.n_passages
    k = bt.basis.shape[2]
    w_all = np.asarray(weights, dtype=np.float64)
    ext = d.extended
    groups = prob.groups
    idx = np.arange(bt.u.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    if idx.size == 0:
        return bt
    inc = d.slot_incidence
    a0, basis, w = bt.a0[idx], bt.basis[idx], w_all[idx]

    def evaluate(theta: FloatArray, sel: NDArray[np.int64]) -> tuple[FloatArray, ...]:
        a = a0[sel] + np.einsum("plk,pk->pl", basis[sel], theta[:, n : n + k])
        u_ext = np.zeros((theta.shape[0], n + 1))
        u_ext[:, :n] = theta[:, :n]
        shown = u_ext[:, ext]  # P x M x L
        pred = np.einsum("pml,pl->pm", shown, a)
        if groups is not None:
            pred = pred + theta[:, n + k :] @ groups.T
        r = (pred - prob.s) * w[sel]
        return a, shown, r, np.einsum("pm,pm->p", r, r)

    beta = np.einsum("plk,pl->pk", basis, bt.a[idx] - a0)
    theta = np.concatenate([bt.u[idx], beta, bt.b[idx]], axis=1)
    everyone = np.arange(idx.size)
    a, shown, r, cost = evaluate(theta, everyone)
    scale = np.maximum(1.0, (w * prob.s * prob.s).sum(axis=1))
    converged = cost <= 1e-28 * scale
    done = converged.copy()
    its = np.zeros(idx.size, dtype=np.int64)
    mu = np.full(idx.size, 1e-3)
    nu = np.full(idx.size, 2.0)
    eye = np.eye(theta.shape[1])
    while True:
        live = np.flatnonzero(~done & (its < max_iter))
        if live.size == 0:
            break
        its[live] += 1
        cols = [d.u_matrices(a[live]), shown[live] @ basis[live]]
        if groups is not None:
            cols.append(np.broadcast_to(groups, (live.size, *groups.shape)))
        jac = np.concatenate(cols, axis=2) * w[live][:, :, None]
        g = np.einsum("pmq,pm->pq", jac, r[live])
        flat = np.abs(g).max(axis=1, initial=0.0) <= _GTOL * scale[live]
        converged[live[flat]] = True
        done[live[flat]] = True
        live, jac, g = live[~flat], jac[~flat], g[~flat]
        if live.size == 0:
            continue
        h = np.matmul(jac.transpose(0, 2, 1), jac)
        if k:
            _add_cross(h, r[live], inc, basis[live], n)
        dg = np.diagonal(h, axis1=1, axis2=2)
        diag = np.maximum(dg, 1e-12 * np.maximum(1.0, dg.max(axis=1, keepdims=True)))
        pending = np.arange(live.size)
        while pending.size:
            sel = live[pending]
            lhs = h[pending] + (mu[sel][:, None] * diag[pending])[:, :, None] * eye
            step, ok = _solve_each(lhs, -g[pending])
            cand = theta[sel] + step
            a_c, shown_c, r_c, cost_c = evaluate(cand, sel)
            predicted = -(
                2.0 * np.einsum("pq,pq->p", g[pending], step)
                + np.einsum("pq,pq->p", step, np.einsum("pqr,pr->pq", h[pending], step))
            )
            with np.errstate(divide="ignore", invalid="ignore"):
                rho = np.where(predicted > 0, (cost[sel] - cost_c) / predicted, -1.0)
            acc = ok & (rho > 0)
            if np.any(acc):
                ra = sel[acc]
                step_norm = np.sqrt((step[acc] ** 2).sum(axis=1))
                theta_norm = np.sqrt((theta[ra] ** 2).sum(axis=1))
                small_step = step_norm <= _XTOL * (theta_norm + _XTOL)
                drop = cost[ra] - cost_c[acc]
                small_drop = drop <= _FTOL * np.maximum(cost_c[acc], 1e-300)
                if tol > _FTOL:
                    # A refit walking off along a valley also gains little a step: only a
                    # short step's small gain means it is at its optimum.
                    small_drop |= (drop <= tol * np.maximum(cost_c[acc], 1e-300)) & (
                        step_norm <= _SHORT_STEP * (theta_norm + _SHORT_STEP)
                    )
                theta[ra], a[ra], shown[ra], r[ra] = cand[acc], a_c[acc], shown_c[acc], r_c[acc]
                cost[ra] = cost_c[acc]
                mu[ra] *= np.maximum(1.0 / 3.0, 1.0 - (2.0 * rho[acc] - 1.0) ** 3)
                nu[ra] = 2.0
                fin = small_step | small_drop | (cost[ra] <= 1e-28 * scale[ra])
                converged[ra[fin]] = True
                done[ra[fin]] = True
            rej = sel[~acc]
            mu[rej] *= nu[rej]
            nu[rej] *= 2.0
            # No descent direction left at machine precision: a stationary point (as ``run``).
            stuck = mu[rej] > 1e16
            converged[rej[stuck]] = True
            done[rej[stuck]] = True
            pending = pending[~acc][~stuck]
    bt.u[idx] = theta[:, :n]
    bt.a[idx] = a
    bt.b[idx] = theta[:, n + k :]
    bt.cost[idx] = cost
    bt.iterations[idx] += its
    bt.converged[idx] = converged
    return bt


def _add_cross(h: FloatArray, r: FloatArray, inc: FloatArray, basis: FloatArray, n: int) -> None:
    """Add to ``h`` (``... x q x q``, ``u`` first, then the bias's ``k`` directions) the
    bilinear model's residual-weighted cross term between ``u`` and ``a``, which turns
    ``J^T J`` into the exact Hessian: ``r`` (``... x M``) the residuals, ``inc`` the design's
    ``slot_incidence``, ``basis`` (``... x L x k``) the bias's directions."""
    k = basis.shape[-1]
    cross = (r @ inc).reshape(*r.shape[:-1], n, -1) @ basis
    h[..., :n, n : n + k] += cross
    h[..., n : n + k, :n] += np.swapaxes(cross, -1, -2)


def run_nonneg_batch(
    prob: Problem,
    weights: FloatArray,
    st: State,
    held: NDArray[np.bool_],
    tol: float = _FTOL,
    max_iter: int = _MAX_ITER,
    rounds: int | None = None,
) -> Batch:
    """``run_nonneg`` from ``st`` for every weighted copy of ``prob`` (``run_batch``), each
    starting with the coefficients ``held`` at zero and keeping its own active set after.

    ``rounds``: at most this many active sets per copy (default: as ``run_nonneg``). With 1,
    every copy keeps ``held`` and minimises on that face of the simplex, its free coefficients
    unbounded: no active-set search, so no per-copy step between stacked solves."""
    slots = st.a.shape[0]
    copies = weights.shape[0]
    bt = batch(st, copies, simplex(slots))
    active = np.tile(held, (copies, 1))
    todo = np.arange(copies)
    limit = 2 * slots + 2 if rounds is None else rounds
    for round_ in range(limit):
        if todo.size == 0:
            break
        if round_ == 0:
            # Every copy starts at ``st`` with ``held``: one face for all of them.
            bt.a0[:], bt.basis[:] = _bounded_affine(st.a, held)
            bt.a[:] = bt.a0
        else:
            for c in todo:
                bt.a0[c], bt.basis[c] = _bounded_affine(bt.a[c], active[c])
                bt.a[c] = bt.a0[c]
        run_batch(prob, weights, bt, todo, max_iter, tol=tol)
        if round_ == limit - 1:
            break
        still = []
        for c in todo:
            nxt = _next_active(prob, bt.u[c], bt.a[c], bt.b[c], active[c], weights[c])
            if nxt is None:
                bt.a[c] = np.maximum(bt.a[c], 0.0)
            else:
                active[c] = nxt
                still.append(c)
        todo = np.asarray(still, dtype=np.int64)
    return bt


def _bounded_affine(a: FloatArray, active: NDArray[np.bool_]) -> tuple[FloatArray, FloatArray]:
    """``run_nonneg``'s feasible set with ``active`` held at zero, as ``a0`` and an ``L x (L-1)``
    basis (zero columns past the free directions), starting from ``a`` clipped onto it."""
    slots = a.shape[0]
    free = np.flatnonzero(~active)
    a0 = np.where(active, 0.0, np.maximum(a, 0.0))
    a0 = a0 / a0.sum() if a0.sum() > 0 else np.where(active, 0.0, 1.0) / free.size
    basis = np.zeros((slots, slots - 1))
    if free.size > 1:
        basis[free, : free.size - 1] = sum_zero_basis(free.size)
    return a0, basis


def _solve_each(lhs: FloatArray, rhs: FloatArray) -> tuple[FloatArray, NDArray[np.bool_]]:
    """Stacked ``solve``; where one system is singular, that one alone is marked failed."""
    ok = np.ones(lhs.shape[0], dtype=bool)
    try:
        return np.asarray(np.linalg.solve(lhs, rhs[:, :, None])[:, :, 0], np.float64), ok
    except np.linalg.LinAlgError:
        out = np.zeros_like(rhs)
        for i in range(lhs.shape[0]):
            try:
                out[i] = np.linalg.solve(lhs[i], rhs[i])
            except np.linalg.LinAlgError:
                ok[i] = False
        return out, ok
