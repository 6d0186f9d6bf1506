"""What a request is refused or stopped with on its way to the engine: not ready (503), no
room (503 + Retry-After), its deadline passed (504), its client gone. ``app.errors`` maps them
to HTTP with the rest of the error table."""

from __future__ import annotations

from service.errors import ClientError, ServerError


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


class Draining(NotReady):
    code = "draining"


class Unhealthy(NotReady):
    """The engine is dead or its canary keeps failing: liveness fails, the process exits."""

    code = "unhealthy"
