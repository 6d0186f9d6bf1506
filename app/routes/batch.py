"""``POST /v1/reorder/batch``: many native requests in one call, for offline pipelines and
evaluation (docs/api.md, "Many queries in one call").

Each item is a ``POST /v1/reorder`` body and is answered in its place with what that route
would have answered: its response, or its error envelope's ``error`` and status (``param``
named within the item, as the single route names it). One bad item fails only itself:

- **Validated per item.** ``items`` stays raw JSON in the body model (app/schemas/batch.py)
  and each item is validated here with ``ReorderBody``, so one invalid option is that item's
  422, not the call's. Only what concerns the whole call fails it: not a list, empty, more
  than ``batch_max_items``, more than ``batch_max_total_chars`` over the valid items, or a
  server not serving (503 before any item runs).
- **Admitted per item.** Each item goes through ``execute`` as one request: a request slot,
  its own deadline (``request_timeout_s``, from when it starts), its own estimate and
  per-request limits. Admitting the batch as a whole would price N requests against one
  deadline, so a batch sized for an offline job would be refused outright or run into a 504
  that throws away the items already done. Per item, an item the queue refuses is a 503 in
  its place, to retry alone, and at most ``batch_concurrency`` items are in flight, so a
  batch holds no more request slots than that many callers would: it shares the engine and
  admission with everyone else on the same terms.
- **Its own request id.** Item ``i`` is ``<batch id>.<i>`` (the batch's ``X-Request-Id``, or
  the server's), in its response, its error and the logs; the feedback store keeps a served
  item under its caller's name as for a single request.

A client that leaves cancels every item still running.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import anyio
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.types import Message

from app.dependencies import Ctx, RequestId
from app.errors import POST_ERRORS, error_detail, validation_error
from app.routes.reorder import reorder_one
from app.schemas.base import ErrorDetail
from app.schemas.batch import BatchBody, BatchItemResult, BatchResponse
from app.schemas.reorder import ReorderBody
from service.errors import LimitExceeded, ReorderError, ServerError
from serving.context import AppContext
from serving.execution import cancel_on_disconnect

log = logging.getLogger(__name__)

router = APIRouter(tags=["reorder"])

# The middleware's request ids are at most 128 characters; an item's stays within that.
_MAX_ID: Final = 128


def item_id(batch_id: str, index: int) -> str:
    """Item ``index``'s request id: the batch's, then ``.`` and the index."""
    suffix = f".{index}"
    return batch_id[: _MAX_ID - len(suffix)] + suffix


def _chars(body: ReorderBody) -> int:
    """What ``batch_max_total_chars`` counts of one item: its query, passage texts, titles."""
    return len(body.query) + sum(len(p.text) + len(p.title or "") for p in body.passages)


async def _no_disconnect() -> Message:
    # An item's own watcher never fires: the batch's watches the client for all its items
    # (one reader of the connection), and cancels them together.
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


def _item_request(request: Request, rid: str) -> Request:
    """The batch's request as seen by one item: its own request id in the scope's state."""
    scope = dict(request.scope)
    scope["state"] = {**request.scope.get("state", {}), "request_id": rid}
    return Request(scope, receive=_no_disconnect)


@router.post(
    "/v1/reorder/batch",
    response_model=BatchResponse,
    responses=POST_ERRORS,
    summary="Reorder many queries' passages in one call",
)
async def reorder_batch(
    body: BatchBody, request: Request, ctx: Ctx, request_id: RequestId
) -> BatchResponse:
    """Each item is a `POST /v1/reorder` body, validated, admitted and run as one request
    (at most `RAG_REORDER_BATCH_CONCURRENCY` at once); `results[i]` is item i's response or
    error, with the status the single route would have answered. The call itself is 200
    whenever it ran; 422 when `items` is empty or over `RAG_REORDER_BATCH_MAX_ITEMS` or
    `RAG_REORDER_BATCH_MAX_TOTAL_CHARS`."""
    settings = ctx.settings
    raw = body.raw_items()
    if len(raw) > settings.batch_max_items:
        raise LimitExceeded(
            "items", settings.batch_max_items, len(raw), what="RAG_REORDER_BATCH_MAX_ITEMS"
        )
    results: list[BatchItemResult | None] = [None] * len(raw)
    valid: list[tuple[int, ReorderBody]] = []
    for i, item in enumerate(raw):
        rid = item_id(request_id, i)
        try:
            valid.append((i, ReorderBody.model_validate(item)))
        except ValidationError as exc:
            # Located in the item, as the single route would name it: the error sits at i.
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            results[i] = _failed(request, i, rid, validation_error(RequestValidationError(errors)))
    total = sum(_chars(b) for _, b in valid)
    if total > settings.batch_max_total_chars:
        raise LimitExceeded(
            "items",
            settings.batch_max_total_chars,
            total,
            what="characters of queries, passages and titles summed over the items: "
            "RAG_REORDER_BATCH_MAX_TOTAL_CHARS",
        )
    # Not serving (loading, draining): the whole call's 503, not one per item.
    await ctx.check_serving()

    async def run_all() -> None:
        limiter = anyio.Semaphore(settings.batch_concurrency)
        async with anyio.create_task_group() as tg:
            for i, item_body in valid:
                tg.start_soon(_run_item, ctx, request, limiter, results, i, item_body, request_id)

    await cancel_on_disconnect(request, run_all)
    done = [r for r in results if r is not None]
    assert len(done) == len(raw), "every item is answered"
    ok = sum(1 for r in done if r.status == 200)
    return BatchResponse(results=done, succeeded=ok, failed=len(done) - ok)


async def _run_item(
    ctx: AppContext,
    request: Request,
    limiter: anyio.Semaphore,
    results: list[BatchItemResult | None],
    index: int,
    body: ReorderBody,
    batch_id: str,
) -> None:
    rid = item_id(batch_id, index)
    item_request = _item_request(request, rid)
    async with limiter:
        try:
            response = await reorder_one(body, item_request, ctx, rid)
        except ReorderError as exc:
            results[index] = _failed(item_request, index, rid, exc)
            return
        except Exception:
            # What the middleware's catch-all does for a single request: a 500 with the id,
            # the traceback in the log only. The other items go on.
            log.exception("request %s: batch item %d failed", rid, index)
            results[index] = _failed(item_request, index, rid, ServerError("internal error"))
            return
    results[index] = BatchItemResult(index=index, request_id=rid, status=200, response=response)


def _failed(request: Request, index: int, rid: str, exc: ReorderError) -> BatchItemResult:
    scope: dict[str, Any] = dict(request.scope)
    scope["state"] = {**request.scope.get("state", {}), "request_id": rid}
    kind, detail = error_detail(scope, exc)
    return BatchItemResult(
        index=index,
        request_id=rid,
        status=kind.status,
        error=ErrorDetail.model_validate(detail),
    )
