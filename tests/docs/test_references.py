"""Public docs name only what their reader can open: a file of this repository, a page of the
docs, or a paper by its title and link. The design notes, the source papers' numbers and the
tracker's issue numbers live outside the repository, so a reference to them is a dead end.

Public text: the README, the docs site, the client distribution's pages and its docstrings
(what `help(rag_reorder)` shows) and the OpenAPI document (the API reference and `/docs`).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# `paper 000`, `(003)`: the source papers' numbers in the team's notes.
PAPER_NUMBER = re.compile(r"\b[Pp]apers? 00\d\b|\(00\d[),]|\b00\d's\b")
# `issue 44`, `issue #44`: the team's tracker.
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+\b")
# `METHOD.md`, `RELIABILITY.md`: a capitalised Markdown file name, which must exist here.
CAPS_FILE = re.compile(r"\b([A-Z][A-Z_]+\.md)\b")
# A relative Markdown link: [text](path), not a URL, not an in-page anchor.
LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")


def tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines()]


def public_texts() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "clients" / "python").glob("*.md"))
    files += sorted((ROOT / "clients" / "python" / "rag_reorder").glob("*.py"))
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    spec = json.loads((ROOT / "tests" / "app" / "openapi.json").read_text())
    texts["openapi.json"] = "\n".join(_strings(spec))
    return texts


def _strings(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def problems(name: str, text: str, basenames: set[str]) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PAPER_NUMBER.finditer(line):
            found.append(f"{name}:{n}: {m.group(0)!r}: cite the paper by title and link")
        for m in ISSUE_NUMBER.finditer(line):
            found.append(f"{name}:{n}: {m.group(0)!r}: a reader cannot open the tracker")
        for m in CAPS_FILE.finditer(line):
            if m.group(1) not in basenames:
                found.append(f"{name}:{n}: {m.group(1)} is not in the repository")
    return found


def test_public_docs_cite_nothing_a_reader_cannot_open() -> None:
    basenames = {p.name for p in tracked()}
    found = [p for name, text in public_texts().items() for p in problems(name, text, basenames)]
    assert not found, "\n".join(found)


def test_relative_links_outside_the_docs_site_resolve() -> None:
    # mkdocs --strict checks the docs site's own links; these pages are outside it.
    pages = [ROOT / "README.md", *sorted((ROOT / "clients" / "python").glob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in LINK.findall(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("as paper 000 does", 1),
        ("`lore` (003)", 1),
        ("(000's baselines)", 1),
        ("`max_relevance` (004, iv)", 1),
        ("see issue 44 and issue #7", 2),
        ("the design notes' METHOD.md", 1),
        ("README.md and the MoI paper (arXiv:2412.10684)", 0),
    ],
)
def test_the_checks_catch_what_they_claim(text: str, count: int) -> None:
    assert len(problems("t", text, {"README.md"})) == count
