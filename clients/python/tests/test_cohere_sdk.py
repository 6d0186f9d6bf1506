"""The real ``cohere`` SDK (v1 ``Client`` and v2 ``ClientV2``) against a real server process on
SmolLM2: with ``reorder.results_order`` ``placement`` the results arrive in the prompt order,
unchanged by the SDK; without it, best first as a rerank client expects."""

from __future__ import annotations

from typing import Any

import cohere
import pytest
from rag_reorder import Client, Reordering
from servers import DESIGN, DOCUMENTS, QUERY, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def expected(smollm2_service: ServerProcess) -> Reordering:
    with Client(smollm2_service.base_url) as c:
        out = c.reorder(QUERY, DOCUMENTS, design=DESIGN)
    assert out.order == out.ranking[::-1]  # the two orders cannot be mistaken (conftest)
    return out


def extra(**reorder: Any) -> dict[str, Any]:
    """Our options ride in the body's `reorder` object, which the SDK passes through."""
    return {"additional_body_parameters": {"reorder": {"design": DESIGN, **reorder}}}


def test_cohere_v1_client(smollm2_service: ServerProcess, expected: Reordering) -> None:
    co = cohere.Client(api_key="unused", base_url=smollm2_service.base_url)
    placed = co.rerank(
        model="rag-reorder",
        query=QUERY,
        documents=DOCUMENTS,
        request_options=extra(results_order="placement"),
    )
    assert [r.index for r in placed.results] == list(expected.order)
    ranked = co.rerank(
        model="rag-reorder", query=QUERY, documents=DOCUMENTS, top_n=2, request_options=extra()
    )
    assert [r.index for r in ranked.results] == list(expected.ranking[:2])
    scores = [r.relevance_score for r in ranked.results]
    assert scores == sorted(scores, reverse=True)


def test_cohere_v2_client(smollm2_service: ServerProcess, expected: Reordering) -> None:
    co = cohere.ClientV2(api_key="unused", base_url=smollm2_service.base_url)
    placed = co.rerank(
        model="rag-reorder",
        query=QUERY,
        documents=DOCUMENTS,
        top_n=2,
        request_options=extra(results_order="placement"),
    )
    # The best two, in the relative order the placement gives them.
    best = set(expected.ranking[:2])
    assert [r.index for r in placed.results] == [i for i in expected.order if i in best]
    # relevance_score is still the utility's map: the SDK's client sees them out of order.
    scores = [r.relevance_score for r in placed.results]
    assert scores == sorted(scores)


async def test_cohere_async_v2_client(smollm2_service: ServerProcess, expected: Reordering) -> None:
    co = cohere.AsyncClientV2(api_key="unused", base_url=smollm2_service.base_url)
    placed = await co.rerank(
        model="rag-reorder",
        query=QUERY,
        documents=DOCUMENTS,
        request_options=extra(results_order="placement"),
    )
    assert [r.index for r in placed.results] == list(expected.order)
