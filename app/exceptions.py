"""Errors that only exist at the HTTP edge; ``app.errors`` maps them with the domain's."""

from __future__ import annotations

from service.errors import ClientError, ServerError


class PayloadTooLarge(ClientError):
    code = "body_too_large"


class Unauthorized(ClientError):
    code = "invalid_api_key"


class WritesClosed(ClientError):
    """A route that writes what later requests get, on a server with no admin key."""

    code = "writes_closed"


class RouteNotFound(ClientError):
    code = "not_found"


class MethodNotAllowed(ClientError):
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allow = allow
        """The methods the path answers: the response's ``Allow`` header (RFC 9110, 15.5.6)."""


class MalformedRequest(ClientError):
    """The body could not be read as a request at all (not UTF-8, not JSON)."""

    code = "malformed_request"


class ValidationFailed(ClientError):
    """The body does not match the route's schema."""

    code = "validation_error"


class ClientDisconnected(ClientError):
    """The client went away; the response is never seen, but it is counted and logged."""

    code = "client_disconnected"


class Overloaded(ServerError):
    """Admission refused the request (concurrency, in-flight token budget, or a deadline the
    queue ahead would not let it meet)."""

    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Seconds until it would be admitted, when admission can estimate them (else the
        configured ``retry_after_s``)."""


class NotReady(ServerError):
    """Loading, warming up, draining or unhealthy."""

    code = "not_ready"


class DeadlineExceeded(ServerError):
    code = "deadline_exceeded"


class MissingApiKey(Unauthorized):
    code = "missing_api_key"


class Draining(NotReady):
    code = "draining"


class Unhealthy(NotReady):
    """The engine is dead or its canary keeps failing: liveness fails, the process exits."""

    code = "unhealthy"
