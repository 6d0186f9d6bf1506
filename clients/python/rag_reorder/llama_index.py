"""LlamaIndex: ``RagReorderPostprocessor``, a node postprocessor that returns the prompt order.

    pip install 'rag-reorder-client[llamaindex]'

It sends the query and the retrieved nodes' text to a rag-reorder service (``POST /v1/reorder``)
and returns the nodes in the order to put into the prompt, each with the fit in its metadata
(keys ``rag_reorder_*``: ``slot``, ``rank``, ``utility``, ``stderr``,
``confidence_above_next``, ``score``, ``position_bias``, ``placement``, ``strategy``,
``request_id``; excluded from the text the LLM and the embedder see), and ``score`` set to
the utility where the strategy has one. Put it last in ``node_postprocessors``: a later
postprocessor that sorts by score undoes the placement.

Connections: the postprocessor opens its own ``Client`` on its first call and closes it with
``close()`` or at the end of a ``with`` block; one dropped unclosed is closed when it is
garbage-collected. A ``client`` (or ``async_client``) you pass is used as it is and never
closed: in a service that builds a postprocessor per request, pass one shared client.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any, Self

from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, SecretStr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from rag_reorder._adapter import (
    METADATA_KEYS,
    OwnedClient,
    client_kwargs,
    placed,
    reorder_async,
    request_options,
    source_of,
)
from rag_reorder.client import DEFAULT_BASE_URL, DEFAULT_TIMEOUT_S, AsyncClient, Client
from rag_reorder.types import Passage, Placement, Reordering, Strategy

__all__ = ["RagReorderPostprocessor"]


class RagReorderPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes into the prompt order a rag-reorder service fits.

    Example:
        ```python
        reorder = RagReorderPostprocessor(base_url="http://rag-reorder:8000", top_n=5)
        engine = index.as_query_engine(similarity_top_k=20, node_postprocessors=[reorder])
        ```

    Raises ``rag_reorder.RagReorderError`` when the service answers with an error (after
    retrying 503s) or cannot be reached, and ``ValueError`` without a query.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    base_url: str = DEFAULT_BASE_URL
    """Root URL of the rag-reorder service."""
    api_key: SecretStr | None = None
    """The service's API key (`RAG_REORDER_API_KEY`), if it has one."""
    top_n: int | None = Field(default=None, ge=1)
    """Keep the top_n best nodes, in their placement order (default: all). The way to keep
    k nodes: the first k of a whole placement are its first slots, not the best."""
    strategy: Strategy | None = None
    """Strategy (default: the service's, `moi`)."""
    placement: Placement | None = None
    """`bias_matched`, `descending_utility` or `litm` (default: the service's
    `RAG_REORDER_PLACEMENT`)."""
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
    metadata_mode: MetadataMode = MetadataMode.NONE
    """Which of a node's metadata goes into the text sent (default: none, the text only)."""
    send_scores: bool = True
    """Send each node's retriever score (`NodeWithScore.score`): the `retriever` strategy
    orders by it, MoI uses it for ties and never-shown passages."""
    timeout: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    """Seconds to wait for an answer: above the service's deadline (120 s by default)."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of 503/429 and of connection errors before sending, with backoff (a read
    timeout is not retried: the service may still be working on the request)."""
    client: Client | None = Field(default=None, exclude=True)
    """A `rag_reorder.Client` to use instead of one built from the fields above (never
    closed by the postprocessor)."""
    async_client: AsyncClient | None = Field(default=None, exclude=True)
    """A `rag_reorder.AsyncClient` for the async path (default: one per call; never closed by
    the postprocessor)."""

    _owned: OwnedClient = PrivateAttr(default_factory=OwnedClient)

    @classmethod
    def class_name(cls) -> str:
        return "RagReorderPostprocessor"

    def _client_kwargs(self) -> dict[str, Any]:
        return client_kwargs(self, self.api_key.get_secret_value() if self.api_key else None)

    def _passages(self, nodes: list[NodeWithScore]) -> list[Passage]:
        out = []
        for n in nodes:
            score = n.score if self.send_scores else None
            out.append(
                Passage(
                    text=n.node.get_content(metadata_mode=self.metadata_mode),
                    score=float(score) if score is not None and math.isfinite(score) else None,
                    # The node's document and where in it the node starts.
                    **source_of(
                        getattr(n.node, "ref_doc_id", None),
                        getattr(n.node, "start_char_idx", None),
                    ),
                )
            )
        return out

    def reorder(self, nodes: list[NodeWithScore], query: str) -> Reordering:
        """The service's whole answer for these nodes (what the postprocessing uses)."""
        client = self.client if self.client is not None else self._owned.get(self._client_kwargs)
        return client.reorder(query, self._passages(nodes), **request_options(self))

    def close(self) -> None:
        """Close the connections the postprocessor opened (not those of a ``client`` passed
        in). A later call opens new ones."""
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

    async def areorder(self, nodes: list[NodeWithScore], query: str) -> Reordering:
        """``reorder``, asynchronously."""
        return await reorder_async(
            self.async_client,
            self._client_kwargs(),
            query,
            self._passages(nodes),
            request_options(self),
        )

    def _postprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        return _reordered(nodes, self.reorder(nodes, _query(query_bundle)))

    async def _apostprocess_nodes(
        self,
        nodes: list[NodeWithScore],
        query_bundle: QueryBundle | None = None,
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        return _reordered(nodes, await self.areorder(nodes, _query(query_bundle)))


def _query(query_bundle: QueryBundle | None) -> str:
    if query_bundle is None:
        raise ValueError("RagReorderPostprocessor needs the query (query_bundle or query_str)")
    return query_bundle.query_str


def _reordered(nodes: list[NodeWithScore], result: Reordering) -> list[NodeWithScore]:
    out = []
    for index, meta in placed(result):
        n = nodes[index]
        # A copy: the retrieved node may be the docstore's own object, shared across queries.
        node = n.node.model_copy(
            update={
                "metadata": {**n.node.metadata, **meta},
                "excluded_llm_metadata_keys": _with_ours(n.node.excluded_llm_metadata_keys),
                "excluded_embed_metadata_keys": _with_ours(n.node.excluded_embed_metadata_keys),
            }
        )
        utility = meta["rag_reorder_utility"]
        score = float(utility) if isinstance(utility, float) else n.score
        out.append(NodeWithScore(node=node, score=score))
    return out


def _with_ours(keys: list[str]) -> list[str]:
    return [*keys, *(k for k in METADATA_KEYS if k not in keys)]
