"""The one table from errors to HTTP: status, envelope type, headers; and the handlers.

Every error response, from middleware, routes or the catch-all, is built by ``error_response``
from a ``ReorderError``, so the envelope ``{"error": {type, message, param, code,
request_id}}`` is the same everywhere and each failure is counted once in the metrics.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from app.exceptions import (
    MalformedRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    Unauthorized,
    ValidationFailed,
    WritesClosed,
)
from app.schemas.base import NOT_BLANK, ErrorEnvelope, ErrorType
from service.errors import (
    AlreadyReported,
    BackendUnavailable,
    ClientError,
    EngineTimeout,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    ReorderError,
    ScoringFailed,
    ServerError,
    StateUnavailable,
    UnidentifiableRequest,
)
from serving.admission.errors import ClientDisconnected, DeadlineExceeded, NotReady, Overloaded
from serving.context import context_of, request_id_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: ErrorType
    retry_after: bool = False


# The table. Looked up along the exception's MRO, so the most specific class wins and any
# other ClientError/ServerError still maps somewhere sensible.
ERROR_TABLE: Final[Mapping[type[ReorderError], ErrorKind]] = {
    PayloadTooLarge: ErrorKind(413, "request_too_large"),
    Unauthorized: ErrorKind(401, "authentication_error"),
    WritesClosed: ErrorKind(403, "permission_error"),
    RouteNotFound: ErrorKind(404, "not_found_error"),
    NotFound: ErrorKind(404, "not_found_error"),
    AlreadyReported: ErrorKind(409, "invalid_request_error"),
    MethodNotAllowed: ErrorKind(405, "invalid_request_error"),
    MalformedRequest: ErrorKind(400, "invalid_request_error"),
    ValidationFailed: ErrorKind(422, "invalid_request_error"),
    LimitExceeded: ErrorKind(422, "invalid_request_error"),
    UnidentifiableRequest: ErrorKind(422, "invalid_request_error"),
    InvalidRequest: ErrorKind(422, "invalid_request_error"),
    # 499 is nginx's "client closed request": never received, but visible in logs and metrics.
    ClientDisconnected: ErrorKind(499, "client_closed_request"),
    ClientError: ErrorKind(422, "invalid_request_error"),
    Overloaded: ErrorKind(503, "overloaded_error", retry_after=True),
    NotReady: ErrorKind(503, "unavailable_error", retry_after=True),
    BackendUnavailable: ErrorKind(503, "unavailable_error", retry_after=True),
    StateUnavailable: ErrorKind(503, "unavailable_error", retry_after=True),
    DeadlineExceeded: ErrorKind(504, "timeout_error"),
    EngineTimeout: ErrorKind(504, "timeout_error"),
    ScoringFailed: ErrorKind(502, "server_error"),
    ServerError: ErrorKind(500, "server_error"),
    ReorderError: ErrorKind(500, "server_error"),
}

# Documented on every route that can return them (OpenAPI `responses`).
_DESCRIPTIONS: Final[Mapping[int, str]] = {
    400: "The body is not JSON or not UTF-8.",
    401: "Missing or wrong API key (when one is configured).",
    403: "A route that writes what every later request gets (a bias profile calibration, "
    "feedback) on a server with no admin key and `open_writes` off.",
    404: "No such resource (a bias profile id that is not stored; a served request no longer "
    "kept for feedback, or feedback off).",
    409: "A served request already reported on (`POST /v1/feedback`: one report per id).",
    413: "Request body over `max_body_bytes`.",
    422: "Schema violation (bounded echo of the value), a limit (param, limit, value), a "
    "design that cannot identify the fit, or `deadline_unreachable`: the request's estimated "
    "work exceeds its deadline even on an idle engine (limit: usable seconds, value: the "
    "estimate).",
    500: "Internal error; the body carries the request id, never a traceback.",
    502: "Too many prompts failed to score for the rest to identify the fit.",
    503: "Not ready, draining, or admission refused (too many requests, or the queue ahead would "
    "not let this one finish within its deadline); retry after `Retry-After` seconds.",
    504: "The request's deadline (`request_timeout_s`) passed, or a remote engine did not answer "
    "within `engine_timeout_s`; its scoring was cancelled.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these statuses, all with the error envelope."""
    return {s: {"model": ErrorEnvelope, "description": _DESCRIPTIONS[s]} for s in statuses}


POST_ERRORS: Final = error_responses(400, 401, 413, 422, 500, 502, 503, 504)
GET_ERRORS: Final = error_responses(401, 500)
PROBE_ERRORS: Final = error_responses(503)

_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.\-]+/)+[\w.\-]*")
_MAX_MESSAGE = 1000


def classify(exc: ReorderError) -> ErrorKind:
    for cls in type(exc).__mro__:
        kind = ERROR_TABLE.get(cls)
        if kind is not None:
            return kind
    return ERROR_TABLE[ReorderError]


def sanitise(message: str) -> str:
    """No file system paths and a bounded length in anything a client reads."""
    clean = _ABS_PATH.sub("<path>", message)
    return clean if len(clean) <= _MAX_MESSAGE else clean[: _MAX_MESSAGE - 3] + "..."


