"""What both clients share, free of I/O: one ``Request`` per call (method, path, JSON body,
headers and the parser of its answer), built by one function per route, and the retry policy.
``Client`` and ``AsyncClient`` (``client.py``) only send a ``Request`` and wait, the way httpx
keeps one request model for its two transports: a route or an option is written here once, and
the two clients cannot behave differently.
"""

from __future__ import annotations

import functools
import os
import random
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from rag_reorder._version import __version__
from rag_reorder.types import (
    BatchItem,
    BatchReordering,
    ContextReport,
    DroppedPassage,
    Passage,
    Placement,
    PositionBias,
    RagReorderError,
    Reordering,
    Reranking,
    RerankResult,
    ResultsOrder,
    ScoredPassage,
    Strategy,
    retry_after,
)

SERVER_DEADLINE_S = 120.0
"""The service's default deadline per request (``RAG_REORDER_REQUEST_TIMEOUT_S``): it answers
504 ``deadline_exceeded`` by then."""
DEFAULT_TIMEOUT_S = SERVER_DEADLINE_S + 15.0
"""Seconds to wait for an answer: the service's deadline plus a margin for the response to
travel, so its own 504 (with a request id) arrives before the client gives up."""
CONNECT_TIMEOUT_S = 5.0
RETRY_STATUSES = frozenset({429, 503})
RETRY_CODES = frozenset({"overloaded", "not_ready", "draining"})
"""The service's 503 codes worth another attempt: it turned the request away before any work
(full, starting, or shutting down: another replica may take it). Its other 503s
(``engine_unavailable``: its own retries of the engine already failed) are final, so one
request does not become the client's retries times the server's against a sick engine."""
# Errors raised before the request left this process: the service cannot have started the
# work, so a retry costs nothing. A read timeout or a dropped connection after the request was
# sent is not among them: the service may be scoring it, and a retry would score it again.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _passage_json(p: str | Passage) -> str | dict[str, object]:
    if isinstance(p, str):
        return p
    out: dict[str, object] = {"text": p.text}
    for key in ("title", "id", "score", "source", "offset"):
        value = getattr(p, key)
        if value is not None:
            out[key] = value
    return out


def _options(
    *,
    strategy: Strategy | str | None,
    placement: Placement | None,
    design: Mapping[str, object] | None,
    options: Mapping[str, object] | None,
    max_context_tokens: int | None = None,
    context: Mapping[str, object] | None = None,
) -> dict[str, object]:
    # Only what the caller set: everything else takes the server's configured default.
    out: dict[str, object] = dict(options or {})
    if context is not None or max_context_tokens is not None:
        ctx = dict(context or {})
        if max_context_tokens is not None:
            ctx["max_context_tokens"] = max_context_tokens
        out["context"] = ctx
    if strategy is not None:
        out["strategy"] = strategy
    if placement is not None:
        out["placement"] = placement
    if design is not None:
        out["design"] = dict(design)
    return out


T = TypeVar("T")


@dataclass(frozen=True)
class Request(Generic[T]):
    """One call, ready for either client to send, the same on every attempt (the request id
    included). ``headers`` are the call's own; the client adds its connection headers
    (``Policy.headers``) when it sends."""

    method: str
    path: str
    json: Mapping[str, object]
    headers: Mapping[str, str]
    parse: Callable[[Mapping[str, Any]], T]

    def result(self, response: httpx.Response) -> T:
        """The typed answer of a final response.

        Raises:
            RagReorderError: an error response, or a body that is not the route's.
        """
        return self.parse(parse_json(response))


def _call_headers(request_id: str | None) -> dict[str, str]:
    return {"x-request-id": request_id} if request_id else {}


