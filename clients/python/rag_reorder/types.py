"""The wire contract's types: the names the service accepts, what a client sends, what it gets
back, and the one exception for every failure.

The names (``Strategy``, ``Placement``, ``DesignKind``, ``ResultsOrder``) are the enums of the
service's OpenAPI document; the client's tests compare them with a running server's
``/openapi.json``, so the two cannot drift.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import httpx

Strategy = Literal[
    "moi",
    "auto",
    "query_likelihood",
    "convex_score",
    "lore",
    "min_distraction",
    "max_relevance",
    "retriever",
    "inverse",
    "shuffle",
    "litm",
    "bayes_saliency",
    "query_generation",
    "longllmlingua",
    "self_consistency",
    "bm25",
    "dense",
]
"""How the service judges the passages (``GET /info`` lists the ones a deployment serves)."""
Placement = Literal["descending_utility", "bias_matched", "litm"]
"""How a ranking goes into the prompt: ``bias_matched`` (the k-th best passage into the slot
the generator weights k-th most), ``descending_utility`` (best first) or ``litm`` (best at both
ends, "lost in the middle")."""
DesignKind = Literal["random", "cyclic", "pruned_random", "pruned_cyclic", "hybrid", "adaptive"]
"""MoI's permutation design (the server's default: ``adaptive``)."""
ResultsOrder = Literal["ranking", "placement"]
"""The order of a rerank route's ``results``: best first, or the prompt order."""


class Design(TypedDict, total=False):
    """MoI's permutation design (``design`` of ``POST /v1/reorder``); absent keys take the
    server's defaults."""

    kind: DesignKind
    num_prompts: int
    prompt_passages: int
    seed: int
    variable_pruning: bool
    stop_confidence: float
    """``adaptive`` only: stop once the top passage is above every other with this
    probability (the server's default 0.9)."""


