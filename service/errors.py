"""Domain errors, split client/server. ``app`` maps each class to one HTTP status in one table."""

from __future__ import annotations


class ReorderError(Exception):
    """Base of every error the service raises on purpose."""

    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ClientError(ReorderError):
    """The request cannot be served as asked; retrying it unchanged will fail again."""

    code = "invalid_request"


class InvalidRequest(ClientError):
    code = "invalid_request"


class LimitExceeded(ClientError):
    """An input is over a configured limit; the message names the parameter, limit and value."""

    code = "limit_exceeded"

    def __init__(self, param: str, limit: int | float, value: int | float, what: str = "") -> None:
        detail = f" ({what})" if what else ""
        super().__init__(f"{param} is {value}, over the limit of {limit}{detail}", param=param)
        self.limit = limit
        self.value = value


class DeadlineUnreachable(LimitExceeded):
    """The request's estimated work cannot finish by its deadline even on an idle engine
    (issue 62): ``limit`` is the seconds it may use, ``value`` the seconds estimated; the
    message says what would fit. Retrying it unchanged is refused again."""

    code = "deadline_unreachable"

    def __init__(self, param: str, limit: float, value: float, message: str) -> None:
        super().__init__(param, limit, value)
        self.message = message
        self.args = (message,)


class NotFound(ClientError):
    """A named resource (a bias profile) does not exist."""

    code = "not_found"


class AlreadyReported(ClientError):
    """A served request was already reported on (``POST /v1/feedback``: one report per id)."""

    code = "already_reported"


class UnidentifiableRequest(ClientError):
    """The chosen design cannot identify what the fit needs (e.g. cyclic without a profile)."""

    code = "unidentifiable_design"


class ServerError(ReorderError):
    """The service failed; the same request may succeed later."""

    code = "internal_error"


class BackendUnavailable(ServerError):
    code = "backend_unavailable"


class ScoringFailed(ServerError):
    """Too many prompts failed to leave an identifiable design."""

    code = "scoring_failed"


class EngineUnavailable(BackendUnavailable):
    """The remote inference server cannot be reached or refuses work; retry later."""

    code = "engine_unavailable"


class EngineTimeout(ServerError):
    """The remote inference server accepted a call and did not answer within its timeout."""

    code = "engine_timeout"


class EngineMismatch(ServerError):
    """The remote inference server serves another model or tokenizer than configured; a
    configuration error found at start-up, fatal."""

    code = "engine_mismatch"


class StateUnavailable(ServerError):
    """The shared state store (Redis) cannot be reached; what needs its contents now (a
    calibration from the pooled traffic sample) can be retried later. Requests never see it:
    they are served from what the replica holds."""

    code = "state_unavailable"
