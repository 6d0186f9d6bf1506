"""``assess``: is a bias profile pooled from many runs good enough to place passages by?

The profile-first strategy (``auto``) stops paying for MoI once a profile of the scoring
model is *trusted*: measured, not assumed. This module decides that from the runs alone.

The pooled fit. Every run is a pruned-random design (each prompt shows L < N passages, so the
data fix the bias's orientation, docs/method.md) with its own utilities and one bias ``a``
shared by all runs. With ``a`` fixed the utilities are linear least squares, so they are
projected out (variable projection): for runs that share one design ``X(a)`` (M prompts x N
passages, ``X[i, pi_i(j)] = a_j``) the residual sum of squares is
``trace((I - X X^+) G)`` with ``G = sum_r s_r s_r^T`` over those runs' standardised scores.
Only L - 1 numbers are optimised and a bootstrap resample only reweights the ``G``'s, so 200
resamples of 200 runs cost about a second where ``solver.calibrate`` (the same objective, all
utilities optimised jointly) takes seconds per fit (``tests/solver/test_trust.py`` checks that
both find the same profile).

The verdict (every figure is reported, so an operator sees why):

- ``shaped``: the profile is distinguishable from flat (a bootstrap Wald test of
  ``a = 1/L``, p < ``alpha``) and the placement it implies is stable: at least
  ``min_stability`` of the bootstrap fits, resampled to the request's N slots, put the same
  ``top_slots`` slots first, in the same order.
- ``flat``: not distinguishable from flat, and the bootstrap upper bound (1 - ``alpha``) of
  the relative spread ``L (max a - min a)`` is below ``flat_effect``: enough runs to exclude
  a slot that weighs ``flat_effect`` of the mean slot's weight more than another.
- ``undecided``: neither yet (or fewer than ``min_runs`` runs): keep measuring.

``drift`` asks the opposite question of a trusted profile: do newer runs disagree with it
beyond both fits' uncertainty (a two-sample Wald test), in a way that changes the placement?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, stats

from solver.design import as_design, identifiability
from solver.errors import SolverError, UnidentifiableDesign
from solver.profiles import resample, start_shapes

FloatArray = NDArray[np.float64]
Verdict = Literal["shaped", "flat", "undecided"]

# Relative change of the objective below which the pooled fit stops (it is a smooth problem in
# L - 1 variables; the bootstrap's spread dwarfs this).
_FTOL = 1e-10


@dataclass(frozen=True)
class TrustRules:
    """The thresholds of ``assess`` and ``drift`` (docs/operations.md gives the reasons)."""

    alpha: float = 0.05
    """Level of the test against flat, and 1 - the level of the spread's upper bound."""
    min_stability: float = 0.9
    """Share of bootstrap fits that must place the same top slots for ``shaped``."""
    top_slots: int = 2
    """How many of the strongest slots (strongest first) the stability compares."""
    flat_effect: float = 0.1
    """Relative spread ``L (max a - min a)`` a ``flat`` verdict must exclude."""
    min_runs: int = 5
    """Fewer runs than this are ``undecided`` whatever they show."""
    resamples: int = 200
    """Bootstrap resamples of the runs."""
    keep_stability: float = 0.8
    """Share of bootstrap fits a *trusted* label-free profile's refit must still give the same
    top slots for the profile to stay trusted (``holds``): below ``min_stability``, so that the
    resampling noise of one more answer does not withdraw it (SmolLM2's recorded answers,
    best slot: at 0.9 withdrawn and trusted again three times between 103 and 132 answers, at
    0.8 never; ``eval/trust_hysteresis.py``)."""
    drift_alpha: float = 0.001
    """Level of the drift test (strict: it is repeated as newer runs arrive)."""
    drift_min_runs: int = 8
    """Fewest newer runs a drift test looks at."""


