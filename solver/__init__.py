"""Pure numerics of rag-reorder: permutation designs, the bias/utility fit, calibration, placement.

Synchronous, deterministic, numpy/scipy only; no I/O. Public API::

    plan(kind, n_passages, *, num_prompts=None, prompt_passages=None, seed=0,
         retriever_scores=None) -> int array M x L (-1 = empty slot)
    fit(permutations, scores, *, reference_bias=None, retriever_scores=None) -> Fit
    calibrate(runs) -> Profile
    place(fit, how="descending_utility" | "bias_matched" | "litm") -> list[int]
    place_ranking(ranking, how, bias) -> list[int]   (any ranking, a given bias profile)
"""

from solver.calibrate import Profile, calibrate
from solver.design import Design, Identifiability, as_design, identifiability
from solver.designs import KINDS, DesignKind, default_prompt_passages, plan
from solver.errors import DesignError, InvalidReference, SolverError, UnidentifiableDesign
from solver.fit import Fit, fit
from solver.placement import PLACEMENTS, Placement, place, place_ranking
from solver.profiles import primacy_profile, resample

__all__ = [
    "KINDS",
    "PLACEMENTS",
    "Design",
    "DesignError",
    "DesignKind",
    "Fit",
    "Identifiability",
    "InvalidReference",
    "Placement",
    "Profile",
    "SolverError",
    "UnidentifiableDesign",
    "as_design",
    "calibrate",
    "default_prompt_passages",
    "fit",
    "identifiability",
    "place",
    "place_ranking",
    "plan",
    "primacy_profile",
    "resample",
]
