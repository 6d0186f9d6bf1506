"""Python client of the rag-reorder service, and adapters for RAG frameworks.

    pip install 'rag-reorder[client]'      # Client, AsyncClient
    pip install 'rag-reorder[langchain]'   # rag_reorder.langchain.RagReorderCompressor
    pip install 'rag-reorder[llamaindex]'  # rag_reorder.llama_index.RagReorderPostprocessor

The framework adapters live in their own modules so that importing ``rag_reorder`` needs
neither framework.
"""

from __future__ import annotations

from rag_reorder._adapter import METADATA_KEYS, METADATA_PREFIX
from rag_reorder._version import __version__
from rag_reorder.client import (
    AsyncClient,
    Client,
    Passage,
    Placement,
    PositionBias,
    RagReorderError,
    Reordering,
    Reranking,
    RerankResult,
    ResultsOrder,
    ScoredPassage,
)

__all__ = [
    "METADATA_KEYS",
    "METADATA_PREFIX",
    "AsyncClient",
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
    "__version__",
]
