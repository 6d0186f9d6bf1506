"""``calibrate``: one bias profile shared by many runs of the same model and slot count.

The runs are stacked into one design over disjoint passage sets (each run keeps its own
utilities, and its own intercept when its prompts are ragged) and fitted jointly with one
shared ``a``. Each run's scores are standardised on their own: a run's utilities absorb its
scale, so this is exact. Cyclic runs carry no information about the bias and are refused
(docs/method.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solver import lm
from solver.design import Design, Identification, as_design, identifiability
from solver.errors import SolverError, UnidentifiableDesign
from solver.fit import _report_scale, _starts
from solver.profiles import primacy_profile, validate_reference

FloatArray = NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Profile:
    """A calibrated position-bias profile for ``slots`` prompt slots."""

    coefficients: FloatArray
    identification: Identification
    runs: int
    prompts: int
    r2: float
    converged: bool
    warnings: tuple[str, ...]

    @property
    def slots(self) -> int:
        return int(self.coefficients.shape[0])

    def __array__(self, dtype: object = None, copy: object = None) -> FloatArray:
        return np.asarray(self.coefficients, dtype=np.float64)


def calibrate(
    runs: Iterable[tuple[ArrayLike, ArrayLike]], *, reference_bias: ArrayLike | None = None
) -> Profile:
    """Fit one shared bias profile across runs.

    Args:
        runs: ``(permutations, scores)`` pairs from random or pruned-random designs of the same
            model, template and slot count.
        reference_bias: orients the profile when every run shows all its passages in every
            prompt (default: the generic primacy profile); pruned runs orient it themselves.

    Returns:
        The profile (its ``coefficients`` sum to 1).

    Raises:
        UnidentifiableDesign: a run is cyclic or otherwise cannot identify the bias.
        SolverError: no runs, or runs with different slot counts.
    """
    designs: list[Design] = []
    levels: list[Identification] = []
    scores: list[FloatArray] = []
    warnings: list[str] = []
    for k, (perms, s_raw) in enumerate(runs):
        d = as_design(perms)
        s = np.asarray(s_raw, dtype=np.float64)
        if s.shape != (d.prompts,):
            raise SolverError(f"run {k}: {s.shape[0]} scores for {d.prompts} prompts")
        keep = np.isfinite(s)
        if not keep.all():
            warnings.append(f"run {k}: {int((~keep).sum())} non-finite score(s) dropped")
            d, s = d.subset(keep), s[keep]
        d, _ = d.compact()
        run_level = identifiability(d).level if d.prompts else "none"
        if run_level == "none":
            raise UnidentifiableDesign(
                f"run {k} cannot identify the bias (a cyclic or too-small design); calibrate "
                "from random or pruned_random runs"
            )
        sd = float(s.std())
        if sd == 0:
            warnings.append(f"run {k}: all scores equal, skipped")
            continue
        designs.append(d)
        levels.append(run_level)
        scores.append((s - s.mean()) / sd)
    if not designs:
        raise SolverError("calibrate needs at least one usable run")
    slots = {d.slots for d in designs}
    if len(slots) != 1:
        raise SolverError(f"runs have different slot counts {sorted(slots)}; calibrate per count")
    L = slots.pop()
    stacked, groups = _stack(designs)
    prob = lm.Problem(stacked, np.concatenate(scores), groups)
    # One run that identifies everything breaks the shared lambda symmetry for all of them.
    level: Identification = "up_to_scale" if all(v == "up_to_scale" for v in levels) else "full"
    ref = primacy_profile(L) if reference_bias is None else validate_reference(reference_bias, L)
    ref_c = ref - 1.0 / L
    gauge = level == "up_to_scale"
    if gauge:
        unit = ref_c / float(np.linalg.norm(ref_c))
        aff = lm.affine(
            1.0 / L + float(np.linalg.norm(ref_c)) * unit, np.vstack([np.ones(L), unit])
        )
    else:
        aff = lm.simplex(L)
    states = [lm.run(prob, lm.start(prob, a), aff, 3) for a in _starts(ref, aff)]
    best = min(states, key=lambda st: st.cost)
    best = lm.run(prob, best, aff) if gauge else lm.run_nonneg(prob, best)
    a = best.a
    if gauge:
        a, _, _ = _report_scale(best.u, best.a, ref_c)
    if not best.converged:
        warnings.append("the solver stopped at its iteration limit before converging")
    return Profile(
        coefficients=a,
        identification=level,
        runs=len(designs),
        prompts=stacked.prompts,
        r2=1.0 - best.cost / stacked.prompts,
        converged=best.converged,
        warnings=tuple(warnings),
    )


def _stack(designs: list[Design]) -> tuple[Design, FloatArray | None]:
    """One design over disjoint passage ranges; an intercept column per ragged run."""
    L = designs[0].slots
    rows = []
    offset = 0
    ragged = [d.ragged for d in designs]
    group_cols = []
    total = sum(d.prompts for d in designs)
    start = 0
    for d, rg in zip(designs, ragged, strict=True):
        shifted = np.where(d.perms >= 0, d.perms + offset, -1)
        rows.append(shifted)
        if rg:
            col = np.zeros(total)
            col[start : start + d.prompts] = 1.0
            group_cols.append(col)
        offset += d.n_passages
        start += d.prompts
    perms = np.vstack(rows)
    assert perms.shape[1] == L
    groups = np.stack(group_cols, axis=1) if group_cols else None
    return Design(perms, offset), groups