@dataclass(frozen=True, eq=False)
class Trust:
    """How far a pooled profile can be trusted, with every figure behind the verdict."""

    verdict: Verdict
    reason: str
    runs: int
    coefficients: FloatArray
    """The pooled fit over all runs (sums to 1)."""
    covariance: FloatArray
    """Bootstrap covariance of the coefficients (L x L)."""
    flat_p: float
    """p-value of the test of ``a = 1/L`` (bootstrap Wald, L - 1 degrees of freedom)."""
    spread: float
    """``L (max a - min a)``: how much more the strongest slot weighs than the weakest, as a
    share of the mean slot weight."""
    spread_upper: float
    """The bootstrap (1 - alpha) upper bound of ``spread``."""
    stability: float
    """Share of bootstrap fits that put the same ``top_slots`` first (placement over
    ``placement_slots``)."""
    top_slots: tuple[int, ...]
    """The strongest slots of the placement, strongest first (0-based, over
    ``placement_slots``)."""
    placement_slots: int
    resamples: int
    r2: float

    @property
    def trusted(self) -> bool:
        return self.verdict != "undecided"

    @property
    def slots(self) -> int:
        return int(self.coefficients.shape[0])


@dataclass(frozen=True)
class Drift:
    """Whether newer runs disagree with a trusted profile (``drift``)."""

    drifted: bool
    p: float
    """p-value of the two-sample Wald test of equal profiles."""
    runs: int
    coefficients: FloatArray
    """The newer runs' pooled fit."""
    top_slots: tuple[int, ...]
    reason: str


class _Pool:
    """Runs grouped by design: per group the design and one standardised score column per run."""

    def __init__(self, runs: Sequence[tuple[ArrayLike, ArrayLike]]) -> None:
        groups: dict[bytes, tuple[np.ndarray, list[FloatArray]]] = {}
        slots: set[int] = set()
        for k, (perms_raw, s_raw) in enumerate(runs):
            perms = np.asarray(perms_raw, dtype=np.int64)
            s = np.asarray(s_raw, dtype=np.float64)
            if perms.ndim != 2 or s.shape != (perms.shape[0],):
                raise SolverError(f"run {k}: {s.size} scores for a design of shape {perms.shape}")
            if (perms < 0).any() or not np.isfinite(s).all():
                continue  # ragged (variable pruning) or a failed prompt: not this model's data
            sd = float(s.std())
            if sd == 0.0:
                continue  # nothing to fit
            key = perms.tobytes() + bytes(str(perms.shape), "ascii")
            if key not in groups:
                d, _ = as_design(perms).compact()
                if identifiability(d).level != "full":
                    raise UnidentifiableDesign(
                        f"run {k}: its design does not identify the bias's orientation on its "
                        "own; pool pruned_random runs"
                    )
                groups[key] = (perms, [])
            groups[key][1].append((s - s.mean()) / sd)
            slots.add(int(perms.shape[1]))
        if len(slots) > 1:
            raise SolverError(f"runs have different slot counts {sorted(slots)}")
        self.slots = slots.pop() if slots else 0
        self.columns = [np.stack(cols, axis=1) for _, cols in groups.values()]
        self.runs = sum(c.shape[1] for c in self.columns)
        # Each run's index (the group, its column), in a fixed order for the bootstrap.
        self.index = [(g, c) for g, cols in enumerate(self.columns) for c in range(cols.shape[1])]
        # The groups' designs stacked by shape (prompts, passages): one evaluation of the
        # objective is then a few batched array operations per shape, not a Python loop over
        # designs (calibrate's 12 queries are 12 designs of one shape).
        perms_of = [perms for perms, _ in groups.values()]
        shapes: dict[tuple[int, int], list[int]] = {}
        for g, perms in enumerate(perms_of):
            shapes.setdefault((perms.shape[0], int(perms.max()) + 1), []).append(g)
        self.members = list(shapes.values())
        self.designs = [_Stack([perms_of[g] for g in members]) for members in self.members]

    def grams(self, weights: FloatArray | None = None) -> list[FloatArray]:
        """``G = sum_r w_r s_r s_r^T`` per group (``w`` per run in ``index`` order), stacked
        as ``designs`` are (one ``B x M x M`` array per shape)."""
        if weights is None:
            per_group = [c @ c.T for c in self.columns]
        else:
            per_group = []
            start = 0
            for c in self.columns:
                w = weights[start : start + c.shape[1]]
                per_group.append((c * w) @ c.T)
                start += c.shape[1]
        return [np.stack([per_group[g] for g in members]) for members in self.members]


