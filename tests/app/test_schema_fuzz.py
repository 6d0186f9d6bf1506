"""Schema-driven fuzz of the HTTP API: schemathesis reads the served ``/openapi.json`` and sends
what it generates from it, bodies that fit the schema and bodies that break it, to a real
server process (uvicorn, every middleware, the fake backend of ``service.backends.fakes.fake``:
what is fuzzed is the HTTP edge, not a model's speed).

Each answer must be below 500, carry the error envelope when it is an error, use a status the
route documents, and match the documented response schema. Bounded: ``EXAMPLES`` cases per
operation, derandomized (the same cases every run). The module prints the cases and statuses
it saw; docs/operations.md quotes the figure.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from service.strategies import strategy_names
from tests.app.conftest import Harness
from tests.app.processes import ServerProcess, server_process

EXAMPLES = 100
SEEN: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("schema-fuzz") / "server.log"
    # Writes open so the calibration route is fuzzed past its 403.
    env = {"RAG_REORDER_OPEN_WRITES": "true", "HF_HUB_OFFLINE": "1"}
    with server_process(["-m", "tests.app.fake_server", "--port", "{port}"], log, env) as srv:
        srv.wait_ready(60)
        yield srv
        assert srv.proc.poll() is None, srv.log()  # the fuzz did not take the server down
    total = sum(SEEN.values())
    statuses = Counter[int]()
    for (_, status), n in SEEN.items():
        statuses[status] += n
    print(f"\nschema fuzz: {total} cases, statuses {dict(sorted(statuses.items()))}")


@pytest.fixture(scope="module")
def operations(fuzzed_server: ServerProcess) -> dict[str, Any]:
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    return {r.ok().label: r.ok() for r in schema.get_all_operations()}


# The routes of the committed OpenAPI document (tests/app/openapi.json), each with valid
# inputs and, where it takes any (a body, a parameter), with inputs that break the schema. A
# route added there and not answered here fails test_the_fuzz_covered_every_route.
_PATHS = json.loads((Path(__file__).parent / "openapi.json").read_text())["paths"]
LABELS = sorted(f"{method.upper()} {path}" for path, item in _PATHS.items() for method in item)


def _query(op: dict[str, Any]) -> bool:
    # A path parameter is any string: nothing in a URL breaks its schema.
    return any(p.get("in") == "query" for p in op.get("parameters", []))


CASES = [
    (f"{method.upper()} {path}", mode)
    for path, item in sorted(_PATHS.items())
    for method, op in item.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or "requestBody" in op or _query(op)
]


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_no_generated_request_gets_a_5xx_or_an_undocumented_answer(
    operations: dict[str, Any], label: str, mode: GenerationMode, fuzzed_server: ServerProcess
) -> None:
    operation = operations[label]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        response = case.call(base_url=fuzzed_server.base_url, timeout=60)
        SEEN[(label, response.status_code)] += 1
        assert response.status_code < 500, (label, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert {"type", "message", "param", "code", "request_id"} <= set(error), error
        checks = [not_a_server_error, status_code_conformance]
        if mode is GenerationMode.POSITIVE:
            checks.append(response_schema_conformance)
        case.validate_response(response, checks=checks)

    fuzz()


# Generated bodies name a strategy only as often as the enum's draw falls on it: each one gets
# its own cases here (issue 77), on the native route and on a rerank route, the strategy set
# in every generated body (options it does not read are a 422, as they should be).
STRATEGY_EXAMPLES = 12
NAMED: Counter[str] = Counter()


def _name_strategy(body: Any, label: str, name: str) -> Any:
    if not isinstance(body, dict):
        return body
    if label == "POST /v1/reorder":
        return {**body, "strategy": name}
    reorder = body.get("reorder")
    return {**body, "reorder": {**(reorder if isinstance(reorder, dict) else {}), "strategy": name}}


@pytest.mark.parametrize("name", strategy_names())
@pytest.mark.parametrize("label", ["POST /v1/reorder", "POST /v1/rerank"])
def test_generated_requests_naming_each_strategy(
    operations: dict[str, Any], label: str, name: str, fuzzed_server: ServerProcess
) -> None:
    operation = operations[label]

    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(
        max_examples=STRATEGY_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        case.body = _name_strategy(case.body, label, name)
        response = case.call(base_url=fuzzed_server.base_url, timeout=60)
        SEEN[(label, response.status_code)] += 1
        NAMED[name] += 1
        assert response.status_code < 500, (label, name, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert {"type", "message", "param", "code", "request_id"} <= set(error), error
        else:
            data = response.json()
            meta = data if label == "POST /v1/reorder" else data["meta"]["reorder"]
            assert meta["strategy"] == name, meta
        case.validate_response(
            response,
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
        )

    fuzz()
    assert NAMED[name] > 0


def test_the_fuzz_covered_every_route(fuzzed_server: ServerProcess) -> None:
    # Runs after the parametrized cases (file order): each operation got its cases.
    labels = {label for label, _ in SEEN}
    assert labels == set(LABELS), set(LABELS) - labels
    assert any(status == 200 for _, status in SEEN), SEEN
    assert any(status == 422 for _, status in SEEN), SEEN
    assert Path(fuzzed_server.log_path).exists()


async def test_a_405_allows_exactly_the_methods_the_schema_lists_for_the_path(
    served: Harness,
) -> None:
    """Issue 90: ``OPTIONS /v1/bias-profiles/calibrate`` answered ``Allow: GET, POST``, though
    the schema lists only POST there (the GET was ``/v1/bias-profiles/{profile_id}``'s, with
    ``calibrate`` as an id). Every documented path, its parameters filled: a method no route
    serves is a 405 whose ``Allow`` is the methods the OpenAPI document lists for it."""
    order = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
    for template, item in sorted(_PATHS.items()):
        path = re.sub(r"\{[^}/]+\}", "some-id", template)
        listed = [m for m in order if m.lower() in item]
        for method in ("OPTIONS", "PATCH"):
            r = await served.client.request(method, path)
            assert r.status_code == 405, (method, path, r.text)
            assert r.headers["allow"] == ", ".join(listed), (template, r.headers["allow"])
            assert r.json()["error"]["code"] == "method_not_allowed"
