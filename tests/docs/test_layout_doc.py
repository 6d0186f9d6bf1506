"""docs/development.md's module map is generated from the packages' docstrings: it must list
the tree that exists, and every package and module must say what it owns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_module_map_is_current() -> None:
    gen = load_script(ROOT / "scripts" / "gen_layout.py", "gen_layout")
    page = (ROOT / "docs" / "development.md").read_text()
    block = page[page.index(gen.BEGIN) : page.index(gen.END) + len(gen.END)]
    assert block == gen.render(), "docs/development.md is stale: run scripts/gen_layout.py"
    for package in gen.PACKAGES:
        for module in (ROOT / package).rglob("*.py"):
            assert f"`{module.name}`" in block or f"`{module.parent.relative_to(ROOT)}/`" in block


def test_a_module_without_a_docstring_is_refused(tmp_path: Path) -> None:
    gen = load_script(ROOT / "scripts" / "gen_layout.py", "gen_layout")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "pkg" / "bare.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"pkg/bare\.py has no docstring"):
        gen.render(tmp_path, ("pkg",))


def test_summaries_stop_at_the_first_sentence_and_leave_out_issue_numbers(
    tmp_path: Path,
) -> None:
    gen = load_script(ROOT / "scripts" / "gen_layout.py", "gen_layout")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package. With detail."""\n')
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""What it owns (issue 12). More detail.\\n\\nA second paragraph."""\n'
    )
    assert gen.render(tmp_path, ("pkg",)).splitlines()[3:5] == [
        "- `pkg/`: A package.",
        "  - `mod.py`: What it owns.",
    ]
