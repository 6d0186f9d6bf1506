"""Typed HTTP client of a rag-reorder service: ``Client`` (sync) and ``AsyncClient``.

What a RAG backend installs: it imports nothing of the server (only httpx and the standard
library), so it speaks the wire contract of ``docs/api.md`` and nothing else. Both clients
retry what the service says is transient (503 with ``Retry-After`` while loading, draining or
over its admission limits; 429 from a gateway in front of it; connection errors and timeouts)
with exponential backoff and jitter, and turn every error envelope
``{"error": {type, message, param, code, request_id}}`` into one exception, ``RagReorderError``.

Reordering is a pure function of the request, so retrying a POST is safe.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import httpx

from rag_reorder._version import __version__

Placement = Literal["descending_utility", "bias_matched"]
ResultsOrder = Literal["ranking", "placement"]

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 120.0
"""The service's own default deadline (`RAG_REORDER_REQUEST_TIMEOUT_S`) is 120 s."""
RETRY_STATUSES = frozenset({429, 503})


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
        retry_after = _retry_after(response)
        try:
            err = response.json()["error"]
            return cls(
                str(err["message"]),
                status=response.status_code,
                code=str(err.get("code") or "error"),
                type=str(err.get("type") or "error"),
                param=err.get("param"),
                request_id=err.get("request_id") or response.headers.get("x-request-id"),
                retry_after=retry_after,
            )
        except (ValueError, KeyError, TypeError):
            return cls(
                f"HTTP {response.status_code} {response.reason_phrase}".strip(),
                status=response.status_code,
                code="http_error",
                request_id=response.headers.get("x-request-id"),
                retry_after=retry_after,
            )


@dataclass(frozen=True, slots=True)
class Passage:
    """A retrieved passage to send (a bare ``str`` is a passage with only a text)."""

    text: str
    title: str | None = None
    id: str | None = None
    score: float | None = None
    """The retriever's score (optional): variable pruning, ties and never-shown passages use it."""


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

    def passage(self, index: int) -> ScoredPassage:
        """The scored passage with this input index."""
        for p in self.passages:
            if p.index == index:
                return p
        raise KeyError(index)

    def rank(self, index: int) -> int:
        """The 0-based rank of the passage with this input index (0: best)."""
        return self.ranking.index(index)


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


# --- request bodies and responses (shared by both clients) ------------------------------


def _passage_json(p: str | Passage) -> str | dict[str, object]:
    if isinstance(p, str):
        return p
    out: dict[str, object] = {"text": p.text}
    for key in ("title", "id", "score"):
        value = getattr(p, key)
        if value is not None:
            out[key] = value
    return out


def _options(
    *,
    strategy: str | None,
    placement: Placement | None,
    design: Mapping[str, object] | None,
    options: Mapping[str, object] | None,
) -> dict[str, object]:
    # Only what the caller set: everything else takes the server's configured default.
    out: dict[str, object] = dict(options or {})
    if strategy is not None:
        out["strategy"] = strategy
    if placement is not None:
        out["placement"] = placement
    if design is not None:
        out["design"] = dict(design)
    return out


