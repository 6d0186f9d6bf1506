"""Errors that only exist at the HTTP edge; ``app.errors`` maps them with the domain's and the
serving runtime's (``serving.admission.errors``)."""

from __future__ import annotations

from service.errors import ClientError


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


class MissingApiKey(Unauthorized):
    code = "missing_api_key"
