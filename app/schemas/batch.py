"""``POST /v1/reorder/batch``'s wire models: many native request bodies in, each item's
response or error out, in place (docs/api.md, "Many queries in one call").

An item is validated by the route, not here: ``items`` is documented as a list of
``ReorderBody`` but kept as the raw JSON objects (``SkipValidation``), so one bad item
answers its own 422 in its place instead of failing the whole call. The route validates
each with ``ReorderBody.model_validate``: every option and bound the single route has.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SkipValidation

from app.schemas.base import ErrorDetail, _Model, _Strict
from app.schemas.reorder import ReorderBody, ReorderResponse


class BatchBody(_Strict):
    """`POST /v1/reorder/batch`."""

    items: Annotated[list[SkipValidation[ReorderBody]], Field(min_length=1)]
    """The native `POST /v1/reorder` bodies, each validated on its own: an invalid item is
    answered in place with a 422 and the others still run. At most `RAG_REORDER_BATCH_MAX_ITEMS`
    items and `RAG_REORDER_BATCH_MAX_TOTAL_CHARS` characters over them (422 above either)."""

    def raw_items(self) -> list[Any]:
        """The items as sent (JSON values, not yet validated: see the module docstring)."""
        return list(self.items)


class BatchItemResult(_Model):
    """One item's outcome, at its index."""

    index: int
    """The item's position in `items`."""
    request_id: str
    """The item's own id: the batch's `X-Request-Id` and `.` and the index."""
    status: int
    """The HTTP status the item would have had as a single `POST /v1/reorder`."""
    response: ReorderResponse | None = None
    """The item's response (status 200), exactly as `POST /v1/reorder` answers it."""
    error: ErrorDetail | None = None
    """The item's error (any other status), the envelope's `error` of a single request."""


class BatchResponse(_Model):
    object: Literal["reorder.batch"] = "reorder.batch"
    results: list[BatchItemResult]
    """One per item, in the items' order."""
    succeeded: int
    """Items answered 200."""
    failed: int
    """Items answered with an error."""
