"""The configuration reference (docs/configuration.md) is generated from Settings and must not
go stale."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from service.config.settings import Settings
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_config_reference.py", "gen_config_reference")


def test_configuration_reference_is_current() -> None:
    gen = _script()
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert gen.rewrite(page) == page, (
        "docs/configuration.md is stale: run .venv/bin/python scripts/gen_config_reference.py"
    )


def test_every_setting_is_documented() -> None:
    gen = _script()
    block = gen.render()
    for name, field in Settings.model_fields.items():
        assert f"`RAG_REORDER_{name.upper()}`" in block
        assert field.description, f"Settings.{name} has no docstring"


def test_the_readme_essentials_name_real_settings_with_their_defaults() -> None:
    # The README's "Configure" table is hand-picked, so check it against Settings: every
    # variable exists and every default shown is the generated reference's.
    gen = _script()
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Configure\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `RAG_REORDER_")]
    assert len(rows) >= 5
    for row in rows:
        names_cell, default_cell = (c.strip() for c in row.strip("|").split("|")[:2])
        names = re.findall(r"`RAG_REORDER_(\w+)`", names_cell)
        defaults = [d.strip() for d in default_cell.split(",")]
        assert len(defaults) in (1, len(names)), row
        for i, name in enumerate(names):
            assert name.lower() in Settings.model_fields, name
            shown = defaults[i if len(defaults) > 1 else 0]
            assert shown == gen._default(name.lower()), (name, shown)
