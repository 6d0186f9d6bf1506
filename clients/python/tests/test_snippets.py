"""The Python snippets of the README's "Use it from your framework" and of docs/integrations.md
run as written (the base URL swapped for a real server's, SmolLM2 on the CPU), and each
returns the order the page says: the service's placement."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from rag_reorder import Client, Passage
from servers import ROOT, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_BLOCK = re.compile(r"<!-- py:([\w-]+):begin -->\s*```python\n(.*?)```\s*<!-- py:\1:end -->", re.S)
QUESTION = "What is the capital of France?"


def run_snippets(page: Path, server: ServerProcess) -> tuple[list[str], dict[str, Any]]:
    """Every marked block of ``page``, in order, in one namespace (they build on each other)."""
    blocks = _BLOCK.findall(page.read_text())
    ns: dict[str, Any] = {"__name__": f"snippets_{page.stem}"}
    for name, code in blocks:
        local = code.replace("http://localhost:8000", server.base_url)
        exec(compile(local, f"{page.name}:{name}", "exec"), ns)
    return [name for name, _ in blocks], ns


def placement(server: ServerProcess, texts: list[str], **kwargs: Any) -> list[int]:
    with Client(server.base_url) as c:
        return list(c.reorder(QUESTION, texts, **kwargs).order)


def in_order_of_appearance(text: str, texts: list[str]) -> list[int]:
    return [i for _, i in sorted((text.index(t), i) for i, t in enumerate(texts) if t in text)]


def test_the_readme_snippets(smollm2_service: ServerProcess) -> None:
    names, ns = run_snippets(ROOT / "README.md", smollm2_service)
    assert names == ["langchain", "llamaindex", "cohere"]
    texts = ns["texts"]
    expected = placement(smollm2_service, texts)
    assert [texts.index(d.page_content) for d in ns["placed"]] == expected
    assert in_order_of_appearance(ns["context"], texts) == expected
    assert [texts.index(n.node.get_content()) for n in ns["nodes"]] == expected
    assert ns["prompt_order"] == expected


def test_the_integrations_page_snippets(smollm2_service: ServerProcess) -> None:
    names, ns = run_snippets(ROOT / "docs" / "integrations.md", smollm2_service)
    assert names == [
        "langchain-chain",
        "llamaindex-engine",
        "haystack-pipeline",
        "client",
        "cohere-v1",
    ]
    texts = ns["texts"]
    expected = placement(smollm2_service, texts)
    assert in_order_of_appearance(ns["prompt_text"], texts) == placement(
        smollm2_service, texts, top_n=3
    )
    scored = [Passage(text=t, score=1.0 - k / 10) for k, t in enumerate(texts)]
    assert in_order_of_appearance(str(ns["response"]), texts) == placement(smollm2_service, scored)
    assert ns["prompt_passages"] == [texts[i] for i in expected]
    assert ns["best_two"] == [texts[i] for i in placement(smollm2_service, texts, top_n=2)]
    assert ns["error"] == (422, "validation_error", "strategy")
    # Haystack: the prompt holds the reordered documents in the order the ranker returned.
    placed_docs = [d.content for d in ns["haystack_docs"]]
    assert sorted(placed_docs) == sorted(texts)
    assert in_order_of_appearance(ns["haystack_prompt"], texts) == [
        texts.index(t) for t in placed_docs
    ]
    assert ns["placed_texts"] == [texts[i] for i in expected]
