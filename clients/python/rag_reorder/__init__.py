"""Python client of the rag-reorder service, and adapters for RAG frameworks.

    pip install rag-reorder-client                # Client, AsyncClient
    pip install 'rag-reorder-client[langchain]'   # rag_reorder.langchain.RagReorderCompressor
    pip install 'rag-reorder-client[llamaindex]'  # rag_reorder.llama_index.RagReorderPostprocessor
    pip install 'rag-reorder-client[haystack]'    # rag_reorder.haystack.RagReorderRanker

Only httpx at run time; the framework adapters live in their own modules so that importing
``rag_reorder`` needs none of the frameworks.
"""

from __future__ import annotations

from rag_reorder._adapter import METADATA_KEYS, METADATA_PREFIX
from rag_reorder._protocol import reorder_item
from rag_reorder._version import __version__
from rag_reorder.client import DEFAULT_TIMEOUT_S, AsyncClient, Client
from rag_reorder.types import (
    BatchItem,
    BatchReordering,
    ContextReport,
    Design,
    DesignKind,
    DroppedPassage,
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
    "DEFAULT_TIMEOUT_S",
    "METADATA_KEYS",
    "METADATA_PREFIX",
    "AsyncClient",
    "BatchItem",
    "BatchReordering",
    "Client",
    "ContextReport",
    "Design",
    "DesignKind",
    "DroppedPassage",
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
    "__version__",
    "reorder_item",
]
