"""The rerank routes' wire models (``/rerank``, ``/v1/rerank``, ``/v2/rerank``): the
Cohere/Jina/vLLM request shape with our options under ``reorder``, and the results.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from app.schemas.base import (
    MAX_ID_CHARS,
    MAX_PASSAGES,
    PassageText,
    QueryText,
    ResultsOrder,
    _Lenient,
    _Model,
    _text_object,
)
from app.schemas.reorder import ReorderMeta, ReorderOptions


class RerankOptions(ReorderOptions):
    """`reorder` on the rerank routes: the native options, and how `results` are ordered."""

    results_order: ResultsOrder | None = None
    """`ranking`: `results` best first (descending `relevance_score`), as rerank clients
    expect. `placement`: `results` in the order to put into the prompt (`meta.reorder.order`;
    with `top_n`, the `top_n` best in their placement order), `relevance_score` still the
    strategy's judgement, so a client that re-sorts by it undoes the placement. Default: the
    server's `RAG_REORDER_RERANK_RESULTS_ORDER` (`ranking` unless configured); the response's
    `meta.results_order` names the one applied."""


class RerankDocument(_Lenient):
    text: PassageText


class RerankDocumentIn(RerankDocument):
    """A document as sent: its text, and where it was cut from (`reorder.context.order`
    `document`); results echo the text only, as Cohere's do."""

    source: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """The document it was cut from."""
    offset: int | None = Field(default=None, ge=0)
    """Where in its source it starts."""


DocumentItem = Annotated[
    RerankDocumentIn,
    BeforeValidator(_text_object, json_schema_input_type=PassageText | RerankDocumentIn),
]


class RerankBody(_Lenient):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: Cohere/Jina/vLLM request shape.

    Unknown fields are ignored; our options go in `reorder`, which is strict.
    """

    model: str | None = Field(default=None, max_length=256)
    """Accepted for compatibility and ignored: the service scores with its own model."""
    query: QueryText
    documents: list[DocumentItem] = Field(min_length=1, max_length=MAX_PASSAGES)
    top_n: int | None = Field(default=None, ge=0, le=MAX_PASSAGES)
    """0 or absent: all documents."""
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    """Most of the scoring model's tokens in one document (Cohere's name); the server's
    `RAG_REORDER_MAX_PASSAGE_TOKENS` applies where it is lower. A longer document is a 422,
    unless `reorder.truncate` is `end`: then it is cut to it, as Cohere does, and the cut
    reported in `meta.reorder.truncated`."""
    reorder: RerankOptions = Field(default_factory=RerankOptions)


class RerankResult(_Model):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Model):
    total_tokens: int
    """Prompt tokens the model prefilled for this request."""


class RerankMetaOut(_Model):
    reorder: ReorderMeta
    results_order: ResultsOrder
    """How `results` are ordered: `ranking` (best first) or `placement` (prompt order); the
    request's `reorder.results_order`, else the server's default."""


class RerankResponse(_Model):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Sorted by descending relevance_score, or in prompt order with `reorder.results_order`
    `placement` (see `meta.results_order`)."""
    meta: RerankMetaOut
