"""What the framework adapters share: the metadata each reordered document carries, the way
they call the service, and the client each opens and owns."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from rag_reorder.client import AsyncClient, Client
from rag_reorder.types import Passage, Reordering

METADATA_PREFIX: Final = "rag_reorder_"
"""Every key the adapters add starts with it, so none clobbers a retriever's own metadata."""
METADATA_KEYS: Final = tuple(
    METADATA_PREFIX + k
    for k in (
        "slot",
        "rank",
        "utility",
        "stderr",
        "confidence_above_next",
        "score",
        "position_bias",
        "placement",
        "strategy",
        "request_id",
        "context_tokens",
        "context_budget",
        "dropped",
    )
)

MetadataValue = int | float | str | list[float] | list[dict[str, object]] | None


def source_of(source: object, offset: object) -> dict[str, Any]:
    """``Passage``'s ``source`` and ``offset`` from a document's metadata, where it has them
    (``context={"order": "document"}`` keeps one source's documents in offset order)."""
    out: dict[str, Any] = {}
    if isinstance(source, str | int) and not isinstance(source, bool) and str(source):
        out["source"] = str(source)
    if isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0:
        out["offset"] = offset
    return out


def placed(result: Reordering) -> list[tuple[int, dict[str, MetadataValue]]]:
    """``(input index, metadata)`` for each passage of ``result.order``, in prompt order.

    ``slot`` is the position in the prompt (0 first), ``rank`` the position in the ranking
    (0 best); ``position_bias`` is the fitted weight of each slot of the scoring prompts
    (fewer slots than passages with a pruned design), the same list on every document.
    With a context budget or options, only the kept passages are returned, and every one
    carries ``context_tokens`` (the kept documents' tokens), ``context_budget`` and
    ``dropped``: each left-out document's input index, ``reason`` (``budget``,
    ``distractor``, ``duplicate``, ``top_n``), ``detail`` and ``into`` (a duplicate's kept
    copy); all three are None without them.
    """
    ctx = result.context
    dropped: list[dict[str, object]] | None = (
        [
            {"index": d.index, "reason": d.reason, "detail": d.detail, "into": d.into}
            for d in ctx.dropped
        ]
        if ctx is not None
        else None
    )
    bias = list(result.position_bias.coefficients) if result.position_bias else None
    scored = {p.index: p for p in result.passages}
    rank = {index: k for k, index in enumerate(result.ranking)}
    out: list[tuple[int, dict[str, MetadataValue]]] = []
    for slot, index in enumerate(result.order):
        p = scored[index]
        meta: dict[str, MetadataValue] = {
            "slot": slot,
            "rank": rank[index],
            "utility": p.utility,
            "stderr": p.stderr,
            "confidence_above_next": p.confidence_above_next,
            "score": p.score,
            "position_bias": list(bias) if bias is not None else None,
            "placement": result.placement,
            "strategy": result.strategy,
            "request_id": result.id,
            "context_tokens": ctx.tokens_used if ctx is not None else None,
            "context_budget": ctx.budget if ctx is not None else None,
            "dropped": [dict(d) for d in dropped] if dropped is not None else None,
        }
        out.append((index, {METADATA_PREFIX + k: v for k, v in meta.items()}))
    return out


class AdapterSettings(Protocol):
    """The connection and request fields every adapter has (its own pydantic fields or
    attributes), read by the helpers below so that the adapters share one way to call."""

    base_url: str
    timeout: float
    max_retries: int
    strategy: Any
    placement: Any
    design: dict[str, Any] | None
    top_n: int | None
    options: dict[str, Any] | None
    max_context_tokens: int | None
    context: dict[str, Any] | None


def client_kwargs(adapter: AdapterSettings, api_key: str | None) -> dict[str, Any]:
    """The ``Client``/``AsyncClient`` arguments of an adapter (its key already resolved)."""
    return {
        "base_url": adapter.base_url,
        "api_key": api_key or None,
        "timeout": adapter.timeout,
        "max_retries": adapter.max_retries,
    }


def request_options(adapter: AdapterSettings, top_n: int | None = None) -> dict[str, Any]:
    """The ``reorder`` options of an adapter; ``top_n`` overrides its own for one call."""
    return {
        "strategy": adapter.strategy,
        "placement": adapter.placement,
        "design": adapter.design,
        "top_n": top_n if top_n is not None else adapter.top_n,
        "options": adapter.options,
        "max_context_tokens": adapter.max_context_tokens,
        "context": adapter.context,
    }


async def reorder_async(
    async_client: AsyncClient | None,
    kwargs: dict[str, Any],
    query: str,
    passages: Sequence[Passage],
    options: dict[str, Any],
) -> Reordering:
    """``AsyncClient.reorder`` through the adapter's client, else a client for this call
    only: its connections would otherwise outlive the caller's event loop."""
    if async_client is not None:
        return await async_client.reorder(query, passages, **options)
    async with AsyncClient(**kwargs) as client:
        return await client.reorder(query, passages, **options)


class OwnedClient:
    """The ``Client`` an adapter opens on its first call and owns, and closes.

    ``close()`` (the adapter's ``close()`` or ``with`` block) closes it; a later call opens a
    new one. An adapter dropped unclosed closes it through a finaliser: the frameworks call no
    teardown hook, and a service that builds an adapter per request would otherwise keep a
    connection (a file descriptor) per request until the garbage collector found each socket.
    A client the caller passes to an adapter never comes here, so it is never closed.
    """

    def __init__(self) -> None:
        # Two threads' first calls must not open two clients, one of them never closed.
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def get(self, kwargs: Callable[[], dict[str, Any]]) -> Client:
        """The open client, opened with ``kwargs()`` on the first call (or after ``close``)."""
        with self._lock:
            if self._client is None:
                client = Client(**kwargs())
                # On the client, not on this object: the finaliser must not keep it alive.
                self._finalizer = weakref.finalize(self, client.close)
                self._client = client
            return self._client

    def close(self) -> None:
        """Close the client, if one is open; idempotent."""
        with self._lock:
            finalizer, self._finalizer, self._client = self._finalizer, None, None
        if finalizer is not None:
            finalizer()  # runs client.close() once, and detaches the finaliser

    def __reduce__(self) -> tuple[type[OwnedClient], tuple[()]]:
        # A copy (copy, deepcopy, pickle) of an adapter opens its own client: connections and
        # a lock cannot be copied, and closing one adapter must not close another's.
        return (OwnedClient, ())
