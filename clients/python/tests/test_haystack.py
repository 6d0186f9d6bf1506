"""The Haystack component with the real ``haystack-ai`` package against real server processes:
it returns the service's placement, a retriever -> rag-reorder -> PromptBuilder pipeline puts
the passages into the prompt in that order, and the component survives a YAML round trip."""

from __future__ import annotations

import pytest
from haystack import AsyncPipeline, Document, Pipeline
from haystack.components.builders import PromptBuilder
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
from haystack.document_stores.in_memory import InMemoryDocumentStore
from haystack.utils import Secret
from rag_reorder import METADATA_KEYS, Client
from rag_reorder.haystack import RagReorderRanker
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

TEMPLATE = """Answer from the passages.
{% for doc in documents %}
{{ doc.content }}
{% endfor %}
Question: {{ query }}
Answer:"""


def docs() -> list[Document]:
    return [Document(content=t, meta={"source": f"doc-{i}"}) for i, t in enumerate(DOCUMENTS)]


def texts_in(prompt: str, texts: list[str]) -> list[str]:
    return [t for _, t in sorted((prompt.index(t), t) for t in texts if t in prompt)]


def test_the_ranker_returns_the_placement_with_the_fit_in_meta(
    smollm2_service: ServerProcess,
) -> None:
    with Client(smollm2_service.base_url) as c:
        expected = c.reorder(QUERY, DOCUMENTS, design=DESIGN)
    inputs = docs()
    out = RagReorderRanker(base_url=smollm2_service.base_url, design=DESIGN).run(
        query=QUERY, documents=inputs
    )["documents"]
    assert [DOCUMENTS.index(d.content or "") for d in out] == list(expected.order)
    for slot, d in enumerate(out):
        index = DOCUMENTS.index(d.content or "")
        assert set(METADATA_KEYS) <= set(d.meta) and d.meta["source"] == f"doc-{index}"
        assert d.meta["rag_reorder_slot"] == slot
        assert d.score == expected.passage(index).utility
        assert d.id == inputs[index].id  # the same document, not a new one
    assert all(set(d.meta) == {"source"} for d in inputs)  # the inputs are left alone


def test_a_pipeline_puts_the_passages_into_the_prompt_in_placement_order(
    smollm2_service: ServerProcess,
) -> None:
    store = InMemoryDocumentStore()
    store.write_documents(docs())
    pipeline = Pipeline()
    pipeline.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=4))
    pipeline.add_component(
        "reorder", RagReorderRanker(base_url=smollm2_service.base_url, design=DESIGN)
    )
    pipeline.add_component("prompt", PromptBuilder(template=TEMPLATE))
    pipeline.connect("retriever.documents", "reorder.documents")
    pipeline.connect("reorder.documents", "prompt.documents")
    out = pipeline.run(
        {"retriever": {"query": QUERY}, "reorder": {"query": QUERY}, "prompt": {"query": QUERY}},
        include_outputs_from={"retriever"},
    )
    # The service's placement of the documents in the order the retriever gave them.
    retrieved = [d.content or "" for d in out["retriever"]["documents"]]
    with Client(smollm2_service.base_url) as c:
        expected = c.reorder(QUERY, retrieved, design=DESIGN)
    assert texts_in(out["prompt"]["prompt"], DOCUMENTS) == [retrieved[i] for i in expected.order]
    assert retrieved != [retrieved[i] for i in expected.order]  # the ranker did reorder

    # The same pipeline through YAML: the component and its settings survive the round trip.
    again = Pipeline.loads(pipeline.dumps())
    ranker = again.get_component("reorder")
    assert isinstance(ranker, RagReorderRanker) and ranker.design == DESIGN
    assert ranker.base_url == smollm2_service.base_url


async def test_run_async_in_an_async_pipeline(smollm2_service: ServerProcess) -> None:
    with Client(smollm2_service.base_url) as c:
        expected = c.reorder(QUERY, DOCUMENTS, design=DESIGN, top_n=2)
    pipeline = AsyncPipeline()
    pipeline.add_component(
        "reorder", RagReorderRanker(base_url=smollm2_service.base_url, design=DESIGN, top_n=2)
    )
    out = await pipeline.run_async({"reorder": {"query": QUERY, "documents": docs()}})
    assert [DOCUMENTS.index(d.content or "") for d in out["reorder"]["documents"]] == list(
        expected.order
    )


def test_scores_and_the_key_reach_the_service(
    fake_service: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The key comes from RAG_REORDER_API_KEY by default; the scores order the `retriever`
    # strategy (the fake service's passages, scored unlike their input order or utilities).
    monkeypatch.setenv("RAG_REORDER_API_KEY", API_KEY)
    scores = [0.9, 0.1, 0.3, 0.5]
    scored = [Document(content=t, score=s) for t, s in zip(FAKE_PASSAGES, scores, strict=True)]
    ranker = RagReorderRanker(
        base_url=fake_service.base_url, strategy="retriever", placement="descending_utility"
    )
    out = ranker.run(query=FAKE_QUERY, documents=scored)["documents"]
    assert [FAKE_PASSAGES.index(d.content or "") for d in out] == [0, 3, 2, 1]
    unscored = RagReorderRanker(
        base_url=fake_service.base_url,
        api_key=Secret.from_env_var("RAG_REORDER_API_KEY"),
        strategy="retriever",
        placement="descending_utility",
        send_scores=False,
    )
    out = unscored.run(query=FAKE_QUERY, documents=scored)["documents"]
    assert [FAKE_PASSAGES.index(d.content or "") for d in out] == [0, 1, 2, 3]


def test_serialisation_keeps_the_key_out_and_bad_input_is_refused() -> None:
    ranker = RagReorderRanker(top_n=3, placement="litm")
    data = ranker.to_dict()
    assert data["init_parameters"]["api_key"] == {
        "type": "env_var",
        "env_vars": ["RAG_REORDER_API_KEY"],
        "strict": False,
    }
    back = RagReorderRanker.from_dict(data)
    assert (back.top_n, back.placement) == (3, "litm")
    with pytest.raises(ValueError, match="top_n must be >= 1"):
        RagReorderRanker(top_n=0)
    with pytest.raises(ValueError, match=r"documents\[1\] .* has no text"):
        ranker.run(query="q", documents=[Document(content="a"), Document(content=None)])
    assert ranker.run(query="q", documents=[]) == {"documents": []}
