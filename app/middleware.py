"""Pure ASGI middleware, outermost first: request context -> body limit -> API key.

Pure ASGI (not ``BaseHTTPMiddleware``) so the body can be counted as it streams in and the
route can still read ``http.disconnect`` from the real ``receive`` to cancel its work.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_response
from app.exceptions import MissingApiKey, PayloadTooLarge, Unauthorized, WritesClosed
from service.errors import ServerError
from service.runtime import tracing
from serving.context import context_of

log = logging.getLogger(__name__)

PROBE_PATHS: Final = frozenset({"/health", "/ready"})
ROUTES: Final = frozenset(
    {
        "/v1/reorder",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/models",
        "/v1/bias-profiles",
        "/v1/bias-profiles/calibrate",
        "/v1/feedback",
        "/info",
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
        "/docs",
    }
)
# Accepted client request ids: short, printable, no separators that could forge log fields.
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


PROFILE_ROUTE: Final = "/v1/bias-profiles/{profile_id}"


def _route_label(path: str) -> str:
    # Unknown paths share one label so scanners cannot blow up the metric's cardinality.
    if path in ROUTES:
        return path
    prefix = "/v1/bias-profiles/"
    if path.startswith(prefix) and "/" not in path[len(prefix) :]:
        return PROFILE_ROUTE
    return "other"


class RequestContextMiddleware:
    """Request id (accepted from ``X-Request-Id`` or generated, echoed), request metrics, and the
    catch-all: an unexpected exception becomes a 500 envelope with the request id and no
    traceback (the traceback goes to the log)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        rid = given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = rid
            await send(message)

        route = _route_label(scope.get("path", ""))
        with (
            tracing.server_span(*_span_of(scope, route, rid)) as span,
            tracing.scope(request_id=rid) as traced,
        ):
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                log.exception("unhandled error in request %s", rid)
                if not response_started:
                    response = error_response(
                        scope, ServerError(f"internal error (request id {rid}); see the server log")
                    )
                    await response(scope, receive, send_with_id)
            finally:
                ctx = context_of(scope)
                if ctx is not None:
                    ctx.metrics.http_requests.labels(route, str(status)).inc()
                    ctx.metrics.request_duration.labels(route).observe(
                        time.perf_counter() - started
                    )
                tracing.end_server_span(span, status, traced)


def _span_of(
    scope: Scope, route: str, rid: str
) -> tuple[str, Mapping[str, str], dict[str, tracing.AttributeValue]]:
    """The server span's name, carrier and attributes (OpenTelemetry's HTTP server semantic
    conventions: ``{method} {http.route}``, the low-cardinality route label, never the raw
    path, as the name); only built when tracing is on."""
    if not tracing.enabled():
        return "", {}, {}
    headers = Headers(scope=scope)
    method = scope.get("method", "GET")
    attributes: dict[str, tracing.AttributeValue] = {
        "http.request.method": method,
        "url.path": scope.get("path", ""),
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
        "rag_reorder.request_id": rid,
    }
    if route != "other":
        attributes["http.route"] = route
    if agent := headers.get("user-agent"):
        attributes["user_agent.original"] = agent
    if client := scope.get("client"):
        attributes["client.address"] = str(client[0])
    return f"{method} {route}", headers, attributes


class BodyLimitMiddleware:
    """413 for a body over ``limit`` bytes, before anything parses it.

    ``Content-Length`` is only a shortcut: the bytes are counted as they arrive (chunked bodies
    have no length, and a declared length can lie to a non-validating server). The body is
    buffered (at most ``limit`` bytes) and replayed; later ``receive`` calls go to the server,
    so ``http.disconnect`` still reaches the route.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: nobody left to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reject(scope, receive, send, size, at_least=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {
            "type": "http.request",
            "body": b"".join(chunks),
            "more_body": False,
        }

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, size: int, *, at_least: bool = False
    ) -> None:
        what = "more than " if at_least else ""
        exc = PayloadTooLarge(
            f"request body is {what}{size} bytes, over the limit of {self.limit} bytes",
            param="body",
        )
        await error_response(scope, exc)(scope, receive, send)


# Writes that change what every later request gets: a calibration stores the profile
# requests are placed by, feedback on a random placement feeds the generator's profile.
ADMIN_PATHS: Final = frozenset({"/v1/bias-profiles/calibrate", "/v1/feedback"})


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but the probes, compared in constant time.

    Keys: ``api_key`` opens every route but ``ADMIN_PATHS`` when an ``admin_key`` is set; the
    admin key opens every route. Without an admin key, ``ADMIN_PATHS`` are refused (403)
    unless ``open_writes``, and then ``api_key`` opens them all; without an ``api_key``, only
    ``ADMIN_PATHS`` need a key. Both sides are hashed first:
    ``hmac.compare_digest`` is constant time only for inputs of equal length, and the digests
    always are, so neither a key nor its length leaks.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_key: str | None = None,
        *,
        open_writes: bool = True,
    ) -> None:
        self.app = app
        self._open_writes = open_writes
        self._user = hashlib.sha256(api_key.encode()).digest() if api_key is not None else None
        self._admin = hashlib.sha256(admin_key.encode()).digest() if admin_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self._admin is None and not self._open_writes and path in ADMIN_PATHS:
            # Fail closed: with no admin key, a write that changes every later request is
            # refused unless the operator opted in (a local quick start), whoever asks.
            closed = WritesClosed(
                f"{path} writes to the bias profile later requests are placed by: set "
                "RAG_REORDER_ADMIN_API_KEY and send it, or RAG_REORDER_OPEN_WRITES=true on a "
                "server only you can reach"
            )
            await error_response(scope, closed)(scope, receive, send)
            return
        admin_only = self._admin is not None and path in ADMIN_PATHS
        accepted = [k for k in (self._admin, None if admin_only else self._user) if k]
        if not admin_only and self._user is None:
            await self.app(scope, receive, send)  # no key for the other routes
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            which = "the admin API key" if admin_only else "Authorization: Bearer <key>"
            exc = MissingApiKey(f"missing API key: send {which}")
            await error_response(scope, exc)(scope, receive, send)
            return
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes sent.
        given = hashlib.sha256(token.strip().encode("latin-1")).digest()
        # Compare with every accepted key (no early exit): the time does not say which matched.
        matched = [hmac.compare_digest(given, k) for k in accepted]
        if not any(matched):
            message = "this route needs the admin API key" if admin_only else "invalid API key"
            await error_response(scope, Unauthorized(message))(scope, receive, send)
            return
        await self.app(scope, receive, send)
