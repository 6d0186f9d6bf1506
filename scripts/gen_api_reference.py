"""Generate the HTTP API reference (docs/reference/api.md) from the OpenAPI document.

    python scripts/gen_api_reference.py          # rewrite docs/reference/api.md
    python scripts/gen_api_reference.py --check  # exit 1 if the page is stale

The source is the snapshot ``tests/app/openapi.json``, which ``tests/app/test_openapi.py``
keeps equal to what the app serves, so the page, the snapshot and the server cannot drift
apart: a wire change fails the snapshot test, and a regenerated snapshot without a
regenerated page fails ``tests/app/test_api_reference.py``. Reading the snapshot (not
importing the app) keeps this script free of the service's dependencies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "tests" / "app" / "openapi.json"
PAGE = ROOT / "docs" / "reference" / "api.md"
_METHODS = ("get", "post", "put", "patch", "delete")

Schema = dict[str, Any]


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _anchor(name: str) -> str:
    # Explicit ids ({#...} via attr_list) so links do not depend on the slugifier.
    return "schema-" + name.lower()


def _bounds(schema: Schema) -> str:
    parts = []
    for key, label in (
        ("minLength", "min length"),
        ("maxLength", "max length"),
        ("minItems", "min items"),
        ("maxItems", "max items"),
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ):
        if key in schema:
            value = schema[key]
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            parts.append(f"{label} {value}")
    pattern = schema.get("pattern")
    if pattern is not None:
        parts.append(_pattern(pattern))
    return ", ".join(parts)


def _pattern(pattern: str) -> str:
    # app.schemas.NOT_BLANK spells out every character str.isspace() knows (tab to space
    # first); shown by what it means, not by its forty characters of escapes.
    if pattern.startswith("[^\\u0009-\\u000d") and "\\u0020" in pattern:
        return "not only whitespace"
    return f"pattern `{pattern}`"


def type_of(schema: Schema) -> str:
    """A short, linked type expression for one JSON schema."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_anchor(name)})"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " \\| ".join(type_of(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        inner = type_of(schema.get("items", {}))
        text = f"array of {inner}"
    elif kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        text = f"object of {type_of(extra)}" if isinstance(extra, dict) else "object"
    elif isinstance(kind, str):
        text = kind
    else:
        text = "any"
    bounds = _bounds(schema)
    return f"{text} ({bounds})" if bounds else text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(schema: Schema) -> str:
    if "default" not in schema:
        return ""
    return f"`{json.dumps(schema['default'])}`"


def render_schema(name: str, schema: Schema) -> list[str]:
    lines = [f"### {name} {{#{_anchor(name)}}}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    props: dict[str, Schema] = schema.get("properties", {})
    if not props:
        lines += [f"Type: {type_of(schema)}", ""]
        return lines
    required = set(schema.get("required", []))
    extra = schema.get("additionalProperties")
    if extra is False:
        lines += ["Unknown fields are refused (422).", ""]
    lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, sub in props.items():
        lines.append(
            f"| `{field}` | {type_of(sub)} | {'yes' if field in required else ''} | "
            f"{_default(sub)} | {_cell(sub.get('description', ''))} |"
        )
    lines.append("")
    return lines


def _body_schema(content: dict[str, Any]) -> str:
    for media, spec in content.items():
        schema = spec.get("schema")
        if schema:
            return f"{type_of(schema)} (`{media}`)"
        return f"`{media}`"
    return ""


def render_operation(path: str, method: str, op: Schema) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [f"**{op['summary']}.**", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else ''} | {_cell(p.get('description', ''))} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        lines += [f"Request body: {_body_schema(body.get('content', {}))}", ""]
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for status, resp in op.get("responses", {}).items():
        lines.append(
            f"| {status} | {_cell(resp.get('description', ''))} | "
            f"{_body_schema(resp.get('content', {}))} |"
        )
    lines.append("")
    return lines


def render(spec: Schema) -> str:
    """The whole page for one OpenAPI document."""
    info = spec["info"]
    lines = [
        "# API reference",
        "",
        "<!-- Generated by scripts/gen_api_reference.py from tests/app/openapi.json: do not edit."
        " -->",
        "",
        f"{info.get('summary', '')} OpenAPI {spec['openapi']}. A running server serves the same"
        " document at `/openapi.json` and an interactive version at `/docs`; the",
        "[HTTP API guide](../api.md) explains the semantics, with examples.",
        "",
        "## Routes",
        "",
    ]
    for path, item in spec["paths"].items():
        for method in _METHODS:
            if method in item:
                lines += render_operation(path, method, item[method])
    lines += ["## Schemas", ""]
    for name, schema in sorted(spec["components"]["schemas"].items()):
        lines += render_schema(name, schema)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = ap.parse_args()
    updated = render(json.loads(SPEC.read_text()))
    current = PAGE.read_text() if PAGE.exists() else ""
    if args.check:
        if updated != current:
            print("docs/reference/api.md is stale: run", __file__, file=sys.stderr)
            return 1
        return 0
    if updated != current:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