def reorder_request(
    query: str,
    passages: Sequence[str | Passage],
    *,
    strategy: Strategy | str | None = None,
    placement: Placement | None = None,
    design: Mapping[str, object] | None = None,
    top_n: int | None = None,
    options: Mapping[str, object] | None = None,
    request_id: str | None = None,
    max_context_tokens: int | None = None,
    context: Mapping[str, object] | None = None,
) -> Request[Reordering]:
    """``POST /v1/reorder`` (the arguments of ``Client.reorder``)."""
    body = reorder_item(
        query,
        passages,
        strategy=strategy,
        placement=placement,
        design=design,
        top_n=top_n,
        options=options,
        max_context_tokens=max_context_tokens,
        context=context,
    )
    return Request("POST", "/v1/reorder", body, _call_headers(request_id), parse_reordering)


def reorder_item(
    query: str,
    passages: Sequence[str | Passage],
    *,
    strategy: Strategy | str | None = None,
    placement: Placement | None = None,
    design: Mapping[str, object] | None = None,
    top_n: int | None = None,
    options: Mapping[str, object] | None = None,
    max_context_tokens: int | None = None,
    context: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The native body ``Client.reorder`` sends (its arguments): one item of
    ``Client.reorder_batch``."""
    body: dict[str, object] = {
        "query": query,
        "passages": [_passage_json(p) for p in passages],
        **_options(
            strategy=strategy,
            placement=placement,
            design=design,
            options=options,
            max_context_tokens=max_context_tokens,
            context=context,
        ),
    }
    if top_n is not None:
        body["top_n"] = top_n
    return body


def reorder_batch_request(
    items: Sequence[Mapping[str, object]], *, request_id: str | None = None
) -> Request[BatchReordering]:
    """``POST /v1/reorder/batch`` (the arguments of ``Client.reorder_batch``)."""
    body: dict[str, object] = {"items": [dict(item) for item in items]}
    return Request(
        "POST", "/v1/reorder/batch", body, _call_headers(request_id), parse_batch_reordering
    )


def parse_batch_reordering(body: Mapping[str, Any]) -> BatchReordering:
    """A ``BatchReordering`` from the JSON of ``POST /v1/reorder/batch``: each item's
    ``Reordering``, or its error envelope's ``error`` as a ``RagReorderError``."""
    try:
        items = []
        for r in body["results"]:
            status = int(r["status"])
            err = r.get("error")
            error = (
                None
                if status == 200
                else RagReorderError(
                    str(err["message"]),
                    status=status,
                    code=str(err.get("code") or "error"),
                    type=str(err.get("type") or "error"),
                    param=err.get("param"),
                    request_id=err.get("request_id") or r.get("request_id"),
                )
            )
            items.append(
                BatchItem(
                    index=int(r["index"]),
                    request_id=str(r["request_id"]),
                    status=status,
                    reordering=parse_reordering(r["response"]) if status == 200 else None,
                    error=error,
                )
            )
        return BatchReordering(items=tuple(items), raw=body)
    except (KeyError, TypeError, ValueError) as exc:
        raise RagReorderError(
            f"unexpected /v1/reorder/batch response: {exc!r}", code="invalid_response"
        ) from exc


def rerank_request(
    query: str,
    documents: Sequence[str],
    *,
    top_n: int | None = None,
    results_order: ResultsOrder | None = None,
    return_documents: bool = True,
    strategy: Strategy | str | None = None,
    placement: Placement | None = None,
    design: Mapping[str, object] | None = None,
    options: Mapping[str, object] | None = None,
    request_id: str | None = None,
    max_context_tokens: int | None = None,
    context: Mapping[str, object] | None = None,
) -> Request[Reranking]:
    """``POST /v1/rerank`` (the arguments of ``Client.rerank``)."""
    reorder = _options(
        strategy=strategy,
        placement=placement,
        design=design,
        options=options,
        max_context_tokens=max_context_tokens,
        context=context,
    )
    if results_order is not None:
        reorder["results_order"] = results_order
    body: dict[str, object] = {
        "query": query,
        "documents": list(documents),
        "return_documents": return_documents,
    }
    if top_n is not None:
        body["top_n"] = top_n
    if reorder:
        body["reorder"] = reorder
    return Request("POST", "/v1/rerank", body, _call_headers(request_id), parse_reranking)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_reordering(body: Mapping[str, Any]) -> Reordering:
    """A ``Reordering`` from the JSON of ``POST /v1/reorder``."""
    try:
        bias = body.get("position_bias")
        diagnostics = body.get("diagnostics") or {}
        return Reordering(
            id=str(body["id"]),
            model=str(body["model"]),
            strategy=str(body["strategy"]),
            order=tuple(int(i) for i in body["order"]),
            ranking=tuple(int(i) for i in body["ranking"]),
            passages=tuple(
                ScoredPassage(
                    index=int(p["index"]),
                    id=p.get("id"),
                    utility=_opt_float(p.get("utility")),
                    score=_opt_float(p.get("score")),
                    stderr=_opt_float(p.get("stderr")),
                    confidence_above_next=_opt_float(p.get("confidence_above_next")),
                    shown=bool(p.get("shown", True)),
                )
                for p in body["passages"]
            ),
            position_bias=(
                PositionBias(
                    coefficients=tuple(float(c) for c in bias["coefficients"]),
                    identified=bool(bias["identified"]),
                    identification=str(bias.get("identification", "")),
                    orientation=str(bias.get("orientation", "")),
                )
                if bias
                else None
            ),
            placement=diagnostics.get("placement"),
            warnings=tuple(str(w) for w in diagnostics.get("warnings", ())),
            raw=body,
            context=parse_context(body.get("context")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RagReorderError(
            f"unexpected /v1/reorder response: {exc!r}", code="invalid_response"
        ) from exc


def parse_context(ctx: Mapping[str, Any] | None) -> ContextReport | None:
    """The response's ``context`` (None: the request set none, or an older server)."""
    if not ctx:
        return None
    return ContextReport(
        tokens_used=int(ctx["tokens_used"]),
        budget=None if ctx.get("budget") is None else int(ctx["budget"]),
        tokenizer=str(ctx.get("tokenizer", "")),
        tokenizer_is_generator=bool(ctx.get("tokenizer_is_generator", False)),
        dropped=tuple(
            DroppedPassage(
                index=int(d["index"]),
                reason=str(d["reason"]),
                detail=str(d.get("detail", "")),
                into=None if d.get("into") is None else int(d["into"]),
            )
            for d in ctx.get("dropped", ())
        ),
    )


def parse_reranking(body: Mapping[str, Any]) -> Reranking:
    """A ``Reranking`` from the JSON of a rerank route."""
    try:
        meta = body.get("meta") or {}
        reorder = meta.get("reorder") or {}
        return Reranking(
            id=str(body["id"]),
            model=str(body["model"]),
            results=tuple(
                RerankResult(
                    index=int(r["index"]),
                    relevance_score=float(r["relevance_score"]),
                    text=(r.get("document") or {}).get("text"),
                )
                for r in body["results"]
            ),
            # A server older than `results_order` always answered in ranking order.
            results_order="placement" if meta.get("results_order") == "placement" else "ranking",
            order=tuple(int(i) for i in reorder.get("order", ())),
            ranking=tuple(int(i) for i in reorder.get("ranking", ())),
            total_tokens=int((body.get("usage") or {}).get("total_tokens", 0)),
            raw=body,
            context=parse_context(reorder.get("context")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RagReorderError(
            f"unexpected rerank response: {exc!r}", code="invalid_response"
        ) from exc


def parse_json(response: httpx.Response) -> Mapping[str, Any]:
    """The JSON object of a 2xx response; any other response is the service's error."""
    if response.is_success:
        try:
            body = response.json()
        except ValueError as exc:
            raise RagReorderError(
                "the response is not JSON", status=response.status_code, code="invalid_response"
            ) from exc
        if not isinstance(body, dict):
            raise RagReorderError(
                "the response is not a JSON object",
                status=response.status_code,
                code="invalid_response",
            )
        return body
    raise RagReorderError.from_response(response)


def transport_error(exc: httpx.TransportError) -> RagReorderError:
    code = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection_error"
    sent = "" if isinstance(exc, NOT_SENT) else " (the request was sent: not retried)"
    return RagReorderError(f"{type(exc).__name__}: {exc}{sent}", code=code)


def timeout_of(timeout: float | httpx.Timeout) -> httpx.Timeout:
    """A number is the read (and write) timeout; connecting gets at most ``CONNECT_TIMEOUT_S``."""
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))


def tls_context() -> ssl.SSLContext:
    """httpx's default verification context (certifi's CAs, or the ``SSL_CERT_FILE`` or
    ``SSL_CERT_DIR`` it trusts), built once per process and per value of those variables and
    shared by every client the library creates. httpx builds one per client by reading the
    whole CA bundle: 20-90 ms of CPU, which a service that builds an adapter per request paid
    on every request (``clients/python/CHANGELOG.md``). A context is safe to share between
    clients and threads; a caller who needs another passes its own ``http_client``."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _tls_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    # The arguments are the cache's key; httpx reads the same variables itself.
    return httpx.create_ssl_context()


def _error_code(response: httpx.Response) -> str | None:
    """The service's error code in ``response``'s envelope; ``None`` for another body (a
    proxy's or a gateway's page: retried as any 503)."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


class Policy:
    """The connection settings and the retry policy of both clients.

    An attempt's outcome is retried when it is a 429 or a 503 that is not the service's final
    ``engine_unavailable`` (``RETRY_CODES``; after ``Retry-After`` when the
    service sent one, else exponential backoff with full jitter) or a connection error raised
    before the request was sent (``NOT_SENT``), at most ``max_retries`` times. Anything else is
    final: a read timeout is not retried (the service may still be working on the request).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        max_retries: int,
        backoff_s: float,
        max_backoff_s: float,
        headers: Mapping[str, str] | None,
    ) -> None:
        if max_retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("max_retries, backoff_s and max_backoff_s must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout_of(timeout)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # Sent with every request rather than set on the httpx client, so that they also go
        # out through an ``http_client`` the caller supplies.
        self.headers = {"user-agent": f"rag-reorder-python/{__version__}", **(headers or {})}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def headers_of(self, request: Request[Any]) -> dict[str, str]:
        """What ``request`` is sent with: the connection's headers, then the call's own."""
        return {**self.headers, **request.headers}

    def attempts(self) -> range:
        return range(self.max_retries + 1)

    def after_response(self, attempt: int, response: httpx.Response) -> float | None:
        """Seconds to wait before retrying, or None: this response is the answer."""
        if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
            code = _error_code(response)
            if response.status_code == 503 and code is not None and code not in RETRY_CODES:
                return None
            return self.delay(attempt, retry_after(response.headers))
        return None

    def after_error(self, attempt: int, exc: httpx.TransportError) -> float:
        """Seconds to wait before retrying a request that got no response.

        Raises:
            RagReorderError: the error is final (sent already, or the last attempt).
        """
        if isinstance(exc, NOT_SENT) and attempt < self.max_retries:
            return self.delay(attempt, None)
        raise transport_error(exc) from exc

    def delay(self, attempt: int, wait: float | None) -> float:
        """Seconds to wait before retry ``attempt`` (0-based).

        The service's ``Retry-After`` wins (capped at ``max_backoff_s``), with up to 10% added
        so that clients it turned away together do not all come back in the same instant;
        without one, exponential backoff with full jitter (AWS architecture blog, "Exponential
        Backoff And Jitter").
        """
        if wait is not None:
            return min(wait, self.max_backoff_s) * (1.0 + 0.1 * random.random())
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2.0**attempt))
