"""The LangChain and LlamaIndex adapters with the real frameworks against a real server
process on the embedded SmolLM2 model: each returns the service's placement, and a
retriever -> rag-reorder -> prompt chain puts the passages into the prompt in that order."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import PromptTemplate
from langchain_core.retrievers import BaseRetriever as LCRetriever
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever as LIRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from rag_reorder import METADATA_KEYS, Client, Reordering
from rag_reorder.langchain import RagReorderCompressor
from rag_reorder.llama_index import RagReorderPostprocessor
from servers import (
    API_KEY,
    DESIGN,
    DOCUMENTS,
    FAKE_PASSAGES,
    FAKE_QUERY,
    QUERY,
    ServerProcess,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RETRIEVER_SCORES = [0.9, 0.8, 0.7, 0.6]


@pytest.fixture(scope="module")
def expected(smollm2_service: ServerProcess) -> Reordering:
    """The service's own answer: the order every adapter must reproduce."""
    with Client(smollm2_service.base_url) as c:
        out = c.reorder(QUERY, DOCUMENTS, design=DESIGN)
    # DESIGN's fit weights the last slot most: bias_matched reverses the ranking, so an
    # adapter that returned the ranking (or the input order) would fail these tests.
    assert out.placement == "bias_matched"
    assert out.order == out.ranking[::-1] and list(out.order) != [0, 1, 2, 3]
    return out


def texts_in(prompt: str) -> list[int]:
    """Indices of DOCUMENTS in the order they appear in ``prompt``."""
    found = [(prompt.find(d), i) for i, d in enumerate(DOCUMENTS) if d in prompt]
    return [i for _, i in sorted(found)]


# --- LangChain ---------------------------------------------------------------------------


def lc_docs() -> list[Document]:
    return [
        Document(page_content=t, metadata={"source": f"doc-{i}"}) for i, t in enumerate(DOCUMENTS)
    ]


