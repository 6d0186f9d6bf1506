"""Typed HTTP client of a rag-reorder service: ``Client`` (sync) and ``AsyncClient``.

What a RAG backend installs (``pip install rag-reorder-client``): httpx and the standard
library, nothing of the server. It speaks the wire contract of the API reference
(``docs/reference/api.md``) and turns every error envelope
``{"error": {type, message, param, code, request_id}}`` into one exception,
``RagReorderError``.

Timeouts and retries (both clients, ``_protocol.Policy``):

- an attempt waits ``DEFAULT_TIMEOUT_S`` (135 s) for the answer: the service's own deadline
  (120 s by default) plus a margin, so the service's 504 arrives before the client gives up;
  connecting gets 5 s;
- retried, at most ``max_retries`` times: 429 and 503 (after the ``Retry-After`` the service
  or a gateway sent, else exponential backoff with full jitter), and connection errors raised
  before the request was sent (refused, connect timeout, no free connection in the pool);
- not retried: a read timeout or a connection dropped after the request was sent (the
  service may still be scoring it, and a retry would start the whole job again), and every
  other error status. The worst case of one call is one full wait, not ``max_retries + 1``.

The two clients only send: each route is one ``_protocol`` function that builds the whole
request (method, path, body, headers) and names the parser of its answer, and one retry policy
decides what to do with each attempt, so the two cannot behave differently.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self, TypeVar

import anyio
import httpx

from rag_reorder._protocol import (
    DEFAULT_TIMEOUT_S,
    Policy,
    Request,
    reorder_batch_request,
    reorder_item,
    reorder_request,
    rerank_request,
    tls_context,
)
from rag_reorder.types import (
    BatchItem,
    BatchReordering,
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
)

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "BatchItem",
    "BatchReordering",
    "Client",
    "Passage",
    "Placement",
    "PositionBias",
    "RagReorderError",
    "Reordering",
    "RerankResult",
    "Reranking",
    "ResultsOrder",
    "ScoredPassage",
    "Strategy",
    "reorder_item",
]

DEFAULT_BASE_URL = "http://localhost:8000"

T = TypeVar("T")


class Client:
    """Synchronous client of a rag-reorder service.

    Args:
        base_url: the service's root URL (``http://rag-reorder:8000``).
        api_key: sent as ``Authorization: Bearer`` when the service has ``RAG_REORDER_API_KEY``.
        timeout: seconds to wait for an answer (or an ``httpx.Timeout``); keep it above the
            service's deadline (``RAG_REORDER_REQUEST_TIMEOUT_S``, default 120 s).
        max_retries: retries of 429, 503 and connection errors before sending (module
            docstring); 0: none.
        backoff_s: first backoff, doubled per retry, with full jitter.
        max_backoff_s: longest wait between attempts (a longer ``Retry-After`` is capped).
        headers: extra headers on every request.
        http_client: an httpx client to use (its base URL, timeout and transport); the API key,
            user agent and ``headers`` are still sent with every request. The client does not
            close one it did not create.
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
        self._policy = Policy(
            base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s, headers
        )
        self._owned = http_client is None
        self._http = http_client or httpx.Client(
            base_url=self._policy.base_url, timeout=self._policy.timeout, verify=tls_context()
        )

    def reorder(
        self,
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
    ) -> Reordering:
        """``POST /v1/reorder``: the order to put into the prompt, with utilities, position
        bias and confidences.

        Args:
            query: the user's question.
            passages: the retrieved passages, in any order (their indices are the answer's).
            strategy: a strategy of ``/info`` (default: the server's, ``moi`` unless configured).
            placement: ``bias_matched``, ``descending_utility`` or ``litm`` (default: the
                server's).
            design: ``moi``'s permutation design (``{"kind": "pruned_random", "seed": 7}``).
            top_n: keep the ``top_n`` best passages, in their placement order (all are still
                scored). To keep k passages, use it (or ``Reordering.top(k)``), never
                ``order[:k]``: the first slots are not the best passages.
            options: any other option of the native body (``joint``, ``template``, ...).
            request_id: sent as ``X-Request-Id`` (the service logs and echoes it).
            max_context_tokens: the generator's token budget for the passages (docs/context.md):
                ``order`` then holds only the passages that fit, best first by utility, and
                ``Reordering.context`` each dropped one with why. Never exceeded; below the
                best passage's tokens: a 422 ``context_budget_too_small``.
            context: the other context options (``{"distractors": {}}``, ``{"dedup": True}``,
                ``{"order": "document"}`` with ``Passage.source``/``offset``).

        Returns:
            The parsed response; ``raw`` holds the whole body.

        Raises:
            RagReorderError: an error response (after retries, for the transient ones), no
                response, or a response that is not the service's.
        """
        return self._send(
            reorder_request(
                query,
                passages,
                strategy=strategy,
                placement=placement,
                design=design,
                top_n=top_n,
                options=options,
                request_id=request_id,
                max_context_tokens=max_context_tokens,
                context=context,
            )
        )

    def rerank(
        self,
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
    ) -> Reranking:
        """``POST /v1/rerank`` (the Cohere shape); ``results_order="placement"`` returns the
        results in prompt order, and with ``top_n`` the ``top_n`` best in their prompt order
        (``Reranking.top(k)`` does the same on a whole answer; ``results[:k]`` does not).
        Other arguments as ``reorder``.

        Raises:
            RagReorderError: as ``reorder``.
        """
        return self._send(
            rerank_request(
                query,
                documents,
                top_n=top_n,
                results_order=results_order,
                return_documents=return_documents,
                strategy=strategy,
                placement=placement,
                design=design,
                options=options,
                request_id=request_id,
                max_context_tokens=max_context_tokens,
                context=context,
            )
        )

    def reorder_batch(
        self, items: Sequence[Mapping[str, object]], *, request_id: str | None = None
    ) -> BatchReordering:
        """``POST /v1/reorder/batch``: many queries in one call (offline pipelines,
        evaluation). Each item is a native body, built with ``reorder_item`` (the arguments of
        ``reorder``) or written as a dict; the service validates, admits and runs each as one
        request, at most ``RAG_REORDER_BATCH_CONCURRENCY`` at a time.

        Args:
            items: the bodies (at most the server's ``RAG_REORDER_BATCH_MAX_ITEMS``).
            request_id: the batch's ``X-Request-Id``; item i's id is ``<request_id>.<i>``.

        Returns:
            One ``BatchItem`` per item, in order: its ``Reordering`` or its own
            ``RagReorderError`` (a failed item fails alone; per-item 503s are not retried:
            resend ``failed``'s items). Give the client a ``timeout`` above the batch's
            duration: the items run in turns of that many.

        Raises:
            RagReorderError: the whole call failed (an empty list, a batch limit, the server
                not ready after retries, no response).
        """
        return self._send(reorder_batch_request(items, request_id=request_id))

    def _send(self, request: Request[T]) -> T:
        """``request``'s typed answer, after the policy's retries."""
        headers = self._policy.headers_of(request)
        for attempt in self._policy.attempts():
            try:
                response = self._http.request(
                    request.method, request.path, json=request.json, headers=headers
                )
            except httpx.TransportError as exc:
                wait = self._policy.after_error(attempt, exc)
            else:
                retry = self._policy.after_response(attempt, response)
                if retry is None:
                    return request.result(response)
                wait = retry
            time.sleep(wait)
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
        self._policy = Policy(
            base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s, headers
        )
        self._owned = http_client is None
        self._http = http_client or httpx.AsyncClient(
            base_url=self._policy.base_url, timeout=self._policy.timeout, verify=tls_context()
        )

    async def reorder(
        self,
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
    ) -> Reordering:
        """``POST /v1/reorder``; see ``Client.reorder``."""
        return await self._send(
            reorder_request(
                query,
                passages,
                strategy=strategy,
                placement=placement,
                design=design,
                top_n=top_n,
                options=options,
                request_id=request_id,
                max_context_tokens=max_context_tokens,
                context=context,
            )
        )

    async def rerank(
        self,
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
    ) -> Reranking:
        """``POST /v1/rerank``; see ``Client.rerank``."""
        return await self._send(
            rerank_request(
                query,
                documents,
                top_n=top_n,
                results_order=results_order,
                return_documents=return_documents,
                strategy=strategy,
                placement=placement,
                design=design,
                options=options,
                request_id=request_id,
                max_context_tokens=max_context_tokens,
                context=context,
            )
        )

    async def reorder_batch(
        self, items: Sequence[Mapping[str, object]], *, request_id: str | None = None
    ) -> BatchReordering:
        """``POST /v1/reorder/batch``, as ``Client.reorder_batch``.

        Raises:
            RagReorderError: as ``Client.reorder_batch``.
        """
        return await self._send(reorder_batch_request(items, request_id=request_id))

    async def _send(self, request: Request[T]) -> T:
        """``Client._send``, awaiting the transport and the waits."""
        headers = self._policy.headers_of(request)
        for attempt in self._policy.attempts():
            try:
                response = await self._http.request(
                    request.method, request.path, json=request.json, headers=headers
                )
            except httpx.TransportError as exc:
                wait = self._policy.after_error(attempt, exc)
            else:
                retry = self._policy.after_response(attempt, response)
                if retry is None:
                    return request.result(response)
                wait = retry
            await anyio.sleep(wait)
        raise AssertionError("unreachable")  # the last attempt returns or raises

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