def error_detail(scope: Scope, exc: ReorderError) -> tuple[ErrorKind, dict[str, Any]]:
    """The envelope's ``error`` object for ``exc`` and its kind; counts it in the app's failure
    metrics. ``error_response`` wraps it; the batch route answers each failed item with it."""
    kind = classify(exc)
    body: dict[str, Any] = {
        "type": kind.type,
        "message": sanitise(exc.message),
        "param": exc.param,
        "code": exc.code,
        "request_id": request_id_of(scope),
    }
    if isinstance(exc, LimitExceeded):
        body["limit"] = exc.limit
        body["value"] = exc.value
    ctx = context_of(scope)
    if ctx is not None:
        ctx.metrics.failures.labels(kind.type, exc.code).inc()
    return kind, body


def error_response(scope: Scope, exc: ReorderError) -> JSONResponse:
    """The envelope response for ``exc``; counts it in the app's failure metrics."""
    kind, body = error_detail(scope, exc)
    rid = request_id_of(scope)
    ctx = context_of(scope)
    headers: dict[str, str] = {}
    if rid is not None:
        headers["X-Request-Id"] = rid
    if kind.retry_after:
        retry = exc.retry_after_s if isinstance(exc, Overloaded) else None
        if retry is None:
            retry = ctx.settings.retry_after_s if ctx is not None else 1
        headers["Retry-After"] = str(retry)
    if kind.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, MethodNotAllowed) and exc.allow:
        headers["Allow"] = ", ".join(exc.allow)
    return JSONResponse({"error": body}, status_code=kind.status, headers=headers)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``("body", "passages", 3, "text")`` -> ``passages[3].text``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _echo(value: Any) -> str:
    """A bounded echo of the offending value: enough to find it, never the whole body."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(exc: RequestValidationError) -> ReorderError:
    errors = list(exc.errors())
    if not errors:
        return ValidationFailed("the request does not match the schema")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return MalformedRequest(
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
        )
    param = _param(tuple(first.get("loc", ())))
    more = f"; and {len(errors) - 1} more error(s)" if len(errors) > 1 else ""
    if first.get("type") == "string_pattern_mismatch" and (
        first.get("ctx", {}).get("pattern") == NOT_BLANK
    ):
        # The pattern spells out every whitespace character: say what it means, with the
        # code the service gave a blank text before the schema said so (invalid_request).
        return InvalidRequest(
            f"{param} is empty: it holds only whitespace (got {_echo(first.get('input'))})" + more,
            param=param,
        )
    msg = str(first.get("msg", "invalid value"))
    if "input" in first and first.get("type") != "missing":
        msg += f" (got {_echo(first['input'])})"
    return ValidationFailed(f"{param or 'body'}: {msg}{more}", param=param)


async def _on_reorder_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ReorderError)
    if isinstance(exc, ServerError) and not isinstance(exc, (NotReady, Overloaded)):
        log.warning(
            "request %s failed: %s (%s)", request_id_of(request.scope), exc.code, exc.message
        )
    return error_response(request.scope, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(request.scope, validation_error(exc))


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err: ReorderError
    if exc.status_code == 404:
        err = RouteNotFound(f"no route {request.url.path}")
    elif exc.status_code == 405:
        allow = _allowed_methods(request)
        err = MethodNotAllowed(
            f"{request.method} is not allowed on {request.url.path}; it answers "
            f"{', '.join(allow) or 'no method'}",
            allow=allow,
        )
    elif exc.status_code < 500:
        # FastAPI raises 400 for a body it cannot decode (e.g. not UTF-8).
        err = MalformedRequest(f"the request body could not be read: {exc.detail}")
    else:
        err = ServerError("internal error")
    return error_response(request.scope, err)


_METHODS: Final = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> tuple[str, ...]:
    """The methods of the route the request's path names, as the app's OpenAPI document lists
    them: of its paths that match, the most specific (the fewest parameters). A path the
    document leaves out (``/docs``) gets the methods some route answers on it.

    Asking every route whether it would take the path with each method (as this did alone
    before) also named a parametrised neighbour's: ``/v1/bias-profiles/calibrate`` (POST)
    answered "GET, POST", the GET being ``/v1/bias-profiles/{profile_id}``'s with
    ``calibrate`` as an id (issue 90; tests/app/test_schema_fuzz.py checks every path).
    """
    path = request.scope["path"]
    documented: dict[str, Any] = request.app.openapi().get("paths", {})
    matching = [t for t in documented if _template_regex(t).fullmatch(path)]
    if matching:
        chosen = min(matching, key=lambda t: t.count("{"))
        listed = {m.upper() for m in documented[chosen]}
        return tuple(m for m in _METHODS if m in listed)
    # Starlette's own ``Allow`` names only the first route whose path matched; a path served
    # by two routes (a GET and a POST) would lose the second. A fresh scope, not the
    # request's: routing has rewritten that one for the route it tried.
    allowed: list[str] = []
    for method in _METHODS:
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "root_path": request.scope.get("root_path", ""),
            "headers": [],
            "query_string": b"",
        }
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return tuple(allowed)


@functools.lru_cache(maxsize=64)
def _template_regex(template: str) -> re.Pattern[str]:
    """An OpenAPI path template (``/v1/bias-profiles/{profile_id}``) as a regex: a parameter
    is one path segment."""
    parts = re.split(r"\{[^}/]+\}", template)
    return re.compile("[^/]+".join(re.escape(p) for p in parts))


def install_error_handlers(app: FastAPI) -> None:
    """Register the table's handlers. Anything else is caught by ``RequestContextMiddleware``."""
    app.add_exception_handler(ReorderError, _on_reorder_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
