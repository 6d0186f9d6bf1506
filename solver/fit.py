"""``fit``: utilities and position bias from permutation scores (the MoI paper, section 3.1).

Model: ``s_i ~ b + sum_j a_j u[pi_i(j)]``, ``sum_j a_j = 1``, ``a >= 0``, least squares. How the
design is solved depends on what it identifies (``solver.design.identifiability``):

- ``full`` (pruned random designs): joint Levenberg-Marquardt with a deterministic multistart
  and ``a >= 0`` by an active set; the orientation comes from the data.
- ``up_to_scale`` (every prompt shows the same passages, e.g. random full-length designs): the
  same fit with the scale gauge fixed linearly along the reference profile, so the direction
  of the order comes from the reference (default: the generic primacy profile), never from a
  solver's starting point.
- ``none`` (cyclic, too few prompts): refused unless a calibrated ``reference_bias`` is given,
  which is then taken as the bias and the utilities are deconvolved from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import stdtr

from solver import lm
from solver.design import Design, Identifiability, Identification, as_design, identifiability
from solver.errors import DesignError, UnidentifiableDesign
from solver.profiles import primacy_profile, start_shapes, validate_reference

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
Orientation = Literal["data", "reference", "default_reference", "none"]
Method = Literal["joint", "fixed_bias", "trivial"]
Variance = Literal["jackknife", "delta"]

# Multistart: every start (the reference and the generic shapes) gets the exact utilities for
# its bias (its variable-projection cost) and the cheapest is finished; only if that one hits
# the iteration cap are the others finished too, and the lowest-cost converged fit wins. On
# SmolLM2's scores (results/bench/confidence_real_scores.json, 48 default fits) one cheapest
# start diverged (a -> uniform, |u| -> 1e5, where the design's incidence matrix has rank
# N - 1) while the other starts converged. Finishing every start always would cost 4-9x the
# solver time: it found a lower cost in 9 of the 48 fits, with another order, yet those orders
# agreed no better with an independent fit of five times the prompts (0.572 of adjacent pairs
# either way; top pair 38 against 40 of 48), and in the 8 converged ones it put the gold
# passage on top 3 times against the cheapest start's 6: the least-squares optimum of a
# misspecified model is not the better order, so it is not paid for.
# Iteration cap of the mirrored refit that measures data-driven orientation strength.
_FLIP_ITERS = 12
# Wiener/ridge regularisation of fixed-bias solves, relative to the mean eigenvalue.
_RIDGE = 1e-4
# Below this |cos(a~_fit, a~_ref)| the reference barely orients a same-set fit.
_WEAK_ORIENTATION = 0.3


@dataclass(frozen=True, eq=False)
class Fit:
    """Everything the fit knows. Arrays are indexed by passage (``utilities``) or slot.

    ``utilities`` are in score units (nats of query log-likelihood per unit of slot weight),
    centred on the mean shown passage; ``NaN`` for a passage no prompt showed.
    ``confidence[k]`` is the probability (Student's t on the ``variance`` estimate) that
    ``order[k]`` truly has a higher utility than ``order[k + 1]`` (``None`` when the design
    leaves no residual degrees of freedom, e.g. cyclic; ``NaN`` for pairs involving a
    never-shown passage).
    """

    order: tuple[int, ...]
    utilities: FloatArray
    position_bias: FloatArray
    bias_identified: bool
    identification: Identification
    orientation: Orientation
    orientation_strength: float | None
    confidence: FloatArray | None
    r2: float | None
    converged: bool
    iterations: int
    warnings: tuple[str, ...]
    objective: float
    shown: BoolArray
    prompts_used: int
    prompts_dropped: int
    residual_dof: int
    utility_stderr: FloatArray | None
    prior_sensitivity: float | None
    method: Method
    utility_cov: FloatArray | None = None
    """The utilities' covariance behind ``confidence`` (score units, ``N x N``, NaN rows for
    never-shown passages); ``None`` where ``confidence`` is."""


def fit(
    permutations: ArrayLike,
    scores: ArrayLike,
    *,
    reference_bias: ArrayLike | None = None,
    retriever_scores: ArrayLike | None = None,
    n_passages: int | None = None,
    uncertainty: bool = True,
    variance: Variance = "delta",
    fixed_bias: ArrayLike | None = None,
) -> Fit:
    """Fit utilities and position bias, and order the passages by debiased utility.

    Args:
        permutations: ``M x L`` passage indices per prompt slot, ``-1`` for trailing empty
            slots (see ``solver.plan``).
        scores: ``M`` listwise scores, higher is better (sum of query-token log-probs).
            A non-finite score drops its prompt with a warning.
        reference_bias: ``L`` coefficients. Orients same-set designs; is the bias itself for
            designs that cannot identify it (cyclic), where it must be calibrated.
        retriever_scores: ``N`` retriever scores: tie-break and the order of never-shown
            passages (then index).
        n_passages: total passages ``N`` (default: from ``retriever_scores`` or the indices).
        uncertainty: compute confidences, standard errors, orientation strength and prior
            sensitivity (the costlier diagnostics).
        variance: how the utilities' covariance behind ``utility_stderr`` and ``confidence``
            is estimated. ``delta`` (default, cheap): ``sigma^2 (J^T J)^-1``, calibrated when
            the additive model is exact, overconfident on real scores; ``jackknife``:
            delete-one-prompt (at most 20 groups) refits warm-started from the fit
            (``_jackknife_cov``; the service's default, ``Settings.confidence_method``),
            1.9-3.6x the solver time (bench/confidence_real.py).
        fixed_bias: ``L`` coefficients taken as the bias (a calibrated profile), whatever the
            design identifies: the fit is then linear in the utilities and needs only ``N``
            independent prompts (the adaptive design, ``solver.adaptive``).

    Returns:
        A ``Fit``.

    Raises:
        DesignError: malformed permutations, scores or retriever scores.
        UnidentifiableDesign: the design (after dropping failed prompts) cannot identify the
            bias and no reference profile was given, or no prompt is left.
        InvalidReference: unusable reference profile.
    """
    retr = _retriever(retriever_scores)
    if n_passages is None and retr is not None:
        n_passages = retr.shape[0]
    design = as_design(permutations, n_passages)
    n = design.n_passages
    if retr is not None and retr.shape[0] != n:
        raise DesignError(f"retriever_scores has {retr.shape[0]} entries for {n} passages")
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.shape[0] != design.prompts:
        raise DesignError(f"scores has shape {s.shape}; expected ({design.prompts},)")
    warnings: list[str] = []
    keep = np.isfinite(s)
    dropped = int((~keep).sum())
    if dropped:
        warnings.append(f"{dropped} prompt(s) had a non-finite score and were dropped")
        if not keep.any():
            raise UnidentifiableDesign("no prompt has a finite score")
        design = design.subset(keep)
        s = s[keep]
    ref = None if reference_bias is None else np.asarray(reference_bias, dtype=np.float64)
    if n == 1:
        return _trivial(design, s, ref, retr, warnings, dropped)
    std = float(s.std())
    if std <= 1e-12 * max(1.0, float(np.abs(s).max())):
        warnings.append("all scores are equal: the order is the retriever's")
        return _trivial(design, s, ref, retr, warnings, dropped)
    comp, old = design.compact()
    if not design.shown.all():
        warnings.append(
            f"{int((~design.shown).sum())} passage(s) were never shown and are placed last"
        )
    # An exact cyclic design identifies nothing about the bias (docs/method.md): skip the
    # rank test, which costs more than the deconvolution itself.
    ident = _CYCLIC if _cyclic_base(comp) is not None else identifiability(comp)
    z = (s - s.mean()) / std
    slots = comp.slots
    if ref is not None:
        ref = validate_reference(ref, slots)
    groups = np.ones((comp.prompts, 1)) if comp.ragged else None
    prob = lm.Problem(comp, z, groups)
    if fixed_bias is not None:
        core = _fixed_bias(prob, validate_reference(fixed_bias, slots), uncertainty, variance)
        orientation: Orientation = "reference"
    elif ident.level == "none":
        if ref is None:
            raise UnidentifiableDesign(
                f"{ident.reason}; pass a calibrated reference_bias for {slots} slots, or use a "
                "random or pruned_random design"
            )
        core = _fixed_bias(prob, ref, uncertainty, variance)
        orientation = "reference"
    else:
        if ident.level == "full":
            orientation = "data"
        else:
            orientation = "reference" if ref is not None else "default_reference"
        core = _joint(
            prob, ident, ref if ref is not None else primacy_profile(slots), uncertainty, variance
        )
    warnings.extend(core.warnings)
    # Back to score units: u (standardised) * std; centred on the mean shown passage.
    u_shown = core.u * std
    u_shown = u_shown - u_shown.mean()
    utilities = np.full(n, np.nan)
    utilities[old] = u_shown
    order = _order(utilities, retr)
    confidence = stderr = cov_full = None
    if core.cov_u is not None:
        stderr = np.full(n, np.nan)
        stderr[old] = np.sqrt(np.maximum(np.diag(core.cov_u), 0.0)) * std
        confidence = _adjacent_confidence(order, utilities, old, core.cov_u * std * std, core.dof)
        cov_full = np.full((n, n), np.nan)
        cov_full[np.ix_(old, old)] = core.cov_u * std * std
    return Fit(
        order=order,
        utilities=utilities,
        position_bias=core.a,
        bias_identified=ident.level != "none" and fixed_bias is None,
        identification=ident.level,
        orientation=orientation,
        orientation_strength=core.orientation_strength,
        confidence=confidence,
        r2=1.0 - core.cost / comp.prompts,
        converged=core.converged,
        iterations=core.iterations,
        warnings=tuple(warnings),
        objective=core.cost * std * std,
        shown=design.shown.copy(),
        prompts_used=comp.prompts,
        prompts_dropped=dropped,
        residual_dof=core.dof,
        utility_stderr=stderr,
        prior_sensitivity=core.prior_sensitivity,
        method=core.method,
        utility_cov=cov_full,
    )


_CYCLIC = Identifiability(
    "none",
    0,
    0,
    0,
    0,
    0,
    0,
    "a cyclic design fits every bias profile exactly, so it cannot identify the bias",
)


@dataclass(eq=False)
class _Core:
    u: FloatArray  # standardised units, compact passages
    a: FloatArray
    cost: float  # standardised units
    converged: bool
    iterations: int
    dof: int
    cov_u: FloatArray | None
    orientation_strength: float | None
    prior_sensitivity: float | None
    warnings: list[str]
    method: Method


def _joint(
    prob: lm.Problem,
    ident: Identifiability,
    ref: FloatArray,
    uncertainty: bool,
    variance: Variance,
) -> _Core:
    slots = prob.design.slots
    warnings: list[str] = []
    gauge = ident.level == "up_to_scale"
    ref_c = ref - 1.0 / slots
    if gauge:
        # Fix lambda linearly: the component of a~ along a~_ref is held at |a~_ref| > 0, so
        # the reversed (lambda < 0) solution is outside the parameter space.
        norm = float(np.linalg.norm(ref_c))
        unit = ref_c / norm
        aff = lm.affine(1.0 / slots + norm * unit, np.vstack([np.ones(slots), unit]))
    else:
        aff = lm.simplex(slots)
    starts = _starts(ref, aff) if slots > 1 else [np.ones(1)]
    states = sorted((lm.start(prob, a) for a in starts), key=lambda st: st.cost)
    best = _finish(prob, states[0], aff, gauge)
    iterations = best.iterations
    if not best.converged:
        # Walking down a valley to infinity, or crawling: any converged fit is preferred.
        others = [_finish(prob, st, aff, gauge) for st in states[1:]]
        iterations += sum(st.iterations for st in others)
        best = min([best, *others], key=lambda st: (not st.converged, st.cost))
    u, a = best.u, best.a
    strength: float | None = None
    if gauge:
        a, u, lam = _report_scale(u, a, ref_c)
        cos = float(np.dot(a - 1.0 / slots, ref_c))
        cos /= max(float(np.linalg.norm(a - 1.0 / slots) * np.linalg.norm(ref_c)), 1e-300)
        strength = abs(cos)
        if strength < _WEAK_ORIENTATION:
            warnings.append(
                f"the reference profile barely orients this fit (|cos| = {strength:.2f}): the "
                "fitted bias is nearly orthogonal to it, so the order's direction is uncertain"
            )
    else:
        lam = 1.0
        if uncertainty and slots > 1:
            strength = _data_orientation_strength(prob, best)
    params = prob.design.n_passages + aff.basis.shape[1] + prob.n_intercepts
    dof = prob.design.prompts - params
    cov_u = None
    if uncertainty:
        cov = _cov_u(prob, best, aff if gauge else None, dof)
        if cov is not None:
            cov_u, deficient = cov
            cov_u = cov_u / (lam * lam)
            if deficient:
                warnings.append(
                    f"the fitted bias leaves {deficient} direction(s) of the utilities "
                    "undetermined (e.g. a near-uniform bias over few slots): their order is "
                    "not supported by the data"
                )
            if variance == "jackknife":
                jack = _jackknife_cov(prob, best, aff, gauge, ref_c)
                if jack is None:
                    warnings.append(_NO_JACKKNIFE)
                else:
                    cov_u, stalled = jack
                    if stalled:
                        warnings.append(
                            f"{stalled} of {prob.design.prompts} jackknife refits stopped at "
                            "the iteration limit (without one of its prompts the fit runs "
                            "away): the standard errors are large and the confidences near 0.5"
                        )
        else:
            warnings.append("no residual degrees of freedom: adjacent-pair confidences unavailable")
    if not best.converged:
        warnings.append("the solver stopped at its iteration limit before converging")
    return _Core(
        u, a, best.cost, best.converged, iterations, dof, cov_u, strength, None, warnings, "joint"
    )


def _finish(prob: lm.Problem, st: lm.State, aff: lm.Affine, gauge: bool) -> lm.State:
    """The joint fit's last stage from ``st``: LM in the gauge, else the non-negative simplex."""
    if gauge or st.a.shape[0] == 1:
        return lm.run(prob, st, aff)
    return lm.run_nonneg(prob, st)


def _jackknife_cov(
    prob: lm.Problem, best: lm.State, aff: lm.Affine, gauge: bool, ref_c: FloatArray
) -> tuple[FloatArray, int] | None:
    """Delete-one-prompt jackknife covariance of the reported (centred) utilities.

    The delta method's ``sigma^2 (J^T J)^-1`` assumes the additive model is exact and the
    errors independent. On SmolLM2's scores it is not: with the default design at N = 10
    (20 prompts, 6 residual degrees of freedom) the delta method's adjacent pairs claimed
    0.683 on average where an independent fit of five times the prompts confirmed 0.574, and
    its claims in [0.75, 0.9) averaged 0.82 for 0.56 confirmed; the jackknife's 0.603
    overall, and 0.81 for 0.82 (bench/confidence_real.py, 48 fits). On exact synthetic data
    the jackknife is conservative (bench/confidence.py).

    Each refit drops one prompt and restarts from the full fit and its bounds; all of them
    run stacked (``lm.run_batch``, ``lm.run_nonneg_batch``). Past ``_JACKKNIFE_GROUPS``
    prompts, prompt ``i`` joins group ``i mod 20`` and each group is dropped in turn
    (the delete-a-group jackknife, ``(G - 1) / G`` times the refits' spread): the cost stops
    growing with M, and the confidences moved by 0.003-0.013 on average and stayed as
    calibrated (bench/jackknife_cost.py, bench/confidence.py).

    Returns ``None`` when dropping a prompt hides a passage (a utility resting on one prompt
    has no replication to measure): the caller keeps the delta method and says so. Also the
    number of refits that stopped at the iteration limit.
    """
    d = prob.design
    m, n = d.prompts, d.n_passages
    groups = min(m, _JACKKNIFE_GROUPS)
    weights = np.ones((groups, m))
    weights[np.arange(m) % groups, np.arange(m)] = 0.0
    if groups < m and not _every_passage_survives(d, weights):
        groups, weights = m, 1.0 - np.eye(m)
    if not _every_passage_survives(d, weights):
        return None
    slots = best.a.shape[0]
    m = groups
    if gauge or slots == 1:
        out = lm.run_batch(
            prob, weights, lm.batch(best, m, aff), None, _JACKKNIFE_MAX_ITER, tol=_JACKKNIFE_TOL
        )
    else:
        # Warm, unlike _finish: the fit's zero coefficients start held.
        out = lm.run_nonneg_batch(
            prob,
            weights,
            best,
            best.a <= 0.0,
            tol=_JACKKNIFE_TOL,
            max_iter=_JACKKNIFE_MAX_ITER,
            rounds=_JACKKNIFE_ROUNDS,
        )
    us = np.empty((m, n))
    for i in range(m):
        u = _report_scale(out.u[i], out.a[i], ref_c)[1] if gauge else out.u[i]
        us[i] = u - u.mean()
    dev = us - us.mean(axis=0)
    cov = np.asarray((m - 1) / m * (dev.T @ dev), dtype=np.float64)
    return cov, int((~out.converged).sum())


def _every_passage_survives(d: Design, weights: FloatArray) -> bool:
    """Does every passage stay shown in every weighted copy of the design?"""
    return bool(((weights @ d.u_matrix(np.ones(d.slots))) > 0).all())


# Groups of prompts the jackknife leaves out in turn, at most. 20 keeps the default design
# (2N prompts, N = 10) a delete-one jackknife; past it, grouping moved the confidences by
# 0.003-0.013 on average (bench/jackknife_cost.py) and left them as calibrated
# (bench/confidence.py), at a fifth to a ninth of the delete-one's time from N = 50.
_JACKKNIFE_GROUPS = 20
# The refits' stopping rules (``lm.run_batch``'s ``tol`` and iteration limit; the full fit
# keeps 1e-12 and 200). A standard error is a spread over refits, not an optimum: at 1e-12
# about 40% of the stacked solves refined digits the spread does not show, most of them damped
# steps rejected near the optimum. And a refit from the full fit's optimum converges in at
# most 17 iterations on the 48 committed SmolLM2 fits (results/bench/confidence_real_scores
# .json), so one still going at 60 is walking off along a valley (reported: it stopped at the
# limit); at 200 such refits were most of the jackknife's time on scores with no structure
# (the paced engine's). With both, those 48 fits take 24.5 stacked solves instead of 41.5, the
# standard errors of the 47 whose refits converge move by at most 6e-5 relative and their
# confidences by 5e-6, the same warnings; the one with a runaway refit keeps its warning and its
# confidences move by 0.021 (tests/solver/test_fit.py).
_JACKKNIFE_TOL = 1e-6
_JACKKNIFE_MAX_ITER = 60
# Active sets a refit on the simplex may take (``lm.run_nonneg_batch``'s ``rounds``): 1 keeps
# the fit's zero coefficients at zero and lets no free one leave, the jackknife of the fit on
# its own face. A search per copy ran up to three more stacked solves after the first, each as
# long as its slowest copy, with a Python step per copy between them: on the paced engine's
# scores (no structure: many refits change the active set) that was half the jackknife's time.
# Measured (tests/solver/test_fit.py): on the 48 committed SmolLM2 fits, the same orders and
# warnings, confidences 0.0025 apart on average, and against the independent fits claims in
# [0.75, 0.9) confirmed 0.82 for 0.81 claimed (0.79 for 0.81 with the search;
# bench/confidence_real.py).
_JACKKNIFE_ROUNDS: int | None = 1


_NO_JACKKNIFE = (
    "a passage is shown in only one prompt, so the jackknife cannot measure its utility's "
    "spread: standard errors and confidences come from the delta method, which overstates "
    "certainty on real scores"
)


def _starts(ref: FloatArray, aff: lm.Affine) -> list[FloatArray]:
    """The reference and the generic shapes, projected onto the feasible set, deduplicated."""
    out: list[FloatArray] = []
    for shape in [ref, *start_shapes(ref.shape[0])]:
        a = aff.a0 + aff.basis @ (aff.basis.T @ (shape - aff.a0))
        if not any(float(np.abs(a - b).max()) <= 1e-9 for b in out):
            out.append(a)
    return out


def _report_scale(
    u: FloatArray, a: FloatArray, ref_c: FloatArray
) -> tuple[FloatArray, FloatArray, float]:
    """Pick the unidentified scale of a same-set fit: the reference's spread, kept feasible.

    The fit is invariant to ``(a~, u~) -> (lambda a~, u~ / lambda)``; the reported bias takes
    ``|a~| = |a~_ref|`` (capped so ``a >= 0``), and the utilities follow.
    """
    slots = a.shape[0]
    dev = a - 1.0 / slots
    norm = float(np.linalg.norm(dev))
    if norm <= 1e-300:
        return a, u, 1.0
    lam = float(np.linalg.norm(ref_c)) / norm
    neg = dev < 0
    if np.any(neg):
        lam = min(lam, float((1.0 / slots) / (-dev[neg]).max()))
    ubar = float(u.mean())
    # The cap puts the most negative slot at 1/L - 1/L, which rounds to about -1e-17: clip it so
    # the reported bias is on the simplex exactly, as the program's constraint says.
    return np.maximum(1.0 / slots + lam * dev, 0.0), ubar + (u - ubar) / lam, lam


def _data_orientation_strength(prob: lm.Problem, best: lm.State) -> float:
    """How decisively the data prefer the fitted orientation over its reverse, in [0, 1].

    Refit from the mirrored solution ``(1/L - a~, -u~)``. If that converges back to an order
    agreeing with the fit, the reverse is not even a local optimum (1.0); otherwise
    ``(RSS_reverse - RSS) / RSS_reverse``.
    """
    slots = best.a.shape[0]
    a_flip = np.maximum(2.0 / slots - best.a, 0.0)
    a_flip /= a_flip.sum()
    ubar = float(best.u.mean())
    st = lm.State(2.0 * ubar - best.u, a_flip, best.b.copy(), math.inf)
    st = lm.run(prob, st, lm.simplex(slots), max_iter=_FLIP_ITERS)
    if _kendall(st.u, best.u) > 0:
        return 1.0
    if st.cost <= 0:
        return 0.0
    return float(np.clip((st.cost - best.cost) / st.cost, 0.0, 1.0))


def _cov_u(
    prob: lm.Problem, st: lm.State, aff: lm.Affine | None, dof: int
) -> tuple[FloatArray, int] | None:
    """Delta-method covariance of the utilities, ``sigma^2 (J^T J)^-1`` in the fixed gauge,
    and the rank deficiency of ``J`` at the solution (directions the data do not fix)."""
    if dof <= 0:
        return None
    slots = st.a.shape[0]
    if aff is None:
        aff = lm.simplex(slots)
    _, shown = lm.predict(prob, st.u, st.a, st.b)
    jac = lm.jacobian(prob, st.a, shown, aff)
    sigma2 = st.cost / dof
    n = prob.design.n_passages
    jtj = jac.T @ jac
    eig = np.linalg.eigvalsh(jtj)
    deficient = int((eig <= eig[-1] * 1e-10).sum()) if eig.size else 0
    inv = np.linalg.pinv(jtj, rcond=1e-10, hermitian=True)
    return np.asarray(sigma2 * inv[:n, :n]), deficient


def _fixed_bias(prob: lm.Problem, ref: FloatArray, uncertainty: bool, variance: Variance) -> _Core:
    """Utilities given the bias (a calibrated profile): ridge / Wiener deconvolution."""
    warnings: list[str] = []
    u, b, rank = _deconvolve(prob, ref)
    n = prob.design.n_passages
    if rank < n:
        warnings.append(
            f"the reference profile leaves {n - rank} direction(s) of the utilities undetermined "
            "(e.g. a symmetric profile with an even number of slots); those are set to zero"
        )
    pred, _ = lm.predict(prob, u, ref, b)
    cost = float(((pred - prob.s) ** 2).sum())
    dof = prob.design.prompts - n - prob.n_intercepts
    cov_u = None
    sensitivity = None
    if uncertainty:
        if dof > 0:
            x = lm.x_matrix(prob, ref)
            inv = np.asarray(np.linalg.pinv(x.T @ x, rcond=1e-12, hermitian=True), np.float64)
            cov_u = np.asarray((cost / dof) * inv[:n, :n], dtype=np.float64)
            if variance == "jackknife":
                jack = _jackknife_linear(x, inv, prob.s - pred, n)
                if jack is None:
                    warnings.append(_NO_JACKKNIFE)
                else:
                    cov_u = jack
        else:
            warnings.append(
                "zero residual degrees of freedom (cyclic design): every bias profile fits "
                "exactly, so confidences are unavailable; see prior_sensitivity"
            )
        sensitivity = _prior_sensitivity(prob, ref, u)
    return _Core(
        u, ref.copy(), cost, True, 0, dof, cov_u, None, sensitivity, warnings, "fixed_bias"
    )


def _jackknife_linear(
    x: FloatArray, inv: FloatArray, resid: FloatArray, n: int
) -> FloatArray | None:
    """The exact delete-one jackknife of a linear least-squares fit, in closed form: dropping
    prompt i moves the solution by ``-(X^T X)^-1 x_i e_i / (1 - h_i)``. ``None`` when a prompt
    has leverage 1 (it alone determines a direction)."""
    m = x.shape[0]
    lev = np.einsum("ij,jk,ik->i", x, inv, x)
    if float(lev.max(initial=0.0)) >= 1.0 - 1e-9:
        return None
    shift = (inv @ (x.T * (resid / (1.0 - lev))))[:n].T  # m x n: each prompt's influence
    shift = shift - shift.mean(axis=1, keepdims=True)  # the centred utilities, as reported
    dev = shift - shift.mean(axis=0)
    return np.asarray((m - 1) / m * (dev.T @ dev), dtype=np.float64)


def _deconvolve(prob: lm.Problem, a: FloatArray) -> tuple[FloatArray, FloatArray, int]:
    """Utilities (and intercepts) for a fixed bias, with the rank of the utilities' system.

    Closed-form Wiener deconvolution for exact cyclic designs, ridge least squares otherwise;
    both shrink by the same relative ``_RIDGE``, so they agree on cyclic designs.
    """
    d = prob.design
    n = d.n_passages
    phi = _cyclic_base(d)
    if phi is not None:
        # s_k = sum_j a_j v[(j + k) mod N] with v = u[phi]: S_f = conj(A_f) V_f.
        shifts = np.argsort(phi)[d.perms[:, 0]]
        s_by_shift = np.empty(n)
        s_by_shift[shifts] = prob.s
        a_f = np.fft.rfft(a, n)
        power = np.abs(a_f) ** 2
        rho = _RIDGE * float(power.mean())
        v = np.fft.irfft(a_f * np.fft.rfft(s_by_shift) / (power + rho), n)
        u = np.empty(n)
        u[phi] = v
        full = power > 1e-10 * float(power.max())
        rank = int(full[0]) + 2 * int(full[1:].sum()) - (int(full[-1]) if n % 2 == 0 else 0)
        return u, np.zeros(0), rank
    x = lm.x_matrix(prob, a)
    xtx = x.T @ x
    rho = _RIDGE * float(np.trace(xtx)) / xtx.shape[0]
    reg = np.full(xtx.shape[0], rho)
    reg[n:] = 0.0  # intercepts are not shrunk
    sol = np.asarray(np.linalg.solve(xtx + np.diag(reg), x.T @ prob.s), dtype=np.float64)
    sv = np.linalg.svd(x[:, :n], compute_uv=False)
    rank = int((sv > sv[0] * 1e-6).sum()) if sv.size else 0
    return sol[:n], sol[n:], rank


def _cyclic_base(d: Design) -> NDArray[np.int64] | None:
    """The base ordering if the rows are exactly the N rotations of one permutation."""
    n = d.n_passages
    if d.ragged or d.slots != n or d.prompts != n:
        return None
    phi = d.perms[0]
    inv = np.argsort(phi)
    shifts = inv[d.perms[:, 0]]
    if np.unique(shifts).shape[0] != n:
        return None
    expect = phi[(np.arange(n)[None, :] + shifts[:, None]) % n]
    return phi if bool(np.all(expect == d.perms)) else None


def _prior_sensitivity(prob: lm.Problem, ref: FloatArray, u: FloatArray) -> float:
    """Smallest Kendall tau between the order under ``ref`` and under sharper/flatter
    versions of it (``ref**0.5``, ``ref**2``): 1.0 means the order does not hinge on the
    profile's exact shape."""
    taus = []
    for gamma in (0.5, 2.0):
        alt = ref**gamma
        u_alt, _, _ = _deconvolve(prob, alt / alt.sum())
        taus.append(_kendall(u_alt, u))
    return float(min(taus))


def _kendall(x: FloatArray, y: FloatArray) -> float:
    """Kendall tau-a of two score vectors (O(N^2); N is small)."""
    n = x.shape[0]
    if n < 2:
        return 1.0
    sx = np.sign(x[:, None] - x[None, :])
    sy = np.sign(y[:, None] - y[None, :])
    return float((sx * sy).sum() / (n * (n - 1)))


def _retriever(retriever_scores: ArrayLike | None) -> FloatArray | None:
    if retriever_scores is None:
        return None
    r = np.asarray(retriever_scores, dtype=np.float64)
    if r.ndim != 1 or not np.all(np.isfinite(r)):
        raise DesignError("retriever_scores must be a 1-D array of finite numbers")
    return r


def _order(utilities: FloatArray, retr: FloatArray | None) -> tuple[int, ...]:
    """Descending utility; ties (to 1e-9 nats) by retriever score, then index; never-shown
    passages (NaN) last in retriever order."""
    n = utilities.shape[0]
    r = retr if retr is not None else np.zeros(n)
    shown = np.isfinite(utilities)
    key = np.where(shown, np.round(np.nan_to_num(utilities, nan=0.0), 9), 0.0)
    idx = np.arange(n)
    order = np.lexsort((idx, -r, -key, ~shown))
    return tuple(int(i) for i in order)


def _adjacent_confidence(
    order: tuple[int, ...],
    utilities: FloatArray,
    old: NDArray[np.int64],
    cov: FloatArray,
    dof: int,
) -> FloatArray:
    """P(u[order[k]] > u[order[k + 1]]) per adjacent pair: Student's t with the fit's residual
    degrees of freedom at delta / SE, since sigma is estimated from those residuals. The
    normal CDF (docs/method.md's Phi) assumes sigma known and overstates certainty when few
    prompts are left over: on 150 synthetic pruned-random fits (N = 10, M = 20, 6 residual
    degrees of freedom, noise 0.3) the normal CDF predicted 0.765 on average for 0.741 of the
    pairs in the right order, t 0.753 (tests/solver/test_fit.py checks this). With many
    residual degrees of freedom the two agree."""
    pos = np.full(utilities.shape[0], -1)
    pos[old] = np.arange(old.shape[0])
    out = np.full(max(len(order) - 1, 0), np.nan)
    for k in range(len(order) - 1):
        i, j = pos[order[k]], pos[order[k + 1]]
        if i < 0 or j < 0:
            continue
        delta = float(utilities[order[k]] - utilities[order[k + 1]])
        var = float(cov[i, i] + cov[j, j] - 2.0 * cov[i, j])
        out[k] = above_probability(delta, var, dof)
    return out


def above_probability(delta: float, var: float, dof: int) -> float:
    """P(one utility is above another) given their difference ``delta``, its variance ``var``
    and the fit's residual degrees of freedom (Student's t; ``_adjacent_confidence``)."""
    if var <= 0.0:
        return 1.0 if delta > 0 else 0.5
    return float(stdtr(dof, delta / math.sqrt(var)))


def _trivial(
    design: Design,
    s: FloatArray,
    ref: FloatArray | None,
    retr: FloatArray | None,
    warnings: list[str],
    dropped: int,
) -> Fit:
    """N = 1 or all-equal scores: retriever order, nothing identified."""
    slots = design.slots
    bias = (
        np.full(slots, 1.0 / slots)
        if ref is None
        else validate_reference(ref, slots, allow_uniform=True)
    )
    utilities = np.where(design.shown, 0.0, np.nan)
    return Fit(
        order=_order(utilities, retr),
        utilities=utilities,
        position_bias=bias,
        bias_identified=False,
        identification="none",
        orientation="none",
        orientation_strength=None,
        confidence=None,
        r2=None,
        converged=True,
        iterations=0,
        warnings=tuple(warnings),
        objective=float(((s - s.mean()) ** 2).sum()),
        shown=design.shown.copy(),
        prompts_used=design.prompts,
        prompts_dropped=dropped,
        residual_dof=0,
        utility_stderr=None,
        prior_sensitivity=None,
        method="trivial",
    )