class _Stack:
    """``B`` designs of one shape (``M`` prompts of ``L`` slots over ``N`` passages), with the
    flat index of every (design, prompt, slot)'s cell, which builds every ``X(a)``
    (``X[i, pi_i(j)] = a_j``) in one ``bincount``. An index, not a one-hot map: the map is
    ``B x M x N x L`` (1.7 GB at its peak for 200 pooled runs of 100 passages), the index
    ``B x M x L`` (15 MiB there)."""

    def __init__(self, designs: list[np.ndarray]) -> None:
        perms = np.stack(designs).astype(np.int64)  # B x M x L
        b, m, slots = perms.shape
        n = int(perms.max()) + 1
        rows = np.arange(b * m, dtype=np.int64).reshape(b, m, 1)
        self.cells = (rows * n + perms).reshape(-1)
        self.slots = slots
        self.shape = (b, m, n)

    def matrices(self, a: FloatArray) -> FloatArray:
        """Every design's ``X(a)``: ``B x M x N``, each entry its slot's ``a_j`` (or 0)."""
        b, m, n = self.shape
        x = np.bincount(self.cells, weights=np.tile(a, b * m), minlength=b * m * n)
        return np.asarray(x.reshape(self.shape), dtype=np.float64)

    def slot_sums(self, w: FloatArray) -> FloatArray:
        """``sum_b sum_i W_b[i, pi_bi(j)]`` per slot ``j``, for ``W`` of shape ``B x M x N``."""
        return np.asarray(
            w.reshape(-1)[self.cells].reshape(-1, self.slots).sum(axis=0), dtype=np.float64
        )


def _rss_grad(
    a: FloatArray, designs: list[_Stack], grams: list[FloatArray]
) -> tuple[float, FloatArray]:
    """The pooled residual sum of squares at ``a`` and its gradient in ``a``.

    With ``X^+`` the pseudo-inverse and ``P = X X^+``: ``RSS = tr(G) - tr(P G)``, and by the
    variable-projection identity ``dRSS/da_j = -2 sum_i W[i, pi_i(j)]`` with
    ``W = (I - P) G X^+T`` (the residuals times the fitted utilities, summed over runs).
    Computed for each shape's stack of designs at once (``_Stack``).
    """
    total = 0.0
    grad = np.zeros_like(a)
    for stack, g in zip(designs, grams, strict=True):
        x = stack.matrices(a)
        xp = np.linalg.pinv(x, rcond=1e-10)
        gx = g @ xp.transpose(0, 2, 1)
        w = gx - x @ (xp @ gx)
        total += float(np.trace(g, axis1=1, axis2=2).sum())
        total -= float(np.trace(x @ (xp @ g), axis1=1, axis2=2).sum())
        grad -= 2.0 * stack.slot_sums(w)
    return total, grad


def _to_simplex(theta: FloatArray) -> FloatArray:
    z = np.exp(theta - theta.max())
    return np.asarray(z / z.sum(), dtype=np.float64)


def _fit(
    designs: list[_Stack],
    grams: list[FloatArray],
    slots: int,
    starts: list[FloatArray],
) -> tuple[FloatArray, float]:
    """The simplex point minimising the pooled RSS, from the best of ``starts``.

    ``a = softmax(0, theta)``: the simplex without constraints (a slot's weight can get as
    near 0 as the data want, never below).
    """

    def cost(theta: FloatArray) -> tuple[float, FloatArray]:
        a = _to_simplex(np.concatenate([[0.0], theta]))
        value, g = _rss_grad(a, designs, grams)
        # Chain rule through the softmax: da/dtheta = diag(a) - a a^T, first column dropped.
        return value, (a * (g - float(g @ a)))[1:]

    best: tuple[FloatArray, float] | None = None
    for a0 in starts:
        theta0 = np.log(np.clip(a0, 1e-6, None))
        theta0 = theta0[1:] - theta0[0]
        res = optimize.minimize(
            cost, theta0, jac=True, method="L-BFGS-B", options={"ftol": _FTOL, "maxiter": 500}
        )
        a = _to_simplex(np.concatenate([[0.0], res.x]))
        value = float(res.fun)
        if best is None or value < best[1]:
            best = (a, value)
    assert best is not None
    return best


