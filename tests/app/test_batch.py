"""``POST /v1/reorder/batch`` (issue 94, item 5): each item answered in its place, one bad
item failing only itself, the batch's own limits, and results equal to the single route's.
In process, on the fake backend."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import anyio

from tests.app.conftest import (
    BEST_FIRST,
    PASSAGES,
    QUERY,
    TRUTH,
    TrackingBackend,
    reorder_body,
    serving,
    wait_until,
)
from tests.app.test_errors import asgi_scope, assert_idle

BATCH = "/v1/reorder/batch"


def _same_fit(single: dict[str, Any], item: dict[str, Any]) -> None:
    """What the fit decided is the same; only the ids and the clock differ."""
    for key in ("strategy", "order", "ranking", "passages", "position_bias", "usage"):
        assert item[key] == single[key], key
    keep = ("strategy", "method", "score", "prompts", "prompts_failed", "warnings", "placement")
    for key in keep:
        assert item["diagnostics"][key] == single["diagnostics"][key], key


async def test_one_bad_item_fails_only_itself(tmp_path: Path) -> None:
    """An invalid option (422 from the schema), a passage over `max_passage_chars` (422 from
    the limits), an unknown bias profile (422 from the strategy) and an item whose every
    prompt fails (502): each carries its own error, the good items answer 200 in place."""
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend, max_passage_chars=60) as h:
        # Item 5's prompts all fail to score: its id is the batch's + ".5".
        backend.fail_rule = lambda p: p.request_id.startswith("b-1.5-")
        items = [
            reorder_body(strategy="moi"),
            reorder_body(design={"num_prompts": 0}),  # invalid option
            reorder_body(passages=[*PASSAGES, "x" * 61]),  # over max_passage_chars
            reorder_body(strategy="moi", query="another question?"),
            reorder_body(strategy="moi", bias_profile="no-such-profile"),
            reorder_body(strategy="moi"),  # its prompts fail
            {"query": QUERY},  # no passages
            reorder_body(strategy="moi", nonsense=1),  # an unknown field
        ]
        r = await h.client.post(BATCH, json={"items": items}, headers={"X-Request-Id": "b-1"})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert [x["index"] for x in results] == list(range(len(items)))
        assert [x["request_id"] for x in results] == [f"b-1.{i}" for i in range(len(items))]
        statuses = [x["status"] for x in results]
        assert statuses == [200, 422, 422, 200, 422, 502, 422, 422], results
        assert body["succeeded"] == 2 and body["failed"] == 6
        for i in (0, 3):
            assert results[i]["error"] is None
            assert results[i]["response"]["order"] == BEST_FIRST
            assert results[i]["response"]["id"] == f"b-1.{i}"
        for i in (1, 2, 4, 5, 6, 7):
            err = results[i]["error"]
            assert results[i]["response"] is None
            assert err["request_id"] == f"b-1.{i}"
        assert results[1]["error"]["param"] == "design.num_prompts"
        assert results[1]["error"]["code"] == "validation_error"
        assert results[2]["error"]["code"] == "limit_exceeded"
        assert results[2]["error"]["param"] == "passages[4]"
        assert results[2]["error"]["limit"] == 60 and results[2]["error"]["value"] == 61
        assert "no-such-profile" in results[4]["error"]["message"]
        assert results[5]["error"]["code"] == "scoring_failed"
        assert results[6]["error"]["param"] == "passages"
        assert results[7]["error"]["param"] == "nonsense"
        # Each failure counted once, as a single request's would be.
        # Each error is the one the single route answers for the same body.
        for i in (1, 2, 4, 6, 7):
            single = await h.client.post("/v1/reorder", json=items[i])
            assert single.status_code == results[i]["status"]
            # (The item's envelope spells an absent `limit` and `value` as null.)
            alone = single.json()["error"]
            item = results[i]["error"]
            assert {k: v for k, v in alone.items() if k != "request_id"} == {
                k: v for k, v in item.items() if k != "request_id" and (k in alone or v)
            }
        failures = "rag_reorder_request_failures_total"
        assert h.metric(failures, {"type": "server_error", "code": "scoring_failed"}) == 1.0


async def test_the_batch_limits_are_422s_naming_the_parameter(tmp_path: Path) -> None:
    async with serving(tmp_path, batch_max_items=3, batch_max_total_chars=500) as h:
        started = h.backend.started  # the warm-up's
        r = await h.client.post(BATCH, json={"items": [reorder_body()] * 4})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "limit_exceeded" and err["param"] == "items"
        assert err["limit"] == 3 and err["value"] == 4
        assert "RAG_REORDER_BATCH_MAX_ITEMS" in err["message"]

        one = len(QUERY) + sum(len(p) for p in PASSAGES)
        assert 2 * one <= 500 < 3 * one
        r = await h.client.post(BATCH, json={"items": [reorder_body()] * 3})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "limit_exceeded" and err["param"] == "items"
        assert err["limit"] == 500 and err["value"] == 3 * one
        assert "RAG_REORDER_BATCH_MAX_TOTAL_CHARS" in err["message"]
        assert h.backend.started == started  # refused before any item ran

        # Invalid items are not counted: they never run.
        r = await h.client.post(
            BATCH, json={"items": [reorder_body(strategy="moi")] * 2 + [{"query": "x" * 600}]}
        )
        assert r.status_code == 200, r.text
        assert [x["status"] for x in r.json()["results"]] == [200, 200, 422]

        bad_bodies: list[dict[str, Any]] = [
            {"items": []},
            {},
            {"items": {"query": QUERY}},
            {"items": [reorder_body()], "x": 1},
        ]
        for bad in bad_bodies:
            r = await h.client.post(BATCH, json=bad)
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["error"]["param"] in ("items", "x"), r.text


async def test_results_equal_the_single_routes(tmp_path: Path) -> None:
    """Deterministic strategies: each item's fit is the single route's for the same body."""
    bodies = [
        reorder_body(strategy="moi"),
        reorder_body(strategy="moi", query="a second question", design={"seed": 7}),
        reorder_body(strategy="moi", design={"kind": "pruned_random", "num_prompts": 10}),
        reorder_body(strategy="moi", top_n=2),
        reorder_body(strategy="query_likelihood", samples=3),
        reorder_body(strategy="lore"),
    ]
    async with serving(tmp_path) as h:
        singles = []
        for b in bodies:
            r = await h.client.post("/v1/reorder", json=b)
            assert r.status_code == 200, r.text
            singles.append(r.json())
        r = await h.client.post(BATCH, json={"items": bodies})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert all(x["status"] == 200 for x in results), results
        for single, item in zip(singles, results, strict=True):
            _same_fit(single, item["response"])


async def test_items_run_concurrently_within_the_bound(tmp_path: Path) -> None:
    """At most `batch_concurrency` items in flight: each holds one request slot."""
    backend = TrackingBackend(TRUTH, delay_s=0.05)
    async with serving(tmp_path, backend=backend, batch_concurrency=2) as h:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, h.ctx.admission.in_flight)
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            items = [reorder_body(strategy="moi", query=f"q{i}") for i in range(6)]
            r = await h.client.post(BATCH, json={"items": items})
            tg.cancel_scope.cancel()
        assert r.status_code == 200, r.text
        assert all(x["status"] == 200 for x in r.json()["results"])
        assert peak == 2


async def test_server_made_ids_per_item(tmp_path: Path) -> None:
    async with serving(tmp_path) as h:
        r = await h.client.post(BATCH, json={"items": [reorder_body(strategy="moi")] * 2})
        assert r.status_code == 200, r.text
        batch_id = r.headers["X-Request-Id"]
        ids = [x["request_id"] for x in r.json()["results"]]
        assert ids == [f"{batch_id}.0", f"{batch_id}.1"]


async def test_a_client_that_leaves_cancels_every_item(tmp_path: Path) -> None:
    """The batch watches its connection once for all its items: a disconnect cancels the
    items in flight (their scoring included) and never starts the rest."""
    async with serving(tmp_path, batch_concurrency=2) as h:
        h.backend.hang = True
        started = h.backend.started
        items = [reorder_body(strategy="moi", query=f"q{i}") for i in range(3)]
        body = json.dumps({"items": items}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        gone = anyio.Event()
        sent: list[MutableMapping[str, Any]] = []

        async def receive() -> MutableMapping[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = asgi_scope(BATCH, [(b"content-length", str(len(body)).encode())])
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.app, scope, receive, send)
                await wait_until(lambda: h.backend.started >= started + 2)
                assert h.ctx.admission.in_flight == 2
                gone.set()
        assert h.backend.started == started + 2 and h.backend.cancelled == 2
        assert_idle(h)
        assert sent[0]["status"] == 499
