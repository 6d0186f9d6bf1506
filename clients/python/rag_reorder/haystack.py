"""Haystack 2.x: ``RagReorderRanker``, a component that returns documents in prompt order.

    pip install 'rag-reorder-client[haystack]'

It sends the query and the retrieved documents to a rag-reorder service (``POST /v1/reorder``)
and returns the documents in the order to put into the prompt, each a copy with the fit in its
``meta`` (keys ``rag_reorder_*``: ``slot``, ``rank``, ``utility``, ``stderr``,
``confidence_above_next``, ``score``, ``position_bias``, ``placement``, ``strategy``,
``request_id``) and ``score`` set to the utility where the strategy has one. Put it between the
retriever (or a ranker) and the ``PromptBuilder``, in place of ``LostInTheMiddleRanker``: it
places by the generator's measured position bias instead of a fixed U shape. Do not sort its
output again; to keep k documents set ``top_n=k`` (the k best, placed), not a cut of the
output, whose first slots are not the best documents. Serialisable with ``to_dict`` /
``from_dict`` (the API key as a ``Secret``), so it can live in a YAML pipeline.

Connections: ``warm_up()`` (or the first ``run``) opens the component's ``Client``; ``close()``
or the end of a ``with`` block closes it, and a component dropped unclosed is closed when it is
garbage-collected (Haystack has no teardown hook). ``run_async`` opens a client per call,
closed when the call ends: connections belong to the event loop that opened them.
"""

from __future__ import annotations

import dataclasses
import math
from types import TracebackType
from typing import Any, Self

from haystack import Document, component, default_from_dict, default_to_dict
from haystack.utils import Secret, deserialize_secrets_inplace

from rag_reorder._adapter import (
    OwnedClient,
    client_kwargs,
    placed,
    reorder_async,
    request_options,
    source_of,
)
from rag_reorder.client import DEFAULT_BASE_URL, DEFAULT_TIMEOUT_S
from rag_reorder.types import Passage, Placement, Reordering, Strategy

__all__ = ["RagReorderRanker"]

# The key from the environment when set, none otherwise (an env-var Secret serialises as the
# variable's name, never its value).
_KEY_FROM_ENV = Secret.from_env_var("RAG_REORDER_API_KEY", strict=False)


