"""``POST /v1/feedback``'s wire models: a served request's id and the generator's answer, and
what the service did with it (docs/generator-profile.md, "Feedback")."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, model_validator

from app.schemas.base import NOT_BLANK, _Model, _Strict

MAX_ANSWER_CHARS = 8192
"""Longest answer taken: an answer, not a document (422 above it)."""


class FeedbackBody(_Strict):
    """A report on a served `POST /v1/reorder` response: its outcome, the generator's answer
    to the prompt built from it, or both (one report per served request)."""

    id: str = Field(min_length=1, max_length=128)
    """The reorder response's `feedback_id` (a token the server made for the caller it
    served)."""
    answer: str | None = Field(
        default=None, min_length=1, max_length=MAX_ANSWER_CHARS, pattern=NOT_BLANK
    )
    """What the generator answered, as it answered it. Attributed to the passages holding it,
    then dropped: never stored."""
    outcome: StrictBool | Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    """How good the answer was, in [0, 1] (`true` is 1, `false` 0): a user's thumbs, a
    judge's score, exact match. Counted in `auto`'s uplift when the request was in its
    randomized holdout (docs/outcomes.md)."""

    @model_validator(mode="after")
    def _something(self) -> FeedbackBody:
        if self.answer is None and self.outcome is None:
            raise ValueError("send an `outcome`, an `answer`, or both")
        return self

    @property
    def reward(self) -> float | None:
        return None if self.outcome is None else float(self.outcome)


class UpliftOut(_Model):
    """One key's uplift of the placement over the holdout's control order."""

    key: str
    """`model|template|passages`."""
    estimate: float
    """Placed mean outcome minus the control's (inverse-probability weighted)."""
    lower: float
    upper: float
    """An always-valid interval at level 1 - `RAG_REORDER_OUTCOME_ALPHA`: it holds the true
    uplift at every moment it is read, together."""
    verdict: Literal["helps", "hurts", "no_difference", "not_enough"]
    outcomes: dict[str, int]
    """Outcomes counted, per arm: `placed`, `holdout`, `pass_through` (not compared)."""
    needed: int | None
    """`not_enough`: outcomes more it needs at its current pace (null otherwise)."""
    eta_s: float | None
    """Seconds those take at the rate outcomes arrived so far (null: unknown)."""
    pass_through: bool
    """`outcome_policy` `act` serves this key the retriever's order (bar a placed share)."""
    reason: str


class OutcomeOut(_Model):
    """What was done with the outcome."""

    counted: bool
    arm: Literal["placed", "holdout", "pass_through"] | None
    """The arm that served the request (null: not in the randomized holdout)."""
    reason: str
    uplift: UpliftOut | None
    """The key's uplift with it (null: not counted)."""


class FeedbackOut(_Model):
    """Whether the answer was learned from, and why."""

    id: str
    used: bool
    """Whether the answer was pooled into the generator's profile: only answers to a
    uniformly random placement (`shuffle`, or a holdout's shuffle) identify it."""
    reason: str
    attribution: Literal["contained", "overlap", "none"] | None
    """How the answer was attributed (null when not used): to the passages containing it, by
    content-word overlap, or to none (it then carries no weight)."""
    slots: list[int]
    """The served slots (0-based) of the passages it was attributed to."""
    outcome: OutcomeOut | None = None
    """What was done with the outcome (null: none was sent)."""
