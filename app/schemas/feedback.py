"""``POST /v1/feedback``'s wire models: a served request's id and the generator's answer, and
what the service did with it (docs/generator-profile.md, "Feedback")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.schemas.base import NOT_BLANK, _Model, _Strict

MAX_ANSWER_CHARS = 8192
"""Longest answer taken: an answer, not a document (422 above it)."""


class FeedbackBody(_Strict):
    """The generator's answer to a prompt built from a `POST /v1/reorder` response."""

    id: str = Field(min_length=1, max_length=128)
    """The reorder response's `id` (its request id)."""
    answer: str = Field(min_length=1, max_length=MAX_ANSWER_CHARS, pattern=NOT_BLANK)
    """What the generator answered, as it answered it. Attributed to the passages holding it,
    then dropped: never stored."""


class FeedbackOut(_Model):
    """Whether the answer was learned from, and why."""

    id: str
    used: bool
    """Whether it was pooled into the generator's profile: only answers to a uniformly random
    placement (`shuffle`) identify it."""
    reason: str
    attribution: Literal["contained", "overlap", "none"] | None
    """How the answer was attributed (null when not used): to the passages containing it, by
    content-word overlap, or to none (it then carries no weight)."""
    slots: list[int]
    """The served slots (0-based) of the passages it was attributed to."""
