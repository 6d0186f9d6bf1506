"""The API reference page (docs/reference/api.md) is generated from the OpenAPI snapshot and
must not go stale: ``test_openapi`` keeps the snapshot equal to what the app serves, this test
keeps the page equal to the snapshot."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_api_reference.py", "gen_api_reference")


def test_api_reference_is_current() -> None:
    gen = _script()
    spec = json.loads(gen.SPEC.read_text())
    assert gen.render(spec) == gen.PAGE.read_text(), (
        "docs/reference/api.md is stale: run .venv/bin/python scripts/gen_api_reference.py"
    )


def test_every_route_and_schema_is_on_the_page() -> None:
    gen = _script()
    spec = json.loads(gen.SPEC.read_text())
    page = gen.PAGE.read_text()
    for path, item in spec["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in page
    for name in spec["components"]["schemas"]:
        assert f"### {name} {{#schema-{name.lower()}}}" in page


def test_a_type_expression_links_its_schema() -> None:
    gen = _script()
    schema = {"anyOf": [{"$ref": "#/components/schemas/DesignIn"}, {"type": "null"}]}
    assert gen.type_of(schema) == "[DesignIn](#schema-designin) \\| null"
    bounded = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8}
    assert gen.type_of(bounded) == "array of string (min items 1, max items 8)"