def _top(a: FloatArray, placement_slots: int, k: int) -> tuple[int, ...]:
    """The ``k`` strongest slots of ``a`` resampled to ``placement_slots``, as
    ``solver.place_ranking`` orders them (ties: earlier slot first)."""
    coef = resample(a, placement_slots)
    order = np.lexsort((np.arange(placement_slots), -np.round(coef, 12)))
    return tuple(int(s) for s in order[:k])


def _wald(d: FloatArray, cov: FloatArray, df: int) -> float:
    """p-value of ``d = 0`` given its covariance (pseudo-inverse: the simplex drops a rank)."""
    t = float(d @ np.linalg.pinv(cov, rcond=1e-10) @ d)
    return float(stats.chi2.sf(t, df))


def _bootstrap(pool: _Pool, a_hat: FloatArray, resamples: int, seed: int) -> FloatArray:
    rng = np.random.default_rng(seed)
    out = np.empty((resamples, pool.slots))
    for b in range(resamples):
        w = rng.multinomial(pool.runs, np.full(pool.runs, 1.0 / pool.runs)).astype(np.float64)
        out[b], _ = _fit(pool.designs, pool.grams(w), pool.slots, [a_hat])
    return out


def verdict(
    *,
    runs: int,
    flat_p: float,
    stability: float,
    spread_upper: float,
    k: int,
    rules: TrustRules,
    of: str = "",
    unit: str = "run(s)",
) -> tuple[Verdict, str]:
    """The trust rule (module docstring) on a profile's figures, with its reason in words:
    ``shaped``, ``flat`` or ``undecided``. ``runs`` counts the independent measurements (``unit``
    names them: runs of a design, attributed answers); ``of`` qualifies the stability."""
    if runs < rules.min_runs:
        return "undecided", f"{runs} {unit}, fewer than {rules.min_runs}"
    if flat_p < rules.alpha and stability >= rules.min_stability:
        return "shaped", (
            f"not flat (p = {flat_p:.2g} < {rules.alpha:g}) and {stability:.0%} of "
            f"{rules.resamples} resampled fits place the same top {k} slot(s){of}"
        )
    if flat_p >= rules.alpha and spread_upper < rules.flat_effect:
        return "flat", (
            f"no slot preference (p = {flat_p:.2g}) and the spread's upper bound "
            f"{spread_upper:.3f} excludes {rules.flat_effect:g}"
        )
    if flat_p < rules.alpha:
        return "undecided", (
            f"not flat (p = {flat_p:.2g}) but only {stability:.0%} of resampled fits place the "
            f"same top {k} slot(s){of} (needs {rules.min_stability:.0%})"
        )
    return "undecided", (
        f"not distinguishable from flat (p = {flat_p:.2g}) and too few {unit.replace('(s)', 's')} "
        f"to exclude a "
        f"spread of {rules.flat_effect:g} (upper bound {spread_upper:.3f})"
    )