@component
class RagReorderRanker:
    """Reorders retrieved documents into the prompt order a rag-reorder service fits.

    Example:
        ```python
        pipeline.add_component("retriever", InMemoryBM25Retriever(document_store=store))
        pipeline.add_component("reorder", RagReorderRanker(base_url="http://rag-reorder:8000"))
        pipeline.add_component("prompt", PromptBuilder(template=template))
        pipeline.connect("retriever.documents", "reorder.documents")
        pipeline.connect("reorder.documents", "prompt.documents")
        ```

    Raises ``rag_reorder.RagReorderError`` when the service answers with an error (after
    retrying 503s) or cannot be reached, and ``ValueError`` for a document without text.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: Secret | None = _KEY_FROM_ENV,
        top_n: int | None = None,
        strategy: Strategy | None = None,
        placement: Placement | None = None,
        design: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        send_scores: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        max_context_tokens: int | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        """Args:
        base_url: root URL of the rag-reorder service.
        api_key: the service's API key (``RAG_REORDER_API_KEY`` of the environment by default;
            None or an unset variable: none sent).
        top_n: keep the ``top_n`` best documents, in their placement order (default: all).
        strategy: the service's strategy (default: its own, ``moi``).
        placement: ``bias_matched``, ``descending_utility`` or ``litm`` (default: the
            service's ``RAG_REORDER_PLACEMENT``).
        design: MoI's permutation design, e.g. ``{"kind": "pruned_random", "seed": 7}``.
        options: any other option of the native body (``joint``, ``template``, ...).
        send_scores: send each document's retriever ``score``: the ``retriever`` strategy
            orders by it, MoI uses it for ties and never-shown passages.
        timeout: seconds to wait for an answer: above the service's deadline (120 s).
        max_retries: retries of 503/429 and of connection errors before sending.
        max_context_tokens: the generator's token budget for the documents: only those that
            fit are returned, each with ``rag_reorder_dropped`` in ``meta`` listing the
            left-out ones and why (docs/context.md).
        context: other context options (``{"distractors": {}}``, ``{"dedup": True}``).
        """
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1 or None, got {max_context_tokens}")
        if top_n is not None and top_n < 1:
            raise ValueError(f"top_n must be >= 1 or None, got {top_n}")
        self.base_url = base_url
        self.api_key = api_key
        self.top_n = top_n
        self.strategy = strategy
        self.placement = placement
        self.design = design
        self.options = options
        self.send_scores = send_scores
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_context_tokens = max_context_tokens
        self.context = context
        self._owned = OwnedClient()

    def to_dict(self) -> dict[str, Any]:
        """The component's init parameters, the API key as a serialisable ``Secret``."""
        return default_to_dict(
            self,
            base_url=self.base_url,
            api_key=self.api_key.to_dict() if self.api_key else None,
            top_n=self.top_n,
            strategy=self.strategy,
            placement=self.placement,
            design=self.design,
            options=self.options,
            send_scores=self.send_scores,
            timeout=self.timeout,
            max_retries=self.max_retries,
            max_context_tokens=self.max_context_tokens,
            context=self.context,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RagReorderRanker:
        deserialize_secrets_inplace(data["init_parameters"], keys=["api_key"])
        return default_from_dict(cls, data)

    def warm_up(self) -> None:
        """Open the connection pool (Haystack calls it before the first run)."""
        self._owned.get(self._client_kwargs)

    def close(self) -> None:
        """Close the connection pool; a later run opens a new one."""
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

    @component.output_types(documents=list[Document])
    def run(
        self, query: str, documents: list[Document], top_n: int | None = None
    ) -> dict[str, list[Document]]:
        """The documents in prompt order (with ``top_n``, the best ``top_n``), fit in ``meta``.

        Args:
            query: the user's question.
            documents: the retrieved documents, in any order.
            top_n: overrides the component's ``top_n`` for this run.

        Returns:
            ``{"documents": [...]}``: copies of the inputs, first slot first.
        """
        if not documents:
            return {"documents": []}
        client = self._owned.get(self._client_kwargs)
        result = client.reorder(query, self._passages(documents), **request_options(self, top_n))
        return {"documents": _reordered(documents, result)}

    @component.output_types(documents=list[Document])
    async def run_async(
        self, query: str, documents: list[Document], top_n: int | None = None
    ) -> dict[str, list[Document]]:
        """``run``, asynchronously (``AsyncPipeline``)."""
        if not documents:
            return {"documents": []}
        result = await reorder_async(
            None,
            self._client_kwargs(),
            query,
            self._passages(documents),
            request_options(self, top_n),
        )
        return {"documents": _reordered(documents, result)}

    def _client_kwargs(self) -> dict[str, Any]:
        return client_kwargs(self, self.api_key.resolve_value() if self.api_key else None)

    def _passages(self, documents: list[Document]) -> list[Passage]:
        out = []
        for k, doc in enumerate(documents):
            if doc.content is None:
                raise ValueError(f"documents[{k}] (id {doc.id}) has no text content to reorder")
            score = doc.score if self.send_scores else None
            if score is not None and not math.isfinite(score):
                score = None
            # Haystack's DocumentSplitter names each split's document and start.
            meta = doc.meta or {}
            where = source_of(meta.get("source_id"), meta.get("split_idx_start"))
            out.append(Passage(text=doc.content, id=doc.id, score=score, **where))
        return out


def _reordered(documents: list[Document], result: Reordering) -> list[Document]:
    out = []
    for index, meta in placed(result):
        doc = documents[index]
        utility = meta["rag_reorder_utility"]
        score = float(utility) if isinstance(utility, float) else doc.score
        # A copy with the same id: the input may be the document store's own object.
        out.append(dataclasses.replace(doc, meta={**doc.meta, **meta}, score=score))
    return out
