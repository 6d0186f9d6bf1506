"""The OpenAPI document is a contract: compared with a snapshot.

Regenerate after an intended change: ``UPDATE_OPENAPI_SNAPSHOT=1 pytest tests/app/test_openapi.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from app.main import create_app
from service.config.settings import Settings

SNAPSHOT = Path(__file__).with_name("openapi.json")


def current(tmp_path: Path) -> dict[str, Any]:
    doc = create_app(Settings(cache_dir=tmp_path)).openapi()
    doc["info"]["version"] = "<version>"  # the package version is not part of the contract
    return doc


def test_openapi_matches_the_snapshot(tmp_path: Path) -> None:
    doc = current(tmp_path)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_OPENAPI_SNAPSHOT"):
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.exists(), "no snapshot: run with UPDATE_OPENAPI_SNAPSHOT=1"
    assert json.loads(SNAPSHOT.read_text()) == doc, (
        "the OpenAPI document changed; if intended, regenerate with UPDATE_OPENAPI_SNAPSHOT=1"
    )


def test_every_route_documents_its_errors(tmp_path: Path) -> None:
    doc = current(tmp_path)
    envelope = "#/components/schemas/ErrorEnvelope"
    for path, item in doc["paths"].items():
        for method, op in item.items():
            errors = {s: r for s, r in op["responses"].items() if s[0] in "45"}
            assert errors, f"{method.upper()} {path} documents no error"
            for status, resp in errors.items():
                ref = resp["content"]["application/json"]["schema"]["$ref"]
                assert ref == envelope, (path, status)
    post = doc["paths"]["/v1/reorder"]["post"]["responses"]
    assert {"401", "413", "422", "500", "503", "504"} <= set(post)
    # Passages and documents accept a bare string or an object; the string is bounded and not
    # blank, as the object's text is (the server refuses both alike: test_schema_text).
    schemas = doc["components"]["schemas"]
    for body, field, obj in (
        ("ReorderBody", "passages", "PassageIn"),
        ("RerankBody", "documents", "RerankDocument"),
    ):
        string = next(
            s for s in schemas[body]["properties"][field]["items"]["anyOf"] if "type" in s
        )
        text = schemas[obj]["properties"]["text"]
        for key in ("type", "minLength", "maxLength", "pattern"):
            assert string[key] == text[key], (body, key)