def holds(
    held: Verdict,
    held_top: Sequence[int],
    *,
    flat_p: float,
    stability: float,
    top: Sequence[int],
    rules: TrustRules,
) -> tuple[bool, str]:
    """Whether a refit that ``verdict`` calls undecided still supports a profile trusted as
    ``held`` (top slots ``held_top``), and why: a hysteresis, so a profile refitted after every
    answer is not withdrawn and trusted again as its figures wander about the bars.

    A ``shaped`` profile holds while the refit still tells it from flat (``flat_p < alpha``),
    puts the same top slots first, and does so in at least ``keep_stability`` of its resampled
    fits; a ``flat`` one while the refit still cannot tell it from flat. A generator that
    changed moves the pooled refit past these as its new answers accumulate."""
    if held == "shaped":
        if flat_p >= rules.alpha:
            return False, f"no longer told from flat (p = {flat_p:.2g} >= {rules.alpha:g})"
        if tuple(top) != tuple(held_top):
            return (
                False,
                f"the refit's top slots {tuple(top)} are not the profile's {tuple(held_top)}",
            )
        if stability < rules.keep_stability:
            return False, (
                f"{stability:.0%} of resampled fits place the same top slots, under the "
                f"{rules.keep_stability:.0%} a trusted profile keeps"
            )
        return True, (
            f"kept: the refit places the same top slots in {stability:.0%} of resampled fits "
            f"(trusting needs {rules.min_stability:.0%}, keeping {rules.keep_stability:.0%})"
        )
    if held == "flat":
        if flat_p < rules.alpha:
            return False, f"a slot preference shows (p = {flat_p:.2g} < {rules.alpha:g})"
        return True, f"kept: still no slot preference (p = {flat_p:.2g})"
    return False, "not trusted"


def top_slots(a: ArrayLike, placement_slots: int, k: int) -> tuple[int, ...]:
    """The ``k`` strongest slots of profile ``a`` placing ``placement_slots`` passages."""
    return _top(np.asarray(a, dtype=np.float64), placement_slots, k)


def pooled_fit(runs: Sequence[tuple[ArrayLike, ArrayLike]]) -> FloatArray:
    """The bias shared by ``runs`` (pruned-random designs), fitted by variable projection.

    Raises:
        SolverError: no usable run, or runs of different slot counts.
        UnidentifiableDesign: a run whose design cannot orient the bias by itself.
    """
    pool = _Pool(runs)
    if pool.runs == 0:
        raise SolverError("no usable run (every run failed, was ragged or had equal scores)")
    starts = [np.full(pool.slots, 1.0 / pool.slots), *start_shapes(pool.slots)]
    a, _ = _fit(pool.designs, pool.grams(), pool.slots, starts)
    return a


def assess(
    runs: Sequence[tuple[ArrayLike, ArrayLike]],
    *,
    placement_slots: int,
    rules: TrustRules | None = None,
    seed: int = 0,
    also_slots: Sequence[int] = (),
) -> Trust:
    """Fit the profile ``runs`` share and decide whether it can be placed by (module docstring).

    Args:
        runs: ``(permutations, scores)`` of pruned-random designs of one model, template and
            slot count; failed, ragged and constant runs are left out.
        placement_slots: N, the passages a placement by this profile orders.
        also_slots: other passage counts it will place (``auto`` places N = 2L - 1 and 2L by
            one L-slot profile): the stability is the lowest over all of them, so a profile
            whose placement of one count is a coin toss is not trusted for any.
        rules: the thresholds (default ``TrustRules()``).
        seed: the bootstrap's seed (the result is deterministic).

    Raises:
        SolverError, UnidentifiableDesign: as ``pooled_fit``.
    """
    rules = rules or TrustRules()
    pool = _Pool(runs)
    if pool.runs == 0:
        raise SolverError("no usable run (every run failed, was ragged or had equal scores)")
    L = pool.slots
    starts = [np.full(L, 1.0 / L), *start_shapes(L)]
    a_hat, rss = _fit(pool.designs, pool.grams(), L, starts)
    total = sum(float(np.trace(g, axis1=1, axis2=2).sum()) for g in pool.grams())
    boot = _bootstrap(pool, a_hat, rules.resamples, seed)
    cov = np.cov(boot, rowvar=False)
    flat_p = _wald(a_hat - 1.0 / L, cov, L - 1)
    spread = float(L * (a_hat.max() - a_hat.min()))
    spreads = L * (boot.max(axis=1) - boot.min(axis=1))
    spread_upper = float(np.quantile(spreads, 1.0 - rules.alpha))
    counts = [placement_slots, *(n for n in also_slots if n != placement_slots)]
    k = min(rules.top_slots, *counts)
    top = _top(a_hat, placement_slots, k)
    per_count = {
        n: float(np.mean([_top(b, n, k) == _top(a_hat, n, k) for b in boot])) for n in counts
    }
    weakest = min(counts, key=lambda n: per_count[n])
    stability = per_count[weakest]
    # Which passage count the stability is of, when several are placed by this profile.
    of = f" of {weakest} passages" if len(counts) > 1 else ""
    decided, reason = verdict(
        runs=pool.runs, flat_p=flat_p, stability=stability, spread_upper=spread_upper, k=k,
        rules=rules, of=of,
    )  # fmt: skip
    return Trust(
        verdict=decided,
        reason=reason,
        runs=pool.runs,
        coefficients=a_hat,
        covariance=np.asarray(cov, dtype=np.float64),
        flat_p=flat_p,
        spread=spread,
        spread_upper=spread_upper,
        stability=stability,
        top_slots=top,
        placement_slots=placement_slots,
        resamples=rules.resamples,
        r2=1.0 - rss / total if total > 0 else float("nan"),
    )


