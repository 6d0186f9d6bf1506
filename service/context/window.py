"""The context window: which scored passages go into the generator's prompt, in which order,
and how many of its tokens they take.

Steps, each drop recorded with its reason (nothing leaves the context unsaid):

1. ``top_n`` (if set): passages below the ``top_n`` best are dropped (``top_n``).
2. The distractor rule (``solver.selection``): passages credibly below a floor relative to the
   best, by the fit's covariance (``distractor``). A strategy without standard errors drops
   nothing here and says so in a warning.
3. The budget: candidates best first, each kept while it fits (``budget``); a budget below the
   best passage's own tokens is a ``ContextBudgetTooSmall`` (422).
4. Placement of the kept ones: the strategy's placement restricted to them (as ``top_n`` does),
   or ``document`` order: passages of one source together, in ascending ``offset`` (OP-RAG,
   arXiv 2409.01666), sources in the placement order of their first passage.
5. The exact count: the documents block as the generator will read it (each passage rendered by
   the prompt template at its final slot, title and number included, joined by the template's
   separator) is tokenised once; while it is over the budget (a merge across a boundary, a
   slot number's digits) the weakest kept passage is dropped (``budget``). So ``tokens_used``
   is the exact count and never exceeds the budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from service.backends.base import PromptTokenizer
from service.errors import LimitExceeded
from service.passage import Passage
from service.prompting.templates import PromptTemplate
from solver.fit import Fit
from solver.selection import DistractorRuleName, distractor_verdicts, pack_budget

_REFILL = 32
"""Passages the estimate left out that are tried again against the exact count."""

ContextOrder = Literal["placement", "document"]
DropReason = Literal["duplicate", "top_n", "distractor", "budget"]

__all__ = [
    "ContextBudgetTooSmall",
    "ContextOptions",
    "ContextOrder",
    "ContextWindow",
    "DistractorOptions",
    "Dropped",
    "build_window",
    "document_order",
]


class ContextBudgetTooSmall(LimitExceeded):
    """The budget cannot hold even the best passage: ``limit`` is the tokens it needs,
    ``value`` the budget. Retrying unchanged fails again; a larger budget (or a cut with
    ``truncate``) fits it."""

    code = "context_budget_too_small"

    def __init__(self, param: str, needed: int, budget: int) -> None:
        super().__init__(param, needed, budget)
        self.message = (
            f"{param} is {budget}, below the {needed} tokens the best passage takes in the "
            "prompt (its rendered document block); raise the budget or cut passages"
        )
        self.args = (self.message,)


@dataclass(frozen=True, slots=True)
class DistractorOptions:
    fraction: float = 1.0
    confidence: float = 0.9
    rule: DistractorRuleName = "not_credibly_below"


@dataclass(frozen=True, slots=True)
class ContextOptions:
    max_context_tokens: int | None = None
    distractors: DistractorOptions | None = None
    dedup_threshold: float | None = None
    order: ContextOrder = "placement"


@dataclass(frozen=True, slots=True)
class Dropped:
    index: int
    """Scored index (the app maps it to the request's)."""
    reason: DropReason
    detail: str
    tokens: int | None = None
    probability: float | None = None
    into: int | None = None


@dataclass(frozen=True, slots=True)
class ContextWindow:
    order: list[int]
    """Kept passages (scored indices) in prompt order."""
    dropped: list[Dropped]
    tokens_used: int
    budget: int | None
    tokenizer: str
    tokenizer_is_generator: bool
    counted: str
    distractor_rule: str | None
    warnings: list[str] = field(default_factory=list)


def document_order(order: Sequence[int], passages: Sequence[Passage]) -> list[int]:
    """``order``'s passages with each source's together, in ascending offset (passages without
    an offset keep their placement order after those with one); sources (a passage without a
    source is its own) in the order their first passage appears in ``order``."""
    groups: dict[object, list[int]] = {}
    for i in order:
        src = passages[i].source
        key: object = ("source", src) if src is not None else ("alone", i)
        groups.setdefault(key, []).append(i)
    out: list[int] = []
    for members in groups.values():
        rank = {i: k for k, i in enumerate(members)}
        out.extend(
            sorted(
                members,
                key=lambda i: (
                    passages[i].offset is None,
                    passages[i].offset if passages[i].offset is not None else 0,
                    rank[i],
                ),
            )
        )
    return out


def _block(template: PromptTemplate, slot: int, passage: Passage) -> str:
    return template.render_document(slot, passage)[0]


def _count(tokenizer: PromptTokenizer, text: str) -> int:
    return len(tokenizer.encode(text).ids) if text else 0


def build_window(
    *,
    order: Sequence[int],
    ranking: Sequence[int],
    fit: Fit | None,
    passages: Sequence[Passage],
    options: ContextOptions,
    tokenizer: PromptTokenizer,
    tokenizer_name: str,
    tokenizer_is_generator: bool,
    template: PromptTemplate,
    top_n: int | None = None,
    budget_param: str = "context.max_context_tokens",
) -> ContextWindow:
    """The kept passages, in prompt order, with every drop and the exact token count (module
    docstring). Indices are the scored passages'.

    Raises:
        ContextBudgetTooSmall: the budget is below the best passage's tokens.
    """
    dropped: list[Dropped] = []
    warnings: list[str] = []
    candidates = list(ranking)
    if top_n is not None and top_n < len(candidates):
        for i in candidates[top_n:]:
            dropped.append(Dropped(i, "top_n", f"below the top_n={top_n} best"))
        candidates = candidates[:top_n]
    rule_text: str | None = None
    dist = options.distractors
    if dist is not None:
        rule_text = (
            f"{dist.rule}: floor = u_best - {dist.fraction:g} * (u_best - mean u), "
            f"confidence {dist.confidence:g}, by the fit's covariance"
        )
        stderr = fit.utility_stderr if fit is not None else None
        if fit is None or stderr is None or not np.isfinite(stderr).any():
            warnings.append(
                "context.distractors: the strategy gave no standard errors, so no passage "
                "was dropped as a distractor"
            )
            rule_text += " (not applied: no standard errors)"
        else:
            verdicts = distractor_verdicts(
                candidates,
                np.asarray(fit.utilities, dtype=np.float64),
                np.asarray(stderr, dtype=np.float64),
                fit.utility_cov,
                fraction=dist.fraction,
                confidence=dist.confidence,
                rule=dist.rule,
            )
            kept_c: list[int] = []
            for v in verdicts:
                if v.keep:
                    kept_c.append(v.index)
                else:
                    what = (
                        "credibly below"
                        if dist.rule == "not_credibly_below"
                        else "not credibly above"
                    )
                    dropped.append(
                        Dropped(
                            v.index,
                            "distractor",
                            f"utility {what} the floor {v.floor:.4g} "
                            f"(P = {v.probability:.3f}, confidence {dist.confidence:g})",
                            probability=_finite(v.probability),
                        )
                    )
            candidates = kept_c
    budget = options.max_context_tokens
    sep = template.separator
    keep = set(candidates)
    budget_drops: list[int] = []
    if budget is not None and candidates:
        # Each block counted at the last slot's number (the widest) with one separator, and
        # the budget given one separator more (n blocks have n - 1): an estimate for packing;
        # the exact count below corrects it both ways.
        slot = max(len(candidates) - 1, 0)
        costs = [_count(tokenizer, _block(template, slot, passages[i]) + sep) for i in candidates]
        best_alone = _count(tokenizer, _block(template, 0, passages[candidates[0]]))
        if best_alone > budget:
            raise ContextBudgetTooSmall(budget_param, best_alone, budget)
        keep = set(pack_budget(candidates, costs, budget + _count(tokenizer, sep)))
        keep.add(candidates[0])
        budget_drops = [i for i in candidates if i not in keep]

    def placed_of(kept: set[int]) -> list[int]:
        seq = [i for i in order if i in kept]
        return document_order(seq, passages) if options.order == "document" else seq

    def count(seq: Sequence[int]) -> int:
        return _count(
            tokenizer, sep.join(_block(template, k, passages[i]) for k, i in enumerate(seq))
        )

    placed = placed_of(keep)
    used = count(placed)
    if budget is not None:
        # Exact: over the budget (a merge across a boundary, a slot number's digits), the
        # weakest kept passage goes; under it, the best passages the estimate left out are
        # tried again (at most _REFILL, so a request's tokenising stays bounded).
        by_utility = [i for i in ranking if i in keep]
        while used > budget and len(by_utility) > 1:
            weakest = by_utility.pop()
            keep.discard(weakest)
            budget_drops.append(weakest)
            placed = placed_of(keep)
            used = count(placed)
        if used > budget:  # the best alone over the budget at its slot: refuse, never cut
            raise ContextBudgetTooSmall(budget_param, used, budget)
        rank = {i: k for k, i in enumerate(ranking)}
        for i in sorted(budget_drops, key=rank.__getitem__)[:_REFILL]:
            trial = placed_of(keep | {i})
            n = count(trial)
            if n <= budget:
                keep.add(i)
                placed, used = trial, n
        for i in sorted(budget_drops, key=rank.__getitem__):
            if i not in keep:
                tokens = _count(tokenizer, _block(template, 0, passages[i]))
                dropped.append(
                    Dropped(
                        i,
                        "budget",
                        f"does not fit the budget of {budget} tokens beside better passages",
                        tokens=tokens,
                    )
                )
    counted = (
        f"the documents block of prompt template {template.name!r}: each kept passage rendered "
        f"at its slot (number, title, text), joined by {sep!r}; the instruction, question and "
        "chat markup are not counted"
    )
    return ContextWindow(
        order=placed,
        dropped=dropped,
        tokens_used=used,
        budget=budget,
        tokenizer=tokenizer_name,
        tokenizer_is_generator=tokenizer_is_generator,
        counted=counted,
        distractor_rule=rule_text,
        warnings=warnings,
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
