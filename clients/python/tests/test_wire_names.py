"""The client's names of strategies, placements, design kinds and results orders are the
server's: compared with a running server's OpenAPI document, so neither can change alone."""

from __future__ import annotations

from typing import Any, get_args

import httpx
import pytest
from rag_reorder import DesignKind, Placement, ResultsOrder, Strategy
from servers import API_KEY, ServerProcess

pytestmark = pytest.mark.timeout(60)


def enum_of(schema: dict[str, Any]) -> list[str]:
    """The string enum of a property, through ``anyOf: [{enum}, {null}]``."""
    if "enum" in schema:
        return list(schema["enum"])
    (found,) = [s["enum"] for s in schema.get("anyOf", []) if "enum" in s]
    return list(found)


@pytest.fixture(scope="module")
def schemas(fake_service: ServerProcess) -> dict[str, Any]:
    auth = {"authorization": f"Bearer {API_KEY}"}
    doc = httpx.get(f"{fake_service.base_url}/openapi.json", headers=auth, timeout=10).json()
    return dict(doc["components"]["schemas"])


@pytest.mark.parametrize(
    ("name", "schema", "prop"),
    [
        (Strategy, "ReorderBody", "strategy"),
        (Strategy, "RerankOptions", "strategy"),
        (Placement, "ReorderBody", "placement"),
        (Placement, "RerankOptions", "placement"),
        (DesignKind, "DesignIn", "kind"),
        (ResultsOrder, "RerankOptions", "results_order"),
    ],
)
def test_a_client_name_list_is_the_servers_enum(
    schemas: dict[str, Any], name: Any, schema: str, prop: str
) -> None:
    assert list(get_args(name)) == enum_of(schemas[schema]["properties"][prop])


def test_the_adapters_take_every_placement_the_server_accepts() -> None:
    from rag_reorder.langchain import RagReorderCompressor
    from rag_reorder.llama_index import RagReorderPostprocessor

    for placement in get_args(Placement):
        assert RagReorderCompressor(placement=placement).placement == placement
        assert RagReorderPostprocessor(placement=placement).placement == placement