def retry_after(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds: a number or an HTTP date (RFC 9110, section 10.2.3)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (ValueError, TypeError, IndexError):  # neither form: as if it were absent
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


class RagReorderError(Exception):
    """Any failure of a call: an error response of the service, or no response at all.

    Attributes:
        status: HTTP status, or None when no response came (connection error, timeout).
        code: the envelope's ``code`` (``validation_error``, ``limit_exceeded``,
            ``overloaded``, ...), or ``connection_error`` / ``timeout`` / ``invalid_response``.
        type: the envelope's ``type`` (``invalid_request_error``, ``overloaded_error``, ...).
        message: the service's message (sanitised by the service; no tracebacks).
        param: the request field at fault (``documents[2]``, ``design.kind``), if any.
        request_id: the service's request id (also in its logs), if any.
        retry_after: seconds the service asked to wait (503), if it said.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        type: str = "error",  # the envelope's field name, as the attribute
        param: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.type = type
        self.param = param
        self.request_id = request_id
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f" ({self.param})" if self.param else ""
        status = f"{self.status} " if self.status is not None else ""
        return f"{status}{self.code}{where}: {self.message}"

    @classmethod
    def from_response(cls, response: httpx.Response) -> RagReorderError:
        """The error of a non-2xx response: its envelope, or the status line if it has none
        (a proxy's HTML page, an empty body)."""
        wait = retry_after(response.headers)
        try:
            err = response.json()["error"]
            return cls(
                str(err["message"]),
                status=response.status_code,
                code=str(err.get("code") or "error"),
                type=str(err.get("type") or "error"),
                param=err.get("param"),
                request_id=err.get("request_id") or response.headers.get("x-request-id"),
                retry_after=wait,
            )
        except (ValueError, KeyError, TypeError):
            return cls(
                f"HTTP {response.status_code} {response.reason_phrase}".strip(),
                status=response.status_code,
                code="http_error",
                request_id=response.headers.get("x-request-id"),
                retry_after=wait,
            )


@dataclass(frozen=True, slots=True)
class Passage:
    """A retrieved passage to send (a bare ``str`` is a passage with only a text)."""

    text: str
    title: str | None = None
    id: str | None = None
    score: float | None = None
    """The retriever's score (optional): variable pruning, ties and never-shown passages use it,
    and the ``retriever`` strategy orders by it."""
    source: str | None = None
    """The document it was cut from: ``context={"order": "document"}`` keeps one source's
    passages together, in ``offset`` order."""
    offset: int | None = None
    """Where in its source it starts (characters, chunk number: any non-negative integer)."""


@dataclass(frozen=True, slots=True)
class DroppedPassage:
    """A passage the service left out of the context (``context.dropped[]``), and why."""

    index: int
    """Its position in the request's passages."""
    reason: str
    """``budget``, ``distractor``, ``duplicate`` or ``top_n``."""
    detail: str
    into: int | None = None
    """``duplicate``: the kept passage it merged into."""


@dataclass(frozen=True, slots=True)
class ContextReport:
    """What went into the prompt (the response's ``context``, with the request's
    ``max_context_tokens`` or ``context``): tokens and budget, who counted, and each drop."""

    tokens_used: int
    budget: int | None
    tokenizer: str
    tokenizer_is_generator: bool
    dropped: tuple[DroppedPassage, ...]

    def reason(self, index: int) -> str | None:
        """Why the passage with this input index was dropped (None: it was kept)."""
        for d in self.dropped:
            if d.index == index:
                return d.reason
        return None


@dataclass(frozen=True, slots=True)
class ScoredPassage:
    """One passage as the service judged it (``passages[]`` of ``POST /v1/reorder``)."""

    index: int
    """Its position in the request's ``passages``."""
    id: str | None
    utility: float | None
    """``moi``: debiased utility; None for other strategies and never-shown passages."""
    score: float | None
    """The strategy's own score (higher is better), if it has one."""
    stderr: float | None
    confidence_above_next: float | None
    """``moi``: probability that it truly beats the next passage of ``ranking``."""
    shown: bool


@dataclass(frozen=True, slots=True)
class PositionBias:
    """The fitted weight of each slot of the scoring prompts (``moi`` only)."""

    coefficients: tuple[float, ...]
    identified: bool
    identification: str
    orientation: str


def best_in_placement(order: tuple[int, ...], ranking: tuple[int, ...], k: int) -> list[int]:
    """The ``k`` best of ``ranking``, in the order they have in ``order``: what the service's
    ``top_n`` returns. Not ``order[:k]``: under ``bias_matched`` with a recency bias the first
    slots hold the weakest passages."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    best = set(ranking[:k])
    return [i for i in order if i in best]


@dataclass(frozen=True, slots=True)
class Reordering:
    """``POST /v1/reorder``'s answer: the order to put into the prompt and why."""

    id: str
    model: str
    strategy: str
    order: tuple[int, ...]
    """Passage indices in prompt order, slot 0 first (with ``top_n``: the ``top_n`` best, in
    their placement order)."""
    ranking: tuple[int, ...]
    """All passage indices by the strategy's judgement, best first."""
    passages: tuple[ScoredPassage, ...]
    """Every passage, in ``ranking`` order."""
    position_bias: PositionBias | None
    placement: str | None
    """The placement applied (``moi``)."""
    warnings: tuple[str, ...]
    raw: Mapping[str, object] = field(repr=False, compare=False)
    """The whole response body, for the fields not lifted into this class."""
    context: ContextReport | None = None
    """With ``max_context_tokens`` or ``context``: ``order`` holds only the kept passages, and
    this says what was dropped and why."""

    def passage(self, index: int) -> ScoredPassage:
        """The scored passage with this input index."""
        for p in self.passages:
            if p.index == index:
                return p
        raise KeyError(index)

    def rank(self, index: int) -> int:
        """The 0-based rank of the passage with this input index (0: best)."""
        return self.ranking.index(index)

    def top(self, k: int) -> list[int]:
        """The ``k`` best passages in prompt order, as the request's ``top_n=k`` would have
        answered: never ``order[:k]``, which keeps the first slots, not the best passages."""
        return best_in_placement(self.order, self.ranking, k)


@dataclass(frozen=True, slots=True)
class RerankResult:
    index: int
    relevance_score: float
    text: str | None


@dataclass(frozen=True, slots=True)
class Reranking:
    """A rerank route's answer (the Cohere shape) with its ``meta``."""

    id: str
    model: str
    results: tuple[RerankResult, ...]
    results_order: ResultsOrder
    """``ranking`` (best first) or ``placement`` (prompt order): the order of ``results``."""
    order: tuple[int, ...]
    """``meta.reorder.order``: the placement."""
    ranking: tuple[int, ...]
    total_tokens: int
    raw: Mapping[str, object] = field(repr=False, compare=False)
    context: ContextReport | None = None
    """With ``max_context_tokens`` or ``context``: ``results`` hold only the kept documents,
    and this says what was dropped and why (``meta.reorder.context``)."""

    def top(self, k: int) -> list[RerankResult]:
        """The results of the ``k`` best documents, in prompt order (``top_n=k`` in the
        request does the same on the server): the safe way to keep ``k`` of a placement."""
        by_index = {r.index: r for r in self.results}
        return [by_index[i] for i in best_in_placement(self.order, self.ranking, k)]


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One item's outcome in ``POST /v1/reorder/batch``'s answer, at its index: its
    ``Reordering`` (status 200) or its ``RagReorderError`` (any other status)."""

    index: int
    request_id: str
    status: int
    reordering: Reordering | None
    error: RagReorderError | None

    @property
    def ok(self) -> bool:
        return self.reordering is not None

    def result(self) -> Reordering:
        """The item's ``Reordering``.

        Raises:
            RagReorderError: the item's own error.
        """
        if self.reordering is None:
            assert self.error is not None
            raise self.error
        return self.reordering


@dataclass(frozen=True, slots=True)
class BatchReordering:
    """``POST /v1/reorder/batch``'s answer: one ``BatchItem`` per item, in the items' order.
    An item that failed (an invalid option, a limit, a 503 from the queue) fails alone."""

    items: tuple[BatchItem, ...]
    raw: Mapping[str, object] = field(repr=False, compare=False)

    @property
    def failed(self) -> list[BatchItem]:
        """The items answered with an error (``retry_after`` set on a 503 worth retrying)."""
        return [item for item in self.items if not item.ok]

    def results(self) -> list[Reordering]:
        """Every item's ``Reordering``, in order.

        Raises:
            RagReorderError: the first failed item's error.
        """
        return [item.result() for item in self.items]