def drift(
    trusted_coefficients: ArrayLike,
    trusted_covariance: ArrayLike,
    trusted_verdict: Verdict,
    newer: Sequence[tuple[ArrayLike, ArrayLike]],
    *,
    placement_slots: int,
    rules: TrustRules | None = None,
    seed: int = 0,
) -> Drift:
    """Whether ``newer`` runs disagree with a trusted profile beyond both fits' uncertainty.

    Drift needs the two-sample Wald test of equal profiles at ``drift_alpha`` and a change
    that matters: for a ``shaped`` profile, the newer fit places other top slots; for a
    ``flat`` one, the newer fit is itself distinguishable from flat.

    Raises:
        SolverError, UnidentifiableDesign: as ``pooled_fit``.
    """
    rules = rules or TrustRules()
    a_old = np.asarray(trusted_coefficients, dtype=np.float64)
    cov_old = np.asarray(trusted_covariance, dtype=np.float64)
    pool = _Pool(newer)
    k = min(rules.top_slots, placement_slots)
    old_top = _top(a_old, placement_slots, k)
    if pool.runs < rules.drift_min_runs:
        return Drift(
            False, 1.0, pool.runs, a_old, old_top,
            f"{pool.runs} newer run(s), fewer than {rules.drift_min_runs}",
        )  # fmt: skip
    if pool.slots != a_old.shape[0]:
        raise SolverError(f"newer runs have {pool.slots} slots, the profile {a_old.shape[0]}")
    L = pool.slots
    a_new, _ = _fit(pool.designs, pool.grams(), L, [a_old, np.full(L, 1.0 / L)])
    boot = _bootstrap(pool, a_new, rules.resamples, seed)
    cov_new = np.cov(boot, rowvar=False)
    p = _wald(a_new - a_old, cov_old + cov_new, L - 1)
    new_top = _top(a_new, placement_slots, k)
    if p >= rules.drift_alpha:
        return Drift(False, p, pool.runs, a_new, new_top, f"agrees (p = {p:.2g})")
    if trusted_verdict == "flat":
        flat_p = _wald(a_new - 1.0 / L, cov_new, L - 1)
        if flat_p < rules.drift_alpha:
            return Drift(
                True, p, pool.runs, a_new, new_top,
                f"differs (p = {p:.2g}) and is no longer flat (p = {flat_p:.2g})",
            )  # fmt: skip
        return Drift(False, p, pool.runs, a_new, new_top, "differs but is still flat")
    if new_top != old_top:
        return Drift(
            True, p, pool.runs, a_new, new_top,
            f"differs (p = {p:.2g}) and places slots {list(new_top)} first, not {list(old_top)}",
        )  # fmt: skip
    return Drift(False, p, pool.runs, a_new, new_top, "differs but places the same top slots")
