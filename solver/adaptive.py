"""``adaptive``: a MoI design scored in rounds that stops once the top passage is settled.

The default pruned-random design spends ``2N`` prompts of ``ceil(N / 2)`` passages on every
request. What a placement needs most is the passage the most-weighted slot gets: the leader.
This design (docs/method.md, "The adaptive design"):

1. **Shorter prompts.** ``L = ceil(0.3 N)`` passages per prompt (3 of 10), so a prompt costs
   about 60% of a default one; the budget is the prompts whose tokens are half the default
   design's (15 of 3 for N = 10, against 20 of 5).
2. **A first round that identifies the fit**: the first rows of the balanced pruned-random
   design of ``L`` passages, two more than the fit has parameters: ``N + 2`` when the bias
   is fixed (a stored profile, so the fit is linear in the utilities), ``N + L + 1`` when the
   bias is fitted jointly.
3. **Rounds that separate the leader from its challengers** (``next_rows``): for each
   passage not yet settled below the leader, a pair of prompts with the same other passages
   in the same slots, the leader in one and the challenger in the other, both in the slot
   the bias weights most. The pair's score difference measures the two utilities'
   difference directly, whatever the other passages contribute (Gold Panning's "put the
   uncertain passages where the bias looks", made paired for a near-flat bias).
4. **Stop** (``settled``) when the leader is above every other passage with probability at
   least ``confidence`` (Student's t on the fit's covariance, the same probability as
   ``Fit.confidence``), or when the budget is spent.

Everything here is a pure function of its arguments; the service drives the rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from solver.designs import default_prompt_passages, plan
from solver.errors import DesignError
from solver.fit import Fit, above_probability

IntArray = NDArray[np.int64]
StopReason = Literal["settled", "budget", "small_request"]

DEFAULT_CONFIDENCE = 0.9
# Shorter prompts than the default design's ceil(N / 2): the fit needs about N equations
# whatever L is, and a prompt of 0.3 N passages costs ~60% of a default one.
_SHORT = 0.3
# A prompt's template and question, in passages: 64 tokens against 131 a passage on NQ-Open
# with SmolLM2's tokenizer (16 prompts of 3 took 7,309-8,587 tokens, 20 of 5 14,390-17,070).
_OVERHEAD = 0.5
# Rows of a challenger round: one leader/challenger pair per two rows.
ROUND_PAIRS = 2


@dataclass(frozen=True)
class AdaptivePlan:
    """The sizes of one request's adaptive design."""

    n_passages: int
    slots: int
    """L: passages per prompt."""
    max_prompts: int
    """The budget: at most this many prompts are scored."""
    first_round: int
    """Prompts of the first round; ``first_round == max_prompts`` and ``small`` for requests
    too small to adapt (they get the default pruned-random design in one round)."""
    confidence: float
    fixed_bias: bool
    small: bool


def default_slots(n_passages: int) -> int:
    """``L`` of the adaptive design: ``ceil(0.3 N)``, within ``[1, N - 1]``."""
    return max(1, min(n_passages - 1, math.ceil(_SHORT * n_passages)))


def default_budget(n_passages: int, slots: int) -> int:
    """The prompts of ``slots`` passages whose tokens are at most half the default design's,
    a prompt's template and question counted as half a passage (``_OVERHEAD``)."""
    n = n_passages
    base_l = default_prompt_passages(n)
    base_m = min(2 * n, math.perm(n, base_l))
    return max(1, math.floor(base_m * (base_l + _OVERHEAD) / (2 * (slots + _OVERHEAD))))


def first_round_size(n_passages: int, slots: int, fixed_bias: bool) -> int:
    """Two residual degrees of freedom beyond the fit's parameters: ``N - 1`` centred
    utilities and an intercept, plus ``L - 1`` free slot weights when the bias is fitted."""
    params = n_passages if fixed_bias else n_passages + slots - 1
    return params + 2


def make_plan(
    n_passages: int,
    *,
    fixed_bias: bool,
    max_prompts: int | None = None,
    slots: int | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
) -> AdaptivePlan:
    """Sizes for one request. Requests too small to adapt (the first round would not fit the
    budget, or ``N < 4``) get the default pruned-random design in one round.

    Raises:
        DesignError: arguments no design can satisfy.
    """
    n = int(n_passages)
    if n < 1:
        raise DesignError(f"n_passages must be >= 1, got {n_passages}")
    if not 0.5 <= confidence < 1.0:
        raise DesignError(f"confidence must be in [0.5, 1), got {confidence}")
    if slots is not None and n > 1 and not 1 <= slots < n:
        raise DesignError(f"prompt_passages must be in [1, {n - 1}] for N = {n}, got {slots}")
    L = default_slots(n) if slots is None else int(slots)
    distinct = math.perm(n, L)
    budget = min(default_budget(n, L), distinct) if max_prompts is None else int(max_prompts)
    first = first_round_size(n, L, fixed_bias)
    tiny = n < 4
    if not tiny and max_prompts is not None and first > max_prompts:
        raise DesignError(
            f"an adaptive design of {n} passages in prompts of {L} needs num_prompts >= "
            f"{first} (its first round identifies the fit), got {max_prompts}"
        )
    if tiny or first > min(budget, distinct):
        # Too small to adapt: pruned random's design in one round (the caller's num_prompts,
        # else its default 2N).
        base_l = default_prompt_passages(n)
        available = math.perm(n, base_l)
        base_m = 1 if n == 1 else (min(2 * n, available) if max_prompts is None else max_prompts)
        if base_m > available:
            raise DesignError(
                f"num_prompts = {base_m} exceeds the {available} distinct prompts of {base_l} "
                f"of {n} passages"
            )
        return AdaptivePlan(n, base_l, base_m, base_m, confidence, fixed_bias, True)
    if budget > distinct:
        raise DesignError(
            f"num_prompts = {budget} exceeds the {distinct} distinct prompts of {L} of {n} passages"
        )
    return AdaptivePlan(n, L, budget, first, confidence, fixed_bias, False)


