"""Which passages go into the prompt: the distractor rule and budget packing, as pure numerics.

The fit gives each passage a utility with a covariance (``Fit.utility_cov``, else the standard
errors alone). A passage is a *distractor* here when its utility is credibly below a floor set
relative to the best passage: ``floor = u_best - fraction * (u_best - mean(u))`` (``fraction``
1.0: the mean shown passage; 0.5: half-way from the best to the mean). The floor is relative,
so the rule does not depend on the score's scale (which ``standardise`` changes per request);
and it reads the fit's uncertainty, so a passage is never dropped on a gap the design cannot
resolve. The difference ``u_best - u_i`` carries the covariance of both (jackknife or delta
method), ``Var = c_bb + c_ii - 2 c_bi``; without a covariance the two errors add in quadrature.

Two rules, both one-sided normal tests at ``confidence``:

- ``not_credibly_below`` (the default): drop ``i`` when ``P(u_i < floor) >= confidence``.
  Uncertain passages stay: the service drops a passage only on evidence that it is weak,
  because dropping the answer-bearing passage costs far more than keeping a weak one (paper 004:
  distractors cost a few points; a lost gold passage costs the answer).
- ``credibly_above``: keep only passages with ``P(u_i > floor) >= confidence`` (and always the
  best): fewer tokens, but an unresolved design keeps only the best passage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

DistractorRuleName = Literal["not_credibly_below", "credibly_above"]

__all__ = [
    "DistractorRuleName",
    "DistractorVerdict",
    "distractor_verdicts",
    "normal_cdf",
    "pack_budget",
]


def normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True, slots=True)
class DistractorVerdict:
    index: int
    keep: bool
    probability: float
    """``P(u_i < floor)`` (``not_credibly_below``) or ``P(u_i > floor)`` (``credibly_above``)."""
    floor: float


def distractor_verdicts(
    candidates: Sequence[int],
    utilities: NDArray[np.float64],
    stderr: NDArray[np.float64],
    cov: NDArray[np.float64] | None,
    *,
    fraction: float,
    confidence: float,
    rule: DistractorRuleName,
) -> list[DistractorVerdict]:
    """One verdict per candidate (best first: ``candidates[0]`` is the best and always kept).

    Candidates with a non-finite utility or error are kept (nothing known against them).
    """
    if not candidates:
        return []
    finite = [i for i in candidates if math.isfinite(float(utilities[i]))]
    if not finite:
        return [DistractorVerdict(i, True, float("nan"), float("nan")) for i in candidates]
    best = max(finite, key=lambda i: float(utilities[i]))
    ub = float(utilities[best])
    mean = float(np.mean([float(utilities[i]) for i in finite]))
    floor = ub - fraction * (ub - mean)
    out: list[DistractorVerdict] = []
    for i in candidates:
        u, s = float(utilities[i]), float(stderr[i])
        if i == best or not (math.isfinite(u) and math.isfinite(s)):
            out.append(DistractorVerdict(i, True, float("nan"), floor))
            continue
        # The floor moves with the best: its error is the difference's, scaled by `fraction`.
        if cov is not None and math.isfinite(float(cov[i, best])):
            var = (
                float(cov[i, i])
                + fraction**2 * float(cov[best, best])
                - 2.0 * fraction * float(cov[i, best])
            )
        else:
            var = s * s + (fraction * float(stderr[best])) ** 2
        sd = math.sqrt(max(var, 0.0))
        gap = floor - u  # > 0: below the floor
        below = (1.0 if gap > 0 else 0.0) if sd <= 0.0 else normal_cdf(gap / sd)
        if rule == "not_credibly_below":
            out.append(DistractorVerdict(i, below < confidence, below, floor))
        else:
            above = 1.0 - below
            out.append(DistractorVerdict(i, above >= confidence, above, floor))
    return out


def pack_budget(candidates: Sequence[int], tokens: Sequence[int], budget: int) -> list[int]:
    """Greedy packing in ``candidates``' order (best first): each passage that still fits is
    kept, one that does not is skipped and the next (maybe shorter) one tried. ``tokens[k]``
    is candidate ``k``'s cost. Greedy by utility, not by utility per token: utilities are
    centred log-likelihood gains, not additive values, so a density knapsack would trade the
    best passage for two short weak ones."""
    kept: list[int] = []
    used = 0
    for idx, cost in zip(candidates, tokens, strict=True):
        if used + cost <= budget:
            kept.append(idx)
            used += cost
    return kept
