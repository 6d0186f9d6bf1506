"""The context budget through the client and the three framework adapters (issue 93): the
budget and the other context options reach the service, only the kept documents come back,
and each carries the dropped ones with why (`rag_reorder_dropped`). Against the fake server
with the `retriever` strategy (the retriever's scores rank; no model call)."""

from __future__ import annotations

import pytest
from haystack import Document as HSDocument
from haystack.utils import Secret
from langchain_core.documents import Document
from llama_index.core.schema import NodeWithScore, TextNode
from rag_reorder import METADATA_KEYS, Client, Passage, RagReorderError
from rag_reorder.haystack import RagReorderRanker
from rag_reorder.langchain import RagReorderCompressor
from rag_reorder.llama_index import RagReorderPostprocessor
from servers import API_KEY, FAKE_PASSAGES, FAKE_QUERY, ServerProcess

pytestmark = [pytest.mark.timeout(120)]

SCORES = [0.9, 0.1, 0.3, 0.5]
BY_SCORE = [0, 3, 2, 1]
OPTS = {"strategy": "retriever", "placement": "descending_utility"}


def passages() -> list[Passage]:
    return [Passage(text=t, score=s) for t, s in zip(FAKE_PASSAGES, SCORES, strict=True)]


@pytest.fixture(scope="module")
def budget(fake_service: ServerProcess) -> int:
    """A budget that holds the two best passages and not the third."""
    with Client(fake_service.base_url, api_key=API_KEY) as c:
        two = c.reorder(FAKE_QUERY, passages(), **OPTS, max_context_tokens=10**6, top_n=2)
    assert two.context is not None and sorted(two.order) == [0, 3]
    return two.context.tokens_used + 2


def test_client_sends_the_budget_and_reads_the_drops(
    fake_service: ServerProcess, budget: int
) -> None:
    with Client(fake_service.base_url, api_key=API_KEY) as c:
        out = c.reorder(FAKE_QUERY, passages(), **OPTS, max_context_tokens=budget)
        assert out.order == (0, 3)
        assert out.context is not None
        assert out.context.budget == budget and out.context.tokens_used <= budget
        assert {d.index: d.reason for d in out.context.dropped} == {1: "budget", 2: "budget"}
        assert out.context.reason(2) == "budget" and out.context.reason(0) is None
        rr = c.rerank(
            FAKE_QUERY,
            FAKE_PASSAGES,
            strategy="retriever",
            max_context_tokens=10**6,
            context={"dedup": True},
        )
        assert rr.context is not None and rr.context.dropped == ()
        with pytest.raises(RagReorderError) as err:
            c.reorder(FAKE_QUERY, passages(), **OPTS, max_context_tokens=1)
        assert err.value.status == 422 and err.value.code == "context_budget_too_small"


def check_meta(metas: list[dict[str, object]], budget: int) -> None:
    for m in metas:
        assert set(METADATA_KEYS) <= set(m)
        assert m["rag_reorder_context_budget"] == budget
        assert isinstance(m["rag_reorder_context_tokens"], int)
        assert m["rag_reorder_context_tokens"] <= budget
        dropped = m["rag_reorder_dropped"]
        assert isinstance(dropped, list)
        assert {(d["index"], d["reason"]) for d in dropped} == {(1, "budget"), (2, "budget")}


def test_langchain_returns_only_the_kept_documents(
    fake_service: ServerProcess, budget: int
) -> None:
    docs = [
        Document(page_content=t, metadata={"score": s, "source": "a", "start_index": 10 * i})
        for i, (t, s) in enumerate(zip(FAKE_PASSAGES, SCORES, strict=True))
    ]
    c = RagReorderCompressor(
        base_url=fake_service.base_url, api_key=API_KEY, max_context_tokens=budget, **OPTS
    )
    out = c.compress_documents(docs, FAKE_QUERY)
    assert [FAKE_PASSAGES.index(d.page_content) for d in out] == [0, 3]
    check_meta([d.metadata for d in out], budget)
    # Document order from the loaders' `source` and the splitters' `start_index`.
    c2 = c.model_copy(update={"max_context_tokens": None, "context": {"order": "document"}})
    out = c2.compress_documents(docs, FAKE_QUERY)
    assert [FAKE_PASSAGES.index(d.page_content) for d in out] == [0, 1, 2, 3]


def test_llamaindex_returns_only_the_kept_nodes(fake_service: ServerProcess, budget: int) -> None:
    nodes = [
        NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=s)
        for i, (t, s) in enumerate(zip(FAKE_PASSAGES, SCORES, strict=True))
    ]
    post = RagReorderPostprocessor(
        base_url=fake_service.base_url, api_key=API_KEY, max_context_tokens=budget, **OPTS
    )
    out = post.postprocess_nodes(nodes, query_str=FAKE_QUERY)
    assert [n.node.node_id for n in out] == ["n0", "n3"]
    check_meta([n.node.metadata for n in out], budget)


def test_haystack_returns_only_the_kept_documents(fake_service: ServerProcess, budget: int) -> None:
    docs = [HSDocument(content=t, score=s) for t, s in zip(FAKE_PASSAGES, SCORES, strict=True)]
    ranker = RagReorderRanker(
        base_url=fake_service.base_url,
        api_key=Secret.from_token(API_KEY),
        max_context_tokens=budget,
        **OPTS,  # type: ignore[arg-type]
    )
    out = ranker.run(FAKE_QUERY, docs)["documents"]
    assert [FAKE_PASSAGES.index(d.content) for d in out] == [0, 3]
    check_meta([d.meta for d in out], budget)
    # Serialised with the component (a token secret cannot be: the key from the environment).
    plain = RagReorderRanker(max_context_tokens=budget, context={"dedup": True})
    again = RagReorderRanker.from_dict(plain.to_dict())
    assert again.max_context_tokens == budget and again.context == {"dedup": True}
