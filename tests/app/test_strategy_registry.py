"""A strategy's name is typed once, on its class, and listed once, in the registry
(``service.strategies``): the wire schema's accepted values (and so the OpenAPI document),
``/info``'s lists and the CLI's choices are the registry's, so registering a strategy is all
it takes to be accepted, documented and listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from service.strategies import ranking_strategy_names, strategy_names
from tests.app.conftest import Harness, serving, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _enums(doc: dict[str, Any], prop: str) -> dict[str, list[str]]:
    """Every schema's ``prop`` enum in an OpenAPI document, by schema name (through
    ``anyOf: [{enum}, {null}]`` for an optional one)."""
    found: dict[str, list[str]] = {}
    for name, schema in doc["components"]["schemas"].items():
        spec = schema.get("properties", {}).get(prop)
        if spec is None:
            continue
        options = [spec, *spec.get("anyOf", [])]
        (enum,) = [o["enum"] for o in options if "enum" in o]
        found[name] = enum
    return found


async def test_the_schema_info_and_registry_list_the_same_names(served: Harness) -> None:
    doc = (await served.client.get("/openapi.json")).json()
    info = (await served.client.get("/info")).json()
    names = list(strategy_names())
    strategy_fields = _enums(doc, "strategy")
    # The native route, the rerank routes' options and the batch route all take one.
    assert {"ReorderBody", "RerankOptions"} <= set(strategy_fields)
    assert all(enum == names for enum in strategy_fields.values()), strategy_fields
    assert _enums(doc, "default_strategy") == {"InfoOut": names}
    assert info["strategies"] == names
    assert info["ranking_strategies"] == list(ranking_strategy_names())
    assert set(info["ranking_strategies"]) < set(names)


# Run in a fresh interpreter: the wire models take the registry's names when ``app`` is first
# imported, and this process imported it long ago with the shipped registry.
CHILD = """
import asyncio, json, sys
from pathlib import Path

from service.strategies import STRATEGIES, register, strategy_names
from service.strategies.protocol import Reference
from service.strategies.request import Cost, Outcome


class Reversed:
    name = "toy_reversed"
    reference = Reference(rule="the input order reversed", calls="0")
    options = frozenset()
    uses_design = False
    ranks = False

    def cost(self, request, settings):
        return Cost()

    async def run(self, work, request):
        n = len(request.passages)
        return Outcome(order=list(range(n))[::-1], ranking=list(range(n)))


register(Reversed())  # the one step: nothing else names it

from tests.app.conftest import reorder_body, serving, wait_ready  # the app, after it


async def main(tmp):
    async with serving(Path(tmp), ready=False) as h:
        await wait_ready(h.client, timeout=60)  # a fresh process, beside others' work
        doc = (await h.client.get("/openapi.json")).json()
        info = (await h.client.get("/info")).json()
        ok = await h.client.post("/v1/reorder", json=reorder_body(strategy="toy_reversed"))
        bad = await h.client.post("/v1/reorder", json=reorder_body(strategy="toy_unknown"))
    print(json.dumps({
        "names": list(strategy_names()),
        "doc": doc,
        "info": info,
        "ok": [ok.status_code, ok.json()],
        "bad": [bad.status_code, bad.json()],
    }))


asyncio.run(main(sys.argv[1]))
"""


def test_registering_a_strategy_is_all_it_takes_to_be_accepted_and_listed(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    names = seen["names"]
    assert names == [*strategy_names(), "toy_reversed"]
    enums = _enums(seen["doc"], "strategy")
    assert enums and all(enum == names for enum in enums.values()), enums
    assert seen["info"]["strategies"] == names
    assert "toy_reversed" not in seen["info"]["ranking_strategies"]  # it does not rank
    status, body = seen["ok"]
    assert status == 200, body
    assert body["order"] == [3, 2, 1, 0] and body["strategy"] == "toy_reversed"
    status, body = seen["bad"]
    assert status == 422 and body["error"]["param"] == "strategy", body


async def test_a_default_strategy_the_registry_lacks_fails_the_warm_up(tmp_path: Path) -> None:
    # The settings sit below the strategies and take any name; the warm-up, which runs the
    # default as a request naming none would, refuses one that is not registered, by name.
    async with serving(tmp_path, strategy="toy_nowhere", ready=False) as h:
        await wait_until(lambda: h.ctx.lifecycle.fatal is not None, timeout=30)
        fatal = str(h.ctx.lifecycle.fatal)
        assert "the default 'toy_nowhere' request is refused: unknown strategy" in fatal
        assert all(name in fatal for name in strategy_names())
        assert (await h.client.get("/ready")).status_code == 503