def reorder_body(
    query: str,
    passages: Sequence[str | Passage],
    *,
    strategy: str | None = None,
    placement: Placement | None = None,
    design: Mapping[str, object] | None = None,
    top_n: int | None = None,
    options: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The JSON body of ``POST /v1/reorder`` (see ``Client.reorder``)."""
    body: dict[str, object] = {
        "query": query,
        "passages": [_passage_json(p) for p in passages],
        **_options(strategy=strategy, placement=placement, design=design, options=options),
    }
    if top_n is not None:
        body["top_n"] = top_n
    return body


def rerank_body(
    query: str,
    documents: Sequence[str],
    *,
    top_n: int | None = None,
    results_order: ResultsOrder | None = None,
    return_documents: bool = True,
    strategy: str | None = None,
    placement: Placement | None = None,
    design: Mapping[str, object] | None = None,
    options: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The JSON body of ``POST /v1/rerank`` (see ``Client.rerank``)."""
    reorder = _options(strategy=strategy, placement=placement, design=design, options=options)
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
    return body


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
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RagReorderError(
            f"unexpected /v1/reorder response: {exc!r}", code="invalid_response"
        ) from exc


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
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RagReorderError(
            f"unexpected rerank response: {exc!r}", code="invalid_response"
        ) from exc


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds: a number or an HTTP date (RFC 9110 10.2.3)."""
    value = response.headers.get("retry-after")
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


def _json(response: httpx.Response) -> Mapping[str, Any]:
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


def _transport_error(exc: httpx.TransportError) -> RagReorderError:
    code = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection_error"
    return RagReorderError(f"{type(exc).__name__}: {exc}", code=code)


class _Config:
    """What both clients share: the connection settings and the retry schedule."""

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
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.headers = {"user-agent": f"rag-reorder-python/{__version__}", **(headers or {})}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``attempt`` (0-based).

        The service's ``Retry-After`` wins (capped at ``max_backoff_s``), with up to 10% added
        so that clients it turned away together do not all come back in the same instant;
        without one, exponential backoff with full jitter (AWS architecture blog, "Exponential
        Backoff And Jitter").
        """
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s) * (1.0 + 0.1 * random.random())
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2.0**attempt))

    @staticmethod
    def request_headers(request_id: str | None) -> dict[str, str]:
        return {"x-request-id": request_id} if request_id else {}


