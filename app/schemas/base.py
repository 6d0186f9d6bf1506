"""What every route's wire models share: the absolute caps of the wire types, the
non-blank text pattern, the strict and lenient base models, the passage as every route
takes it (an object or a bare string) and the error envelope.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from service.strategies import strategy_names
from service.strategies.request import Placement

# Absolute caps of the wire types. The configurable limits in Settings are bounded by the same
# numbers (their `le=`), so a limit can be lowered in configuration but never raised past the
# type; above a cap the client still gets a 422 naming the parameter.
MAX_PASSAGES = 4096

MAX_TEXT_CHARS = 1_000_000

MAX_QUERY_CHARS = 100_000

MAX_TITLE_CHARS = 4096

MAX_ID_CHARS = 512

MAX_NUM_PROMPTS = 100_000

MAX_SEED = 2**32 - 1

MAX_ANSWER_TOKENS = 1024

MAX_CALIBRATION_QUERIES = 4096

if TYPE_CHECKING:
    Strategy = str
else:
    # The registry's names, in its order, as the wire type: pydantic validates and documents a
    # Literal (the OpenAPI enum, the 422 listing the values), and the names stay typed once, on
    # their classes (service.strategies). mypy cannot read a Literal built at run time, so it
    # sees the name's type.
    Strategy = Literal[strategy_names()]
"""A registered strategy's name: the accepted values of every `strategy` field."""


def _whitespace_class() -> str:
    """The characters ``str.strip`` removes (``str.isspace``), as a regex class body of
    ``\\uHHHH`` ranges: ECMA 262 (the OpenAPI document's), Rust (pydantic's) and Python read
    it alike, where ``\\s`` differs between them (U+001C-U+001F, U+0085, U+FEFF)."""
    # All of them are in the Basic Multilingual Plane (tests/app/test_schema_text.py).
    spaces = [c for c in range(0x10000) if chr(c).isspace()]
    runs: list[tuple[int, int]] = []
    for c in spaces:
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in runs)


NOT_BLANK = f"[^{_whitespace_class()}]"
"""Pattern of a text with a character that is not whitespace: what the server needs of a
query, a passage and a document (``service.prompting.prompts`` refuses one that strips to nothing),
so the schema says it and a blank one is refused by name before any work."""

QueryText = Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS, pattern=NOT_BLANK)]

PassageText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK)]

PlacementName = Placement

ResultsOrder = Literal["ranking", "placement"]

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "overloaded_error",
    "unavailable_error",
    "timeout_error",
    "client_closed_request",
    "server_error",
]


class _Model(BaseModel):
    # Field docstrings become the OpenAPI descriptions.
    model_config = ConfigDict(use_attribute_docstrings=True)


class _Strict(_Model):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class _Lenient(_Model):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class PassageIn(_Strict):
    """A retrieved passage. A bare JSON string is accepted as ``{"text": ...}``."""

    text: PassageText
    title: str | None = Field(default=None, max_length=MAX_TITLE_CHARS)
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    score: float | None = Field(default=None, allow_inf_nan=False)
    """The retriever's score: variable pruning, ties and never-shown passages use it."""
    source: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """The document this passage was cut from: `context.order` `document` keeps one source's
    passages together, in `offset` order."""
    offset: int | None = Field(default=None, ge=0)
    """Where in its source the passage starts (any unit that sorts: characters, chunk number)."""


def _text_object(value: Any) -> Any:
    return {"text": value} if isinstance(value, str) else value


PassageItem = Annotated[
    PassageIn,
    # The bare string is the passage's text: the same bounds as ``PassageIn.text``.
    BeforeValidator(_text_object, json_schema_input_type=PassageText | PassageIn),
]


class ErrorDetail(_Model):
    type: ErrorType
    message: str
    param: str | None
    code: str
    request_id: str | None
    limit: float | None = None
    """Limit errors only: the configured limit."""
    value: float | None = None
    """Limit errors only: the request's value."""


class ErrorEnvelope(_Model):
    error: ErrorDetail
