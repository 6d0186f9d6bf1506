"""The wheel's metadata publishes as it is: its README is the package index page, so every link
in it is absolute and points at a file that exists in this repository, the project's URLs are
declared, and the page and the package's docstring name every adapter an extra installs."""

from __future__ import annotations

import importlib.metadata
import re

import rag_reorder
from servers import ROOT

DIST = "rag-reorder-client"
# The extras that install an adapter, and the adapter each installs.
ADAPTERS = {
    "langchain": "rag_reorder.langchain.RagReorderCompressor",
    "llamaindex": "rag_reorder.llama_index.RagReorderPostprocessor",
    "haystack": "rag_reorder.haystack.RagReorderRanker",
}
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def project_urls() -> dict[str, str]:
    entries = importlib.metadata.metadata(DIST).get_all("Project-URL") or []
    return dict(e.split(", ", 1) for e in entries)


def package_page() -> str:
    meta = importlib.metadata.metadata(DIST)
    assert meta["Description-Content-Type"] == "text/markdown"
    return meta["Description"]


def test_the_project_urls_are_declared_and_absolute() -> None:
    urls = project_urls()
    assert {"Homepage", "Documentation", "Repository", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values()), urls


def test_every_link_of_the_package_page_is_absolute_and_exists_in_the_repository() -> None:
    page = package_page()
    assert page.startswith("# rag-reorder-client")
    links = _LINK.findall(page)
    assert links, "the page links to the guide and the changelog"
    urls = project_urls()
    repository = urls["Repository"].rstrip("/")
    files = f"{repository}/blob/main/"
    for link in [*links, *urls.values()]:
        assert link.startswith("https://"), f"relative on the index page: {link}"
        if link.startswith(files):
            path = link.removeprefix(files).split("#")[0]
            assert (ROOT / path).is_file(), f"{link}: no {path} in the repository"
        else:
            assert link.rstrip("/").startswith(repository), f"not the repository's: {link}"


def test_the_page_and_the_docstring_name_every_adapter() -> None:
    page = package_page()
    extras = set(importlib.metadata.metadata(DIST).get_all("Provides-Extra") or [])
    assert set(ADAPTERS) == extras - {"test"}
    docstring = rag_reorder.__doc__ or ""
    for extra, adapter in ADAPTERS.items():
        install = f"pip install 'rag-reorder-client[{extra}]'"
        assert install in page and adapter in page, (extra, adapter)
        assert install in docstring and adapter in docstring, (extra, adapter)
