"""The README's configuration reference is generated from Settings and must not go stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_configuration_reference_is_current() -> None:
    gen = _script()
    readme = (ROOT / "README.md").read_text()
    assert gen.rewrite(readme) == readme, (
        "README.md's configuration reference is stale: run "
        ".venv/bin/python scripts/gen_config_reference.py"
    )


def test_every_setting_is_documented() -> None:
    gen = _script()
    block = gen.render()
    from service.settings import Settings

    for name, field in Settings.model_fields.items():
        assert f"`RAG_REORDER_{name.upper()}`" in block
        assert field.description, f"Settings.{name} has no docstring"
