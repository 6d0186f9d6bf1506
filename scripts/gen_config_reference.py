"""Generate the configuration reference (docs/configuration.md) from the settings class.

    python scripts/gen_config_reference.py          # rewrite the block in docs/configuration.md
    python scripts/gen_config_reference.py --check  # exit 1 if the block is stale

The block between ``<!-- config:begin -->`` and ``<!-- config:end -->`` is one table per
section of ``service/config/settings.py`` (its ``# --- name ---`` comments), one row per field: the
environment variable, the type, the default and the field's docstring.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic import SecretStr  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from service.config.settings import Settings  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
SETTINGS_SOURCE = ROOT / "service" / "config" / "settings.py"
BEGIN, END = "<!-- config:begin -->", "<!-- config:end -->"
_SECTION = re.compile(r"^\s*# --- (.+?) -*$")
_FIELD = re.compile(r"^    (\w+)\s*:")
_TYPE_NAMES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "Path": "path",
}


def _sections() -> list[tuple[str, list[str]]]:
    """Field names grouped by the section comments of the settings source, in order."""
    fields = set(Settings.model_fields)
    out: list[tuple[str, list[str]]] = [("settings", [])]
    for line in SETTINGS_SOURCE.read_text().splitlines():
        if m := _SECTION.match(line):
            out.append((m.group(1).strip(), []))
        elif (m := _FIELD.match(line)) and m.group(1) in fields:
            out[-1][1].append(m.group(1))
    listed = {name for _, names in out for name in names}
    missing = [name for name in Settings.model_fields if name not in listed]
    if missing:
        out.append(("other", missing))
    return [(title, names) for title, names in out if names]


def _type(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is tuple:
        return f"list of {_type(args[0])}" if args else "list"
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type):
        return _TYPE_NAMES.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        value = list(value)
        return "`[]`" if not value else f"`{value}`"
    if isinstance(value, Path):
        value = str(value).replace(str(Path.home()), "~", 1)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The generated block, markers excluded."""
    lines: list[str] = []
    for title, names in _sections():
        lines += [f"**{title}**", ""]
        lines += ["| variable | type | default | description |", "|---|---|---|---|"]
        for name in names:
            field = Settings.model_fields[name]
            env = f"`RAG_REORDER_{name.upper()}`"
            lines.append(
                f"| {env} | {_type(field.annotation)} | {_default(name)} | "
                f"{_cell(field.description or '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def rewrite(page: str) -> str:
    """``page`` with the block between the markers replaced by ``render()``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE.name} needs {BEGIN} ... {END}")
    return page[: start + len(BEGIN)] + "\n" + render() + page[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = ap.parse_args()
    current = PAGE.read_text()
    updated = rewrite(current)
    if args.check:
        if updated != current:
            print("docs/configuration.md is stale: run", __file__, file=sys.stderr)
            return 1
        return 0
    if updated != current:
        PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