def test_langchain_compressor_returns_the_placement(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    compressor = RagReorderCompressor(base_url=smollm2_service.base_url, design=DESIGN)
    docs = lc_docs()
    out = compressor.compress_documents(docs, QUERY)
    assert [DOCUMENTS.index(d.page_content) for d in out] == list(expected.order)
    for slot, d in enumerate(out):
        index = DOCUMENTS.index(d.page_content)
        assert set(METADATA_KEYS) <= set(d.metadata) and d.metadata["source"] == f"doc-{index}"
        assert d.metadata["rag_reorder_slot"] == slot
        assert d.metadata["rag_reorder_rank"] == expected.rank(index)
        assert d.metadata["rag_reorder_utility"] == expected.passage(index).utility
        assert d.metadata["rag_reorder_position_bias"] == list(
            expected.position_bias.coefficients  # type: ignore[union-attr]
        )
        assert d.metadata["rag_reorder_placement"] == "bias_matched"
    assert all(set(d.metadata) == {"source"} for d in docs)  # the inputs are left alone
    assert compressor.compress_documents([], QUERY) == []


async def test_langchain_async_and_top_n(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    compressor = RagReorderCompressor(base_url=smollm2_service.base_url, design=DESIGN, top_n=2)
    out = await compressor.acompress_documents(lc_docs(), QUERY)
    best = set(expected.ranking[:2])
    assert [DOCUMENTS.index(d.page_content) for d in out] == [
        i for i in expected.order if i in best
    ]


def test_top_n_keeps_the_best_placed_not_the_first_slots(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    # Here bias_matched reverses the ranking: the first two slots hold the two worst passages.
    assert set(expected.order[:2]) == set(expected.ranking[-2:])
    with Client(smollm2_service.base_url) as c:
        served = c.reorder(QUERY, DOCUMENTS, design=DESIGN, top_n=2)
        whole = c.rerank(QUERY, DOCUMENTS, results_order="placement", design=DESIGN)
        cut = c.rerank(QUERY, DOCUMENTS, results_order="placement", design=DESIGN, top_n=2)
    assert list(served.order) == expected.top(2) != list(expected.order[:2])
    assert set(expected.top(2)) == set(expected.ranking[:2])
    assert [r.index for r in cut.results] == [r.index for r in whole.top(2)] == expected.top(2)


# The retriever's scores reach the service: the `retriever` strategy orders by them alone, and
# these scores order the fake service's passages unlike their input order or their utilities.
SCORES = [0.9, 0.1, 0.3, 0.5]
BY_SCORE = [0, 3, 2, 1]


def test_langchain_sends_the_retriever_scores_of_the_metadata(fake_service: ServerProcess) -> None:
    compressor = RagReorderCompressor(
        base_url=fake_service.base_url,
        api_key=API_KEY,
        strategy="retriever",
        placement="descending_utility",
    )

    def placed(c: RagReorderCompressor, key: str) -> list[int]:
        docs = [
            Document(page_content=t, metadata={key: s})
            for t, s in zip(FAKE_PASSAGES, SCORES, strict=True)
        ]
        return [FAKE_PASSAGES.index(d.page_content) for d in c.compress_documents(docs, FAKE_QUERY)]

    assert placed(compressor, "score") == BY_SCORE
    assert placed(compressor.model_copy(update={"score_key": "sim"}), "sim") == BY_SCORE
    # Without scores the retriever strategy keeps the input order.
    assert placed(compressor.model_copy(update={"score_key": None}), "score") == [0, 1, 2, 3]


def test_langchain_refuses_a_score_that_is_not_a_number() -> None:
    docs = [Document(page_content="a", metadata={"score": "high"})]
    with pytest.raises(ValueError, match=r"documents\[0\].metadata\['score'\] must be a number"):
        RagReorderCompressor().compress_documents(docs, "q")


def test_llamaindex_sends_the_node_scores(fake_service: ServerProcess) -> None:
    nodes = [
        NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=s)
        for i, (t, s) in enumerate(zip(FAKE_PASSAGES, SCORES, strict=True))
    ]
    post = RagReorderPostprocessor(
        base_url=fake_service.base_url,
        api_key=API_KEY,
        strategy="retriever",
        placement="descending_utility",
    )
    out = post.postprocess_nodes(nodes, query_str=FAKE_QUERY)
    assert [n.node.node_id for n in out] == [f"n{i}" for i in BY_SCORE]
    quiet = post.model_copy(update={"send_scores": False})
    out = quiet.postprocess_nodes(nodes, query_str=FAKE_QUERY)
    assert [n.node.node_id for n in out] == ["n0", "n1", "n2", "n3"]


class FixedRetriever(LCRetriever):
    """A retriever with a fixed answer, in the retriever's order (by its scores)."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return lc_docs()


def test_langchain_chain_puts_the_passages_into_the_prompt_in_placement_order(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    compressor = RagReorderCompressor(base_url=smollm2_service.base_url, design=DESIGN)

    def reorder(inputs: dict[str, object]) -> dict[str, str]:
        question = str(inputs["question"])
        docs = inputs["docs"]
        assert isinstance(docs, Sequence)
        placed = compressor.compress_documents(docs, question)
        return {"question": question, "context": "\n\n".join(d.page_content for d in placed)}

    prompt = PromptTemplate.from_template(
        "Answer from the passages.\n\n{context}\n\nQuestion: {question}\nAnswer:"
    )
    chain = (
        RunnableParallel(question=RunnablePassthrough(), docs=FixedRetriever())
        | RunnableLambda(reorder)
        | prompt
    )
    text = chain.invoke(QUERY).to_string()
    assert texts_in(text) == list(expected.order)


# --- LlamaIndex --------------------------------------------------------------------------


def li_nodes() -> list[NodeWithScore]:
    return [
        NodeWithScore(
            node=TextNode(text=t, id_=f"node-{i}", metadata={"source": f"doc-{i}"}), score=s
        )
        for i, (t, s) in enumerate(zip(DOCUMENTS, RETRIEVER_SCORES, strict=True))
    ]


def test_llamaindex_postprocessor_returns_the_placement(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    post = RagReorderPostprocessor(
        base_url=smollm2_service.base_url, design=DESIGN, send_scores=False
    )
    nodes = li_nodes()
    out = post.postprocess_nodes(nodes, query_str=QUERY)
    assert [n.node.node_id for n in out] == [f"node-{i}" for i in expected.order]
    for slot, n in enumerate(out):
        index = int(n.node.node_id.split("-")[1])
        meta = n.node.metadata
        assert meta["rag_reorder_slot"] == slot and meta["source"] == f"doc-{index}"
        assert meta["rag_reorder_confidence_above_next"] == (
            expected.passage(index).confidence_above_next
        )
        assert n.score == expected.passage(index).utility
        # The fit is for the application, not for the generator's or the embedder's text.
        assert "rag_reorder" not in n.node.get_content(metadata_mode=MetadataMode.LLM)
        assert "rag_reorder" not in n.node.get_content(metadata_mode=MetadataMode.EMBED)
        assert "source" in n.node.get_content(metadata_mode=MetadataMode.LLM)
    assert all(set(n.node.metadata) == {"source"} for n in nodes)  # the inputs are left alone
    with pytest.raises(ValueError, match="query"):
        post.postprocess_nodes(nodes)


async def test_llamaindex_async(smollm2_service: ServerProcess, expected: Reordering) -> None:
    post = RagReorderPostprocessor(
        base_url=smollm2_service.base_url, design=DESIGN, send_scores=False
    )
    out = await post.apostprocess_nodes(li_nodes(), query_bundle=QueryBundle(QUERY))
    assert [n.node.node_id for n in out] == [f"node-{i}" for i in expected.order]


class FixedNodeRetriever(LIRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return li_nodes()


def test_llamaindex_query_engine_puts_the_passages_into_the_prompt_in_placement_order(
    smollm2_service: ServerProcess, expected: Reordering
) -> None:
    # MockLLM answers with the prompt it was given: the prompt the generator would see.
    post = RagReorderPostprocessor(
        base_url=smollm2_service.base_url, design=DESIGN, send_scores=False
    )
    engine = RetrieverQueryEngine.from_args(
        FixedNodeRetriever(), llm=MockLLM(), node_postprocessors=[post]
    )
    response = engine.query(QUERY)
    assert texts_in(str(response)) == list(expected.order)
    assert "rag_reorder" not in str(response)
    assert [n.node.node_id for n in response.source_nodes] == [f"node-{i}" for i in expected.order]
