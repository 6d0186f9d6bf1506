"""LangChain: ``RagReorderCompressor``, a document compressor that returns the prompt order.

    pip install 'rag-reorder-client[langchain]'

It sends the query and the retrieved documents to a rag-reorder service (``POST /v1/reorder``)
and returns the documents in the order to put into the prompt, each with the fit in its
metadata (keys ``rag_reorder_*``: ``slot``, ``rank``, ``utility``, ``stderr``,
``confidence_above_next``, ``score``, ``position_bias``, ``placement``, ``strategy``,
``request_id``). Use it wherever LangChain takes a ``BaseDocumentCompressor`` (e.g.
``ContextualCompressionRetriever``) or call it in a chain; do not sort its output again, and
to keep k documents set ``top_n=k`` (the k best, placed) rather than cutting its output (the
first slots are not the best documents). The retriever's score, where a document's metadata
holds one (key ``score_key``, default ``"score"``), is sent along: the ``retriever`` strategy
orders by it and MoI uses it for ties and never-shown passages.

Connections: the compressor opens its own ``Client`` on its first call and closes it with
``close()`` or at the end of a ``with`` block; one dropped unclosed is closed when it is
garbage-collected. A ``client`` (or ``async_client``) you pass is used as it is and never
closed: in a service that builds a compressor per request, pass one shared client.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from rag_reorder._adapter import (
    OwnedClient,
    client_kwargs,
    placed,
    reorder_async,
    request_options,
    source_of,
)
from rag_reorder.client import DEFAULT_BASE_URL, DEFAULT_TIMEOUT_S, AsyncClient, Client
from rag_reorder.types import Passage, Placement, Reordering, Strategy

__all__ = ["RagReorderCompressor"]


class RagReorderCompressor(BaseDocumentCompressor):
    """Reorders retrieved documents into the prompt order a rag-reorder service fits.

    Example:
        ```python
        compressor = RagReorderCompressor(base_url="http://rag-reorder:8000", top_n=5)
        docs = compressor.compress_documents(retriever.invoke(question), question)
        ```

    Raises ``rag_reorder.RagReorderError`` when the service answers with an error (after
    retrying 503s) or cannot be reached.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    base_url: str = DEFAULT_BASE_URL
    """Root URL of the rag-reorder service."""
    api_key: SecretStr | None = None
    """The service's API key (`RAG_REORDER_API_KEY`), if it has one."""
    top_n: int | None = Field(default=None, ge=1)
    """Keep the top_n best documents, in their placement order (default: all). The way to keep
    k documents: the first k of a whole placement are its first slots, not the best."""
    strategy: Strategy | None = None
    """Strategy (default: the service's, `moi`)."""
    placement: Placement | None = None
    """`bias_matched`, `descending_utility` or `litm` (default: the service's
    `RAG_REORDER_PLACEMENT`)."""
    score_key: str | None = "score"
    """The metadata key of the retriever's score, sent with each document that has one
    (None: send no scores)."""
    design: dict[str, Any] | None = None
    """MoI's permutation design, e.g. `{"kind": "pruned_random", "seed": 7}`."""
    options: dict[str, Any] | None = None
    """Any other option of the native body (`joint`, `template`, strategy options)."""
    max_context_tokens: int | None = Field(default=None, ge=1)
    """The generator's token budget for the documents: only those that fit are returned (best
    first by utility, then placed), each with `rag_reorder_dropped` listing the left-out ones
    and why (docs/context.md)."""
    context: dict[str, Any] | None = None
    """Other context options: `{"distractors": {}}`, `{"dedup": True}`, `{"order": "document"}`."""
    timeout: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    """Seconds to wait for an answer: above the service's deadline (120 s by default)."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of 503/429 and of connection errors before sending, with backoff (a read
    timeout is not retried: the service may still be working on the request)."""
    client: Client | None = Field(default=None, exclude=True)
    """A `rag_reorder.Client` to use instead of one built from the fields above (never
    closed by the compressor)."""
    async_client: AsyncClient | None = Field(default=None, exclude=True)
    """A `rag_reorder.AsyncClient` for `acompress_documents` (default: one per call; never
    closed by the compressor)."""

    _owned: OwnedClient = PrivateAttr(default_factory=OwnedClient)

    def _client_kwargs(self) -> dict[str, Any]:
        return client_kwargs(self, self.api_key.get_secret_value() if self.api_key else None)

    def reorder(self, documents: Sequence[Document], query: str) -> Reordering:
        """The service's whole answer for these documents (what ``compress_documents`` uses)."""
        client = self.client if self.client is not None else self._owned.get(self._client_kwargs)
        return client.reorder(query, self._passages(documents), **request_options(self))

    def close(self) -> None:
        """Close the connections the compressor opened (not those of a ``client`` passed in).
        A later call opens new ones."""
        self._owned.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def areorder(self, documents: Sequence[Document], query: str) -> Reordering:
        """``reorder``, asynchronously."""
        return await reorder_async(
            self.async_client,
            self._client_kwargs(),
            query,
            self._passages(documents),
            request_options(self),
        )

    def _passages(self, documents: Sequence[Document]) -> list[Passage]:
        """The documents' texts, each with its retriever score where its metadata has one.

        Raises:
            ValueError: a score that is not a number.
        """
        out = []
        for k, doc in enumerate(documents):
            value = doc.metadata.get(self.score_key) if self.score_key else None
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise ValueError(
                    f"documents[{k}].metadata[{self.score_key!r}] must be a number (the "
                    f"retriever's score), got {value!r}; set score_key to another key or None"
                )
            score = float(value) if value is not None and math.isfinite(value) else None
            # LangChain's loaders name the document `source`; its splitters with
            # `add_start_index=True` give each chunk's `start_index`.
            where = source_of(doc.metadata.get("source"), doc.metadata.get("start_index"))
            out.append(Passage(text=doc.page_content, score=score, **where))
        return out

    def compress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """The documents in prompt order (with ``top_n``, the best ``top_n``), fit in metadata.

        Args:
            documents: the retrieved documents, in any order.
            query: the user's question.
            callbacks: accepted for the interface; unused.

        Returns:
            New ``Document`` objects (the inputs are not modified), first slot first.

        Raises:
            RagReorderError: the service answered with an error or could not be reached.
        """
        if not documents:
            return []
        return _reordered(documents, self.reorder(documents, query))

    async def acompress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """``compress_documents``, asynchronously."""
        if not documents:
            return []
        return _reordered(documents, await self.areorder(documents, query))


def _reordered(documents: Sequence[Document], result: Reordering) -> list[Document]:
    out = []
    for index, meta in placed(result):
        doc = documents[index]
        out.append(doc.model_copy(update={"metadata": {**doc.metadata, **meta}}))
    return out