class Client:
    """Synchronous client of a rag-reorder service.

    Args:
        base_url: the service's root URL (``http://rag-reorder:8000``).
        api_key: sent as ``Authorization: Bearer`` when the service has ``RAG_REORDER_API_KEY``.
        timeout: seconds per attempt (or an ``httpx.Timeout``); keep it above the service's
            ``request_timeout_s`` so the service's 504 arrives before the client gives up.
        max_retries: retries after the first attempt on 429, 503, connection errors and
            timeouts (0: none).
        backoff_s: first backoff, doubled per retry, with full jitter.
        max_backoff_s: longest wait between attempts (a longer ``Retry-After`` is capped).
        headers: extra headers on every request.
        http_client: an ``httpx.Client`` to use (its own base URL, timeout and transport);
            the client does not close one it did not create.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self._config = _Config(
            base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s, headers
        )
        self._owned = http_client is None
        self._http = http_client or httpx.Client(
            base_url=self._config.base_url,
            timeout=self._config.timeout,
            headers=self._config.headers,
        )

    def reorder(
        self,
        query: str,
        passages: Sequence[str | Passage],
        *,
        strategy: str | None = None,
        placement: Placement | None = None,
        design: Mapping[str, object] | None = None,
        top_n: int | None = None,
        options: Mapping[str, object] | None = None,
        request_id: str | None = None,
    ) -> Reordering:
        """``POST /v1/reorder``: the order to put into the prompt, with utilities, position
        bias and confidences.

        Args:
            query: the user's question.
            passages: the retrieved passages, in any order (their indices are the answer's).
            strategy: a strategy of ``/info`` (default: the server's, ``moi`` unless configured).
            placement: ``bias_matched`` or ``descending_utility`` (default: the server's).
            design: ``moi``'s permutation design (``{"kind": "pruned_random", "seed": 7}``).
            top_n: keep the ``top_n`` best passages in ``order`` (all are still scored).
            options: any other option of the native body (``joint``, ``template``, ...).
            request_id: sent as ``X-Request-Id`` (the service logs and echoes it).

        Returns:
            The parsed response; ``raw`` holds the whole body.

        Raises:
            RagReorderError: an error response (after retries, for the transient ones), no
                response, or a response that is not the service's.
        """
        body = reorder_body(
            query,
            passages,
            strategy=strategy,
            placement=placement,
            design=design,
            top_n=top_n,
            options=options,
        )
        return parse_reordering(self._post("/v1/reorder", body, request_id))

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        results_order: ResultsOrder | None = None,
        return_documents: bool = True,
        strategy: str | None = None,
        placement: Placement | None = None,
        design: Mapping[str, object] | None = None,
        options: Mapping[str, object] | None = None,
        request_id: str | None = None,
    ) -> Reranking:
        """``POST /v1/rerank`` (the Cohere shape); ``results_order="placement"`` returns the
        results in prompt order. Other arguments as ``reorder``.

        Raises:
            RagReorderError: as ``reorder``.
        """
        body = rerank_body(
            query,
            documents,
            top_n=top_n,
            results_order=results_order,
            return_documents=return_documents,
            strategy=strategy,
            placement=placement,
            design=design,
            options=options,
        )
        return parse_reranking(self._post("/v1/rerank", body, request_id))

    def _post(
        self, path: str, body: Mapping[str, object], request_id: str | None
    ) -> Mapping[str, Any]:
        config = self._config
        headers = config.request_headers(request_id)
        for attempt in range(config.max_retries + 1):
            last = attempt == config.max_retries
            try:
                response = self._http.post(path, json=body, headers=headers)
            except httpx.TransportError as exc:
                if last:
                    raise _transport_error(exc) from exc
                time.sleep(config.delay(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and not last:
                time.sleep(config.delay(attempt, _retry_after(response)))
                continue
            return _json(response)
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def close(self) -> None:
        """Close the connection pool (if this client created it)."""
        if self._owned:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """Asynchronous client of a rag-reorder service: ``Client``'s API with ``await``.

    Args are ``Client``'s; ``http_client`` is an ``httpx.AsyncClient``. Use it as
    ``async with AsyncClient(...) as client`` or call ``aclose()``; its connections belong to
    the event loop that opened them.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._config = _Config(
            base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s, headers
        )
        self._owned = http_client is None
        self._http = http_client or httpx.AsyncClient(
            base_url=self._config.base_url,
            timeout=self._config.timeout,
            headers=self._config.headers,
        )

    async def reorder(
        self,
        query: str,
        passages: Sequence[str | Passage],
        *,
        strategy: str | None = None,
        placement: Placement | None = None,
        design: Mapping[str, object] | None = None,
        top_n: int | None = None,
        options: Mapping[str, object] | None = None,
        request_id: str | None = None,
    ) -> Reordering:
        """``POST /v1/reorder``; see ``Client.reorder``."""
        body = reorder_body(
            query,
            passages,
            strategy=strategy,
            placement=placement,
            design=design,
            top_n=top_n,
            options=options,
        )
        return parse_reordering(await self._post("/v1/reorder", body, request_id))

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        results_order: ResultsOrder | None = None,
        return_documents: bool = True,
        strategy: str | None = None,
        placement: Placement | None = None,
        design: Mapping[str, object] | None = None,
        options: Mapping[str, object] | None = None,
        request_id: str | None = None,
    ) -> Reranking:
        """``POST /v1/rerank``; see ``Client.rerank``."""
        body = rerank_body(
            query,
            documents,
            top_n=top_n,
            results_order=results_order,
            return_documents=return_documents,
            strategy=strategy,
            placement=placement,
            design=design,
            options=options,
        )
        return parse_reranking(await self._post("/v1/rerank", body, request_id))

    async def _post(
        self, path: str, body: Mapping[str, object], request_id: str | None
    ) -> Mapping[str, Any]:
        config = self._config
        headers = config.request_headers(request_id)
        for attempt in range(config.max_retries + 1):
            last = attempt == config.max_retries
            try:
                response = await self._http.post(path, json=body, headers=headers)
            except httpx.TransportError as exc:
                if last:
                    raise _transport_error(exc) from exc
                await anyio.sleep(config.delay(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and not last:
                await anyio.sleep(config.delay(attempt, _retry_after(response)))
                continue
            return _json(response)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close the connection pool (if this client created it)."""
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
