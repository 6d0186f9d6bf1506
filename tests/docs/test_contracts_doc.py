"""docs/development.md lists the import contracts lint-imports enforces, generated from
pyproject.toml: it must not go stale (it had, once, by hand)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_contracts_list_is_current() -> None:
    gen = load_script(ROOT / "scripts" / "gen_contracts_doc.py", "gen_contracts_doc")
    page = (ROOT / "docs" / "development.md").read_text()
    block = page[page.index(gen.BEGIN) : page.index(gen.END) + len(gen.END)]
    assert block == gen.render(), (
        "docs/development.md is stale: run .venv/bin/python scripts/gen_contracts_doc.py"
    )
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    for contract in contracts["contracts"]:
        assert f"**{contract['name']}**" in block
        for allowed in contract.get("ignore_imports", []):
            assert f"`{allowed}`" in block
