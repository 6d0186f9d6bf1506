"""The adapters close the connections they open, against a real server process (fake backend).

A service that builds an adapter per request and never closes it must not keep a connection (a
file descriptor) per request: each adapter's own client is closed by ``close()``, a ``with``
block, or a finaliser when the adapter is dropped, never left to the garbage collector to find
its sockets (which Python reports as an "unclosed" ``ResourceWarning``). A client the caller
passes is used as it is and never closed.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from haystack import Document as HaystackDocument
from haystack.utils import Secret
from langchain_core.documents import Document as LangChainDocument
from llama_index.core.schema import NodeWithScore, TextNode
from rag_reorder import Client
from rag_reorder.haystack import RagReorderRanker
from rag_reorder.langchain import RagReorderCompressor
from rag_reorder.llama_index import RagReorderPostprocessor
from servers import API_KEY, FAKE_PASSAGES, FAKE_QUERY, ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds in /proc"),
]

# The cheapest request of the fake service: no permutation fit.
STRATEGY = "retriever"
Adapter = RagReorderCompressor | RagReorderPostprocessor | RagReorderRanker


def open_fds() -> Counter[str]:
    """This process's open file descriptors by target (every socket as ``socket``)."""
    out: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        out["socket" if target.startswith("socket:") else target] += 1
    return out


def langchain(base_url: str, client: Client | None = None) -> RagReorderCompressor:
    return RagReorderCompressor(
        base_url=base_url, api_key=API_KEY, strategy=STRATEGY, client=client
    )


def llamaindex(base_url: str, client: Client | None = None) -> RagReorderPostprocessor:
    return RagReorderPostprocessor(
        base_url=base_url, api_key=API_KEY, strategy=STRATEGY, client=client
    )


def haystack(base_url: str) -> RagReorderRanker:
    # No client argument: a Haystack component takes serialisable settings only.
    return RagReorderRanker(
        base_url=base_url, api_key=Secret.from_token(API_KEY), strategy=STRATEGY
    )


def use(adapter: Adapter) -> None:
    """One call through the adapter's framework entry point: it opens a connection."""
    if isinstance(adapter, RagReorderCompressor):
        docs = [LangChainDocument(page_content=t) for t in FAKE_PASSAGES]
        assert len(adapter.compress_documents(docs, FAKE_QUERY)) == len(FAKE_PASSAGES)
    elif isinstance(adapter, RagReorderPostprocessor):
        nodes = [NodeWithScore(node=TextNode(text=t)) for t in FAKE_PASSAGES]
        assert len(adapter.postprocess_nodes(nodes, query_str=FAKE_QUERY)) == len(FAKE_PASSAGES)
    else:
        docs_h = [HaystackDocument(content=t) for t in FAKE_PASSAGES]
        out = adapter.run(query=FAKE_QUERY, documents=docs_h)["documents"]
        assert len(out) == len(FAKE_PASSAGES)


MAKERS: list[Callable[..., Adapter]] = [langchain, llamaindex, haystack]


def test_building_and_dropping_1000_adapters_leaves_no_connection_open(
    fake_service: ServerProcess,
) -> None:
    for make in MAKERS:  # imports and first-use caches before the count
        use(make(fake_service.base_url))
    gc.collect()
    before = open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for k in range(1000):
            # Never closed, as in a service that builds one per request and forgets it.
            use(MAKERS[k % len(MAKERS)](fake_service.base_url))
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], f"{len(unclosed)} sockets left to the collector: {unclosed[:3]}"
    assert open_fds() == before


@pytest.mark.parametrize("make", MAKERS, ids=["langchain", "llamaindex", "haystack"])
def test_close_and_with_close_the_adapters_connection_at_once(
    fake_service: ServerProcess, make: Callable[..., Adapter]
) -> None:
    use(make(fake_service.base_url))
    gc.collect()
    gc.disable()  # what closes the connection here must be the adapter, not the collector
    try:
        sockets = open_fds()["socket"]
        adapter = make(fake_service.base_url)
        use(adapter)
        assert open_fds()["socket"] == sockets + 1
        adapter.close()
        assert open_fds()["socket"] == sockets
        use(adapter)  # a closed adapter opens a new pool on its next call
        with adapter:
            use(adapter)
        assert open_fds()["socket"] == sockets
    finally:
        gc.enable()


@pytest.mark.parametrize("make", [langchain, llamaindex], ids=["langchain", "llamaindex"])
def test_a_dropped_adapter_closes_its_connection_without_the_collector(
    fake_service: ServerProcess, make: Callable[..., Adapter]
) -> None:
    # LangChain's and LlamaIndex's adapters hold no reference cycle: dropping the last
    # reference closes the connection then, even with the collector off (a Haystack component
    # is in a cycle through its sockets, so its finaliser runs at the next collection).
    use(make(fake_service.base_url))
    gc.collect()
    gc.disable()
    try:
        sockets = open_fds()["socket"]
        for _ in range(20):
            use(make(fake_service.base_url))
            assert open_fds()["socket"] == sockets
    finally:
        gc.enable()


@pytest.mark.parametrize("make", [langchain, llamaindex], ids=["langchain", "llamaindex"])
def test_a_client_the_caller_passes_is_shared_and_never_closed(
    fake_service: ServerProcess, make: Callable[..., Adapter]
) -> None:
    with Client(fake_service.base_url, api_key=API_KEY) as shared:
        shared.reorder(FAKE_QUERY, FAKE_PASSAGES, strategy=STRATEGY)
        sockets = open_fds()["socket"]
        for _ in range(100):
            adapter = make(fake_service.base_url, client=shared)
            use(adapter)
            adapter.close()
            del adapter
        gc.collect()
        assert open_fds()["socket"] == sockets  # one pool: the shared client's connection
        assert not shared._http.is_closed
        shared.reorder(FAKE_QUERY, FAKE_PASSAGES, strategy=STRATEGY)
