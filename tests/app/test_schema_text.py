"""The schema and the server agree on texts (issue 77): a query, passage or document the
OpenAPI document admits is one the server takes, and one it refuses is refused by the
schema too. The document admitted ``""`` and whitespace for the bare-string passages and
documents (schemathesis: "schema-valid request rejected" on ``/v1/reorder`` and the three
rerank routes), which the server refused with 422.

The schema side is the committed snapshot (``tests/app/openapi.json``, what clients generate
from) read by a JSON Schema validator; the server side is the app on the fake backend.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from app.schemas.base import NOT_BLANK
from tests.app.conftest import QUERY, Harness

SPEC = json.loads((Path(__file__).parent / "openapi.json").read_text())
# Every character str.strip() removes, alone, then mixed, then texts that hold something else
# (U+FEFF is whitespace to ECMA 262's \s but not to Python: the server keeps it).
WHITESPACE = [chr(c) for c in range(0x110000) if chr(c).isspace()]
BLANK = ["", *WHITESPACE, " \t\n", "\u3000\u2028\x1c"]
NOT_BLANK_TEXTS = ["a", " a ", "\ufeff", "\x1c.\x1c", "\U0001f600", "\u200b"]


def _admits(schema_name: str, body: dict[str, Any]) -> bool:
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{schema_name}", "components": SPEC["components"]}
    )
    return validator.is_valid(body)


def test_the_pattern_spells_out_every_whitespace_character() -> None:
    assert WHITESPACE and all(ord(c) < 0x10000 for c in WHITESPACE)  # the class is BMP only
    for c in map(chr, range(0x10000)):
        assert (re.search(NOT_BLANK, c) is None) == c.isspace(), hex(ord(c))


# (route, schema, body with the text in it): every place a text reaches a prompt.
PLACES = [
    ("/v1/reorder", "ReorderBody", lambda t: {"query": QUERY, "passages": [t, "other"]}),
    ("/v1/reorder", "ReorderBody", lambda t: {"query": QUERY, "passages": [{"text": t}]}),
    ("/v1/reorder", "ReorderBody", lambda t: {"query": t, "passages": ["one", "two"]}),
    ("/v1/rerank", "RerankBody", lambda t: {"query": QUERY, "documents": [t, "other"]}),
    ("/rerank", "RerankBody", lambda t: {"query": QUERY, "documents": [{"text": t}]}),
    ("/v2/rerank", "RerankBody", lambda t: {"query": t, "documents": ["one"]}),
]


@pytest.mark.parametrize(("route", "schema", "body"), PLACES)
async def test_schema_and_server_agree_on_blank_texts(
    served: Harness, route: str, schema: str, body: Any
) -> None:
    for text in [*BLANK, *NOT_BLANK_TEXTS]:
        request = body(text)
        admitted = _admits(schema, request)
        assert admitted == (text not in BLANK), (route, repr(text))
        r = await served.client.post(route, json=request)
        if admitted:
            assert r.status_code == 200, (route, repr(text), r.text)
        else:
            assert r.status_code == 422, (route, repr(text), r.text)
            err = r.json()["error"]
            # "" is too short for the schema; whitespace is blank, the service's old code.
            code = "invalid_request" if text else "validation_error"
            assert err["param"] and err["code"] == code, err
            if text:
                assert f"{err['param']} is empty: it holds only whitespace" in err["message"]
