"""The context options and report (issue 93): which passages go into the generator's prompt
within its token budget, which are dropped as distractors or near-duplicates, and in which
order (docs/context.md). On `/v1/reorder` as `context`, on the rerank routes as
`reorder.context`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.schemas.base import _Model, _Strict
from service.context.window import ContextOptions, DistractorOptions

MAX_CONTEXT_TOKENS = 10_000_000


class DistractorsIn(_Strict):
    """Drop passages whose utility is credibly below a floor relative to the best, by the
    fit's standard errors (covariance), not a raw score threshold (docs/context.md)."""

    fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """Where the floor sits: `u_best - fraction * (u_best - mean u)`; 1.0: the mean passage,
    0.5: half-way from the best to the mean."""
    confidence: float = Field(default=0.9, ge=0.5, lt=1.0)
    """The one-sided probability the rule needs."""
    rule: Literal["not_credibly_below", "credibly_above"] = "not_credibly_below"
    """`not_credibly_below`: drop a passage when P(u < floor) >= confidence (uncertain
    passages stay). `credibly_above`: keep only passages with P(u > floor) >= confidence, and
    the best."""


class ContextIn(_Strict):
    """What goes into the generator's prompt, beyond the order: a token budget, distractor and
    near-duplicate removal, document order. Set: `order` (and the rerank routes' `results`)
    list only the kept passages, and `context` in the response says what was dropped and why."""

    max_context_tokens: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_TOKENS)
    """The budget, in the generator's tokens (`generator_tokenizer`, else the scoring
    model's; the response's `context.tokenizer` says which), of the documents block as the
    prompt template renders it (each passage's numbered document line with its title, joined by
    the template's separator; instruction, question and chat markup not counted). Passages are
    kept best first while they fit; never exceeded; a budget below the best passage's tokens is
    a 422 (`context_budget_too_small`, with the tokens it needs as `limit`)."""
    distractors: DistractorsIn | None = None
    """Drop distractors by the fit's standard errors (`moi`; other strategies drop none and
    warn)."""
    dedup: bool = False
    """Merge near-duplicate passages before scoring (word 5-shingle Jaccard >= `dedup_threshold`):
    each is scored once, and the duplicates are reported in `context.merged`."""
    dedup_threshold: float = Field(default=0.8, gt=0.0, le=1.0)
    """Jaccard similarity at which two passages are near-duplicates (0.8: near-identical
    text; chunks overlapping by half score about 0.33)."""
    order: Literal["placement", "document"] = "placement"
    """`placement`: the kept passages in the strategy's placement. `document`: each source's
    passages together in ascending `offset` (OP-RAG), sources in the placement order of their
    first passage; passages need `source` (and `offset`) for it to matter."""

    def options(self) -> ContextOptions:
        return ContextOptions(
            max_context_tokens=self.max_context_tokens,
            distractors=(
                DistractorOptions(
                    fraction=self.distractors.fraction,
                    confidence=self.distractors.confidence,
                    rule=self.distractors.rule,
                )
                if self.distractors is not None
                else None
            ),
            dedup_threshold=self.dedup_threshold if self.dedup else None,
            order=self.order,
        )


class DroppedOut(_Model):
    index: int
    """The passage's index in the request."""
    reason: Literal["duplicate", "top_n", "distractor", "budget"]
    detail: str
    tokens: int | None = None
    """`budget`: the tokens it would have taken."""
    probability: float | None = None
    """`distractor`: the probability the rule read."""
    into: int | None = None
    """`duplicate`: the kept passage it merged into (request index)."""


class MergedOut(_Model):
    index: int
    into: int
    similarity: float
    """Word 5-shingle Jaccard similarity."""


class ContextOut(_Model):
    """What goes into the prompt and why (request's `context`)."""

    order: list[int]
    """The kept passages (request indices) in prompt order; the same as `order`."""
    tokens_used: int
    """The kept documents block's exact tokens (see `counted`)."""
    budget: int | None
    tokenizer: str
    """The tokenizer that counted: the generator's (`generator_tokenizer`) or the scoring
    model's."""
    tokenizer_is_generator: bool
    """False when the scoring model's tokenizer stood in for an unconfigured generator's."""
    counted: str
    """What `tokens_used` counts."""
    dropped: list[DroppedOut]
    """Every passage not in `order`, with why."""
    merged: list[MergedOut]
    """Near-duplicates merged before scoring (scored once, as `into`)."""
    distractor_rule: str | None
    """The distractor rule applied, with its floor and confidence."""
