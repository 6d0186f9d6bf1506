"""The installed wheel is typed (PEP 561): a user's code that calls the public API type-checks
under ``mypy --strict`` against the wheel in this virtualenv, with the exact types, not ``Any``.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

# A RAG backend's use of every public entry point. `assert_type` fails on `Any` as on a wrong
# type; the `type: ignore` must be needed (--strict warns of an unused one), so a package that
# mypy cannot see into (no py.typed) or that degrades to `Any` fails too.
USER_CODE = """
from __future__ import annotations

from collections.abc import Sequence
from typing import assert_type

import httpx
from haystack import Document as HaystackDocument
from langchain_core.documents import Document
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rag_reorder import (
    AsyncClient,
    Client,
    Passage,
    PositionBias,
    RagReorderError,
    Reordering,
    Reranking,
    RerankResult,
    ScoredPassage,
)
from rag_reorder.haystack import RagReorderRanker
from rag_reorder.langchain import RagReorderCompressor
from rag_reorder.llama_index import RagReorderPostprocessor


def sync(texts: list[str]) -> list[str]:
    with Client("http://rag-reorder:8000", api_key="k", max_retries=2) as client:
        out = client.reorder("q", [*texts, Passage(text="t", score=0.5)], top_n=3)
        assert_type(out, Reordering)
        assert_type(out.order, tuple[int, ...])
        assert_type(out.position_bias, PositionBias | None)
        assert_type(out.passage(0), ScoredPassage)
        ranked = client.rerank("q", texts, results_order="placement")
        assert_type(ranked, Reranking)
        assert_type(ranked.results[0], RerankResult)
        client.reorder("q", texts, top_n="3")  # type: ignore[arg-type]
        return [texts[i] for i in out.top(2)]


async def asynchronous(texts: list[str], http: httpx.AsyncClient) -> Reordering:
    async with AsyncClient(http_client=http) as client:
        try:
            return await client.reorder("q", texts, strategy="moi", placement="litm")
        except RagReorderError as exc:
            assert_type(exc.status, int | None)
            raise


def adapters(docs: list[Document], nodes: list[NodeWithScore], client: Client) -> None:
    with RagReorderCompressor(base_url="http://rag-reorder:8000", top_n=5) as compressor:
        assert_type(compressor.compress_documents(docs, "q"), Sequence[Document])
        assert_type(compressor.reorder(docs, "q"), Reordering)
    shared = RagReorderCompressor(client=client)
    shared.close()
    post = RagReorderPostprocessor(client=client, placement="bias_matched")
    assert_type(post.postprocess_nodes(nodes, QueryBundle("q")), list[NodeWithScore])
    post.close()
    nodes.append(NodeWithScore(node=TextNode(text="t"), score=1.0))
    with RagReorderRanker(base_url="http://rag-reorder:8000", top_n=3) as ranker:
        ranker.warm_up()
        out = ranker.run(query="q", documents=[HaystackDocument(content="t")])
        assert_type(out, dict[str, list[HaystackDocument]])
"""


def test_py_typed_is_in_the_wheel() -> None:
    shipped = {str(f) for f in importlib.metadata.files("rag-reorder-client") or []}
    assert "rag_reorder/py.typed" in shipped


def test_a_users_code_type_checks_against_the_installed_wheel(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    # Its own config: none of the repository's mypy settings (or its sources) apply.
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            # Kept with the virtualenv: the frameworks' modules are checked once, not per run
            # (about 20 s), and the virtualenv is rebuilt when they change.
            "--cache-dir",
            str(Path(sys.prefix) / ".mypy_cache"),
            "user.py",
        ],
        cwd=tmp_path,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