def first_rows(p: AdaptivePlan, seed: int) -> IntArray:
    """The first round: the balanced pruned-random rows (the default design for small
    requests)."""
    if p.small:
        return plan("pruned_random", p.n_passages, num_prompts=p.max_prompts, seed=seed)
    return plan(
        "pruned_random",
        p.n_passages,
        num_prompts=p.first_round,
        prompt_passages=p.slots,
        seed=seed,
    )


def leader_confidence(f: Fit) -> tuple[int, NDArray[np.float64]]:
    """The leader (``f.order[0]``) and, per passage, the probability that the leader's utility
    is above it (1 for the leader itself; 0.5 where the fit has no covariance)."""
    n = f.utilities.shape[0]
    lead = f.order[0]
    out = np.full(n, 0.5)
    out[lead] = 1.0
    cov = f.utility_cov
    if cov is None:
        return lead, out
    for p in range(n):
        if p == lead:
            continue
        if not (math.isfinite(f.utilities[p]) and math.isfinite(f.utilities[lead])):
            # A passage never scored (NaN utility) is unknown, not beaten: counting it settled
            # would stop the design with a leader nobody compared it to.
            out[p] = 0.0
            continue
        delta = float(f.utilities[lead] - f.utilities[p])
        var = float(cov[lead, lead] + cov[p, p] - 2.0 * cov[lead, p])
        out[p] = above_probability(delta, var, max(f.residual_dof, 1))
    return lead, out


def settled(f: Fit, confidence: float) -> tuple[bool, float]:
    """Whether the leader is above every other passage with probability >= ``confidence``,
    and the smallest of those probabilities (the confidence reached)."""
    _, probs = leader_confidence(f)
    others = np.delete(probs, f.order[0])
    reached = float(others.min()) if others.size else 1.0
    return reached >= confidence, reached


def next_rows(
    f: Fit,
    done: IntArray,
    p: AdaptivePlan,
    bias: NDArray[np.float64],
    rng: np.random.Generator,
) -> IntArray:
    """The next round: up to ``ROUND_PAIRS`` leader/challenger pairs (most threatening
    challengers first), each pair two prompts alike but for the slot the bias weights most,
    within the budget and distinct from every prompt already scored. Empty when no pair fits.
    """
    room = p.max_prompts - done.shape[0]
    lead, probs = leader_confidence(f)
    challengers = [int(c) for c in np.argsort(probs, kind="stable") if int(c) != lead]
    challengers = [c for c in challengers if probs[c] < p.confidence] or challengers[:1]
    top = int(np.argmax(bias[: p.slots]))
    seen = {tuple(int(v) for v in row) for row in done}
    shown = np.bincount(done[done >= 0], minlength=p.n_passages).astype(np.float64)
    rows: list[tuple[int, ...]] = []
    for c in challengers:
        if len(rows) + 2 > min(room, 2 * ROUND_PAIRS):
            break
        pair = _pair(lead, c, top, p, shown, seen, rng)
        if pair is None:
            continue
        for row in pair:
            seen.add(row)
            rows.append(row)
            shown[list(row)] += 1
    return np.asarray(rows, dtype=np.int64).reshape(len(rows), p.slots)


def _pair(
    lead: int,
    challenger: int,
    top: int,
    p: AdaptivePlan,
    shown: NDArray[np.float64],
    seen: set[tuple[int, ...]],
    rng: np.random.Generator,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Two rows alike but for ``top``: the leader there in one, the challenger in the other;
    the other slots take the least-shown other passages (random tie-break)."""
    others = np.asarray([q for q in range(p.n_passages) if q not in (lead, challenger)])
    for _ in range(20):
        jitter = rng.random(others.shape[0])
        fill = others[np.argsort(shown[others] + jitter * 0.999, kind="stable")[: p.slots - 1]]
        fill = rng.permutation(fill)
        rest = [int(v) for v in fill]
        a = [*rest[:top], lead, *rest[top:]]
        b = [*rest[:top], challenger, *rest[top:]]
        ta, tb = tuple(a), tuple(b)
        if ta not in seen and tb not in seen:
            return ta, tb
        shown = shown + rng.random(shown.shape[0])  # another filler set next time
    return None
