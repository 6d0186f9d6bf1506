"""Every error path of RELIABILITY.md's request pipeline, on the fake backend.

request id -> body limit (413) -> auth (401) -> schema (422) -> limits (422) -> admission (503)
-> deadline (504) / client disconnect -> backend failures (500/502/503)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from app.main import create_app
from tests.app.conftest import (
    BEST_FIRST,
    PASSAGES,
    QUERY,
    TRUTH,
    Harness,
    TrackingBackend,
    reorder_body,
    rerank_body,
    serving,
    settings_for,
    wait_until,
)


def envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Check the envelope on every error: fixed keys, request id matching the header."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"type", "message", "param", "code", "request_id"} <= set(err)
    assert err["code"] == code, err
    assert err["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text and "/work/" not in r.text
    return err  # type: ignore[no-any-return]


def assert_idle(h: Harness) -> None:
    """Nothing leaked: no request, no admitted token, no gauge left up."""
    assert h.ctx.admission.in_flight == 0
    assert h.ctx.admission.tokens_in_flight == 0
    assert h.metric("rag_reorder_requests_in_flight") == 0
    assert h.metric("rag_reorder_inflight_prompt_tokens") == 0


# --- 413 --------------------------------------------------------------------------------


async def test_413_on_declared_length_before_reading(tmp_path: Path) -> None:
    async with serving(tmp_path, max_body_bytes=2048) as h:
        r = await h.client.post("/v1/reorder", content=b"x" * 4096)
        err = envelope(r, 413, "body_too_large")
        assert err["type"] == "request_too_large" and err["param"] == "body"
        assert "4096" in err["message"] and "2048" in err["message"]


async def test_413_counts_streamed_bytes_without_content_length(tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"y" * 1024

    async with serving(tmp_path, max_body_bytes=4096) as h:
        r = await h.client.post(
            "/v1/reorder", content=chunks(), headers={"content-type": "application/json"}
        )
        assert "content-length" not in r.request.headers
        envelope(r, 413, "body_too_large")
        assert h.backend.request_ids == [] or all(
            i.startswith("warmup") for i in h.backend.request_ids
        )


async def test_413_when_content_length_lies(tmp_path: Path) -> None:
    """A declared length is not trusted: the bytes that arrive are counted."""
    async with serving(tmp_path, max_body_bytes=2048) as h:
        sent: list[dict[str, Any]] = []
        chunks = [b"z" * 1024] * 4
        messages = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = asgi_scope("/v1/reorder", [(b"content-length", b"10")])
        await h.app(scope, receive, send)
        assert sent[0]["status"] == 413


# --- 401 --------------------------------------------------------------------------------


async def test_401_on_every_non_probe_route_and_probes_stay_open(tmp_path: Path) -> None:
    async with serving(tmp_path, api_key="s3cret-key", ready=False) as h:
        await wait_until(lambda: h.ctx.lifecycle.ready)
        for method, path in [
            ("POST", "/v1/reorder"),
            ("POST", "/v1/rerank"),
            ("POST", "/rerank"),
            ("POST", "/v2/rerank"),
            ("GET", "/v1/models"),
            ("GET", "/info"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/no-such-route"),
        ]:
            r = await h.client.request(method, path, json={})
            err = envelope(r, 401, "missing_api_key")
            assert err["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
            r = await h.client.request(
                method, path, json={}, headers={"Authorization": "Bearer wrong"}
            )
            envelope(r, 401, "invalid_api_key")
        for path in ("/health", "/ready"):
            assert (await h.client.get(path)).status_code == 200
        ok = {"Authorization": "Bearer s3cret-key"}
        r = await h.client.post("/v1/reorder", json=reorder_body(), headers=ok)
        assert r.status_code == 200
        r = await h.client.get("/metrics", headers={"Authorization": "bearer s3cret-key"})
        assert r.status_code == 200


CALIBRATE = {"queries": [{"query": QUERY, "passages": PASSAGES}] * 2, "design": "pruned_random"}


async def test_admin_key_alone_guards_calibration_and_opens_every_route(tmp_path: Path) -> None:
    user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
    async with serving(tmp_path, api_key="user-key", admin_api_key="admin-key") as h:
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE, headers=user)
        err = envelope(r, 401, "invalid_api_key")
        assert err["message"] == "this route needs the admin API key"
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE)
        assert "admin API key" in envelope(r, 401, "missing_api_key")["message"]
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE, headers=admin)
        assert r.status_code == 200, r.text
        for headers in (user, admin):  # either key opens the other routes
            assert (await h.client.get("/v1/bias-profiles", headers=headers)).status_code == 200
            r = await h.client.post("/v1/reorder", json=reorder_body(), headers=headers)
            assert r.status_code == 200
        r = await h.client.get("/info", headers={"Authorization": "Bearer nope"})
        envelope(r, 401, "invalid_api_key")
        info = (await h.client.get("/info", headers=user)).json()
        assert info["auth"] and info["admin_auth"]


async def test_calibration_is_closed_without_an_admin_key_unless_opened(tmp_path: Path) -> None:
    # The image and the chart bind 0.0.0.0: whoever reaches the pod must not be able to
    # replace the profile every later request is placed by.
    for extra in ({}, {"api_key": "user-key"}):
        async with serving(tmp_path, open_writes=False, **extra) as h:
            user = {"Authorization": "Bearer user-key"} if extra else {}
            calls = h.backend.started
            r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE, headers=user)
            err = envelope(r, 403, "writes_closed")
            assert err["type"] == "permission_error"
            assert "RAG_REORDER_ADMIN_API_KEY" in err["message"]
            assert "RAG_REORDER_OPEN_WRITES" in err["message"]
            assert h.backend.started == calls  # refused before any scoring
            r = await h.client.post("/v1/reorder", json=reorder_body(), headers=user)
            assert r.status_code == 200
            info = (await h.client.get("/info", headers=user)).json()
            assert not info["open_writes"] and not info["admin_auth"]
    async with serving(tmp_path, open_writes=True) as h:
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE)
        assert r.status_code == 200, r.text
        assert (await h.client.get("/info")).json()["open_writes"]


async def test_admin_key_without_a_user_key_guards_only_calibration(tmp_path: Path) -> None:
    async with serving(tmp_path, admin_api_key="admin-key") as h:
        assert (await h.client.post("/v1/reorder", json=reorder_body())).status_code == 200
        assert (await h.client.get("/v1/bias-profiles")).status_code == 200
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE)
        envelope(r, 401, "missing_api_key")
        ok = {"Authorization": "Bearer admin-key"}
        r = await h.client.post("/v1/bias-profiles/calibrate", json=CALIBRATE, headers=ok)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", ["api_key", "admin_api_key"])
def test_a_blank_key_refuses_to_start(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=f"RAG_REORDER_{name.upper()} is set but empty"):
        create_app(settings_for(tmp_path, **{name: "  "}))


async def test_body_limit_comes_before_auth(tmp_path: Path) -> None:
    async with serving(tmp_path, api_key="k" * 16, max_body_bytes=1024) as h:
        r = await h.client.post("/v1/reorder", content=b"x" * 2048)
        envelope(r, 413, "body_too_large")


# --- 422: schema --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": QUERY}, "passages"),
        ({"query": QUERY, "passages": []}, "passages"),
        ({"query": "", "passages": PASSAGES}, "query"),
        ({"query": QUERY, "passages": [{"title": "no text"}]}, "passages[0].text"),
        ({"query": QUERY, "passages": PASSAGES, "unknown_option": 1}, "unknown_option"),
        ({"query": QUERY, "passages": PASSAGES, "strategy": "permsc"}, "strategy"),
        ({"query": QUERY, "passages": PASSAGES, "design": {"kind": "magic"}}, "design.kind"),
        (
            {"query": QUERY, "passages": PASSAGES, "design": {"num_prompts": 0}},
            "design.num_prompts",
        ),
        ({"query": QUERY, "passages": PASSAGES, "design": {"seed": 2**70}}, "design.seed"),
        ({"query": QUERY, "passages": PASSAGES, "top_n": -1}, "top_n"),
        ({"query": QUERY, "passages": [{"text": "a", "score": "high"}]}, "passages[0].score"),
        ({"query": QUERY, "passages": [12]}, "passages[0]"),
    ],
)
async def test_422_schema_names_the_parameter(
    served: Harness, body: dict[str, Any], param: str
) -> None:
    err = envelope(await served.client.post("/v1/reorder", json=body), 422, "validation_error")
    assert err["param"] == param and err["type"] == "invalid_request_error"


async def test_422_echo_of_the_bad_value_is_bounded(served: Harness) -> None:
    body = reorder_body(placement="z" * 10_000)
    err = envelope(await served.client.post("/v1/reorder", json=body), 422, "validation_error")
    assert err["param"] == "placement"
    assert "zzz" in err["message"] and len(err["message"]) < 400


async def test_non_finite_numbers_are_refused(served: Harness) -> None:
    for raw in (b"1e999", b"NaN", b"-Infinity"):
        content = b'{"query": "q", "passages": [{"text": "a", "score": ' + raw + b"}]}"
        r = await served.client.post(
            "/v1/reorder", content=content, headers={"content-type": "application/json"}
        )
        assert envelope(r, 422, "validation_error")["param"] == "passages[0].score"


async def test_malformed_bodies_are_400(served: Harness) -> None:
    headers = {"content-type": "application/json"}
    r = await served.client.post("/v1/reorder", content=b'{"query": ', headers=headers)
    envelope(r, 400, "malformed_request")
    r = await served.client.post("/v1/reorder", content=b'{"query": "\xff\xfe"}', headers=headers)
    envelope(r, 400, "malformed_request")


async def test_rerank_ignores_unknown_fields_but_not_inside_reorder(served: Harness) -> None:
    ok = await served.client.post("/v1/rerank", json=rerank_body(whatever={"x": 1}))
    assert ok.status_code == 200
    r = await served.client.post(
        "/v1/rerank", json=rerank_body(reorder={"strategy": "moi", "x": 1})
    )
    assert envelope(r, 422, "validation_error")["param"] == "reorder.x"
    r = await served.client.post("/v1/rerank", json={"query": QUERY, "documents": []})
    assert envelope(r, 422, "validation_error")["param"] == "documents"


# --- 422: limits ----------------------------------------------------------------------------


def limit_error(r: httpx.Response, param: str, limit: int, value: int) -> None:
    err = envelope(r, 422, "limit_exceeded")
    assert (err["param"], err["limit"], err["value"]) == (param, limit, value), err
    assert str(limit) in err["message"] and str(value) in err["message"]


async def test_422_limits_name_param_limit_and_value(tmp_path: Path) -> None:
    async with serving(
        tmp_path,
        max_passages=3,
        max_query_chars=50,
        max_passage_chars=60,
        max_prompts_per_request=20,
    ) as h:
        post = h.client.post
        limit_error(await post("/v1/reorder", json=reorder_body()), "passages", 3, 4)
        limit_error(await post("/v1/rerank", json=rerank_body()), "documents", 3, 4)
        body = {"query": "q" * 51, "passages": PASSAGES[:2]}
        limit_error(await post("/v1/reorder", json=body), "query", 50, 51)
        body = {"query": QUERY, "passages": ["ok", {"text": "p" * 50, "title": "t" * 11}]}
        limit_error(await post("/v1/reorder", json=body), "passages[1]", 60, 61)
        body = {"query": QUERY, "passages": PASSAGES[:3], "design": {"num_prompts": 21}}
        limit_error(await post("/v1/reorder", json=body), "design.num_prompts", 20, 21)
        assert h.backend.started == 1  # only the warm-up: nothing was scored


async def test_422_prompts_x_tokens_before_any_scoring(tmp_path: Path) -> None:
    async with serving(tmp_path, max_prompt_tokens_x_prompts=500) as h:
        started = h.backend.started
        r = await h.client.post("/v1/reorder", json=reorder_body())
        err = envelope(r, 422, "limit_exceeded")
        assert err["param"] == "prompt_tokens_x_prompts" and err["limit"] == 500
        assert err["value"] > 500
        assert h.backend.started == started
        assert_idle(h)


async def test_422_prompt_longer_than_the_model_context(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, max_model_len=400)
    async with serving(tmp_path, backend=backend) as h:
        r = await h.client.post(
            "/v1/reorder", json={"query": QUERY, "passages": ["w " * 300, "short"]}
        )
        err = envelope(r, 422, "limit_exceeded")
        assert err["param"] == "prompt_tokens" and err["limit"] == 400


async def test_422_max_tokens_per_doc_is_never_truncated(served: Harness) -> None:
    r = await served.client.post("/v1/rerank", json=rerank_body(max_tokens_per_doc=40))
    err = envelope(r, 422, "limit_exceeded")
    assert err["param"] == "documents[2]" and err["limit"] == 40  # the first over 40 bytes
    assert err["value"] == len(PASSAGES[2].encode())
    ok = await served.client.post("/v1/rerank", json=rerank_body(max_tokens_per_doc=200))
    assert ok.status_code == 200


async def test_422_unidentifiable_design(served: Harness) -> None:
    r = await served.client.post("/v1/reorder", json=reorder_body(design={"kind": "cyclic"}))
    err = envelope(r, 422, "unidentifiable_design")
    assert err["param"] == "design.kind" and "calibrate" in err["message"]
    r = await served.client.post(
        "/v1/reorder", json=reorder_body(design={"kind": "random", "prompt_passages": 2})
    )
    envelope(r, 422, "invalid_request")


async def test_422_whitespace_passage_and_unknown_template(served: Harness) -> None:
    r = await served.client.post("/v1/reorder", json={"query": QUERY, "passages": ["a", "  "]})
    assert envelope(r, 422, "invalid_request")["param"] == "passages[1].text"
    r = await served.client.post("/v1/reorder", json=reorder_body(template="nope"))
    assert envelope(r, 422, "invalid_request")["param"] == "template"


async def post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    await client.post(path, json=body)


# --- 503: admission, readiness ---------------------------------------------------------------


async def test_503_when_concurrent_requests_are_full(tmp_path: Path) -> None:
    async with serving(tmp_path, max_concurrent_requests=1, retry_after_s=7) as h:
        h.backend.hang = True
        started = h.backend.started
        async with anyio.create_task_group() as tg:
            tg.start_soon(post_json, h.client, "/v1/reorder", reorder_body())
            await wait_until(lambda: h.backend.started > started)
            r = await h.client.post("/v1/rerank", json=rerank_body())
            err = envelope(r, 503, "overloaded")
            assert err["type"] == "overloaded_error" and r.headers["retry-after"] == "7"
            tg.cancel_scope.cancel()
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "concurrency"}) == 1
        assert_idle(h)


async def test_503_when_the_token_budget_is_full(tmp_path: Path) -> None:
    async with serving(tmp_path, max_inflight_prompt_tokens=100) as h:
        h.backend.hang = True
        started = h.backend.started
        async with anyio.create_task_group() as tg:
            # The first request is over the budget on its own, and admitted: nothing else runs.
            tg.start_soon(post_json, h.client, "/v1/reorder", reorder_body())
            await wait_until(lambda: h.backend.started > started)
            assert h.ctx.admission.tokens_in_flight > 100
            r = await h.client.post("/v1/reorder", json=reorder_body())
            envelope(r, 503, "overloaded")
            assert "retry-after" in r.headers
            tg.cancel_scope.cancel()
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "token_budget"}) == 1
        assert_idle(h)


async def test_503_while_warming_up_and_while_draining(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, hang=True)  # the warm-up never finishes
    async with serving(tmp_path, backend=backend, ready=False) as h:
        await wait_until(lambda: backend.started == 1)
        r = await h.client.get("/ready")
        assert "warming up" in envelope(r, 503, "not_ready")["message"]
        assert "retry-after" in r.headers
        assert (await h.client.get("/health")).status_code == 200  # alive, just not ready
        envelope(await h.client.post("/v1/reorder", json=reorder_body()), 503, "not_ready")
    async with serving(tmp_path) as h:
        h.ctx.lifecycle.mark(draining=True)
        envelope(await h.client.get("/ready"), 503, "draining")
        r = await h.client.post("/v1/rerank", json=rerank_body())
        envelope(r, 503, "draining")
        assert h.metric("rag_reorder_ready") == 0


# --- 504 and disconnects: the work is cancelled -----------------------------------------------


async def test_504_deadline_cancels_the_backend_call(tmp_path: Path) -> None:
    async with serving(tmp_path, request_timeout_s=0.2) as h:
        h.backend.hang = True
        r = await h.client.post("/v1/reorder", json=reorder_body())
        err = envelope(r, 504, "deadline_exceeded")
        assert err["type"] == "timeout_error" and "0.2" in err["message"]
        assert h.backend.cancelled == 1
        assert_idle(h)
        h.backend.hang = False  # the service keeps serving
        assert (await h.client.post("/v1/reorder", json=reorder_body())).status_code == 200


def asgi_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }


DISCONNECT_BODIES: dict[str, dict[str, Any]] = {
    "/v1/reorder": {"query": QUERY, "passages": PASSAGES},
    "/v1/rerank": {"query": QUERY, "documents": PASSAGES},
    "/v1/bias-profiles/calibrate": CALIBRATE,
}


@pytest.mark.parametrize("path", DISCONNECT_BODIES)
async def test_client_disconnect_cancels_the_work(tmp_path: Path, path: str) -> None:
    async with serving(tmp_path) as h:
        h.backend.hang = True
        started = h.backend.started
        body = json.dumps(DISCONNECT_BODIES[path]).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        gone = anyio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = asgi_scope(path, [(b"content-length", str(len(body)).encode())])
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.app, scope, receive, send)
                await wait_until(lambda: h.backend.started > started)
                assert h.ctx.admission.in_flight == 1
                gone.set()
        assert h.backend.cancelled == 1
        assert_idle(h)
        assert sent[0]["status"] == 499  # answered into the void, but counted
        labels = {"type": "client_closed_request", "code": "client_disconnected"}
        assert h.metric("rag_reorder_request_failures_total", labels) == 1
        assert h.ctx.engine.profiles.list() == []  # a cancelled calibration stores nothing


# --- backend failures ---------------------------------------------------------------------------


async def test_500_catch_all_has_the_request_id_and_no_traceback(served: Harness) -> None:
    served.backend.error = RuntimeError("secret detail at /srv/models/x.bin")
    r = await served.client.post("/v1/reorder", json=reorder_body())
    err = envelope(r, 500, "internal_error")
    assert err["type"] == "server_error" and err["request_id"] in err["message"]
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert_idle(served)


async def test_one_failed_prompt_degrades_the_fit(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend) as h:
        # One prompt fails outright, another returns a NaN log-prob: both are dropped.
        backend.fail_rule = lambda p: p.request_id == "x-1-2"
        backend.nan_rule = lambda p: p.request_id == "x-1-5"
        r = await h.client.post(
            "/v1/reorder",
            json=reorder_body(design={"num_prompts": 12}),
            headers={"X-Request-Id": "x-1"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["diagnostics"]["prompts_failed"] == 2
        assert any("failed to score" in w for w in body["diagnostics"]["warnings"])
        assert body["order"] == BEST_FIRST


async def test_502_when_too_many_prompts_fail(tmp_path: Path) -> None:
    async with serving(tmp_path) as h:
        h.backend.fail_rule = lambda p: p.request_id.startswith("req-")
        r = await h.client.post("/v1/reorder", json=reorder_body())
        err = envelope(r, 502, "scoring_failed")
        assert err["type"] == "server_error"


async def test_503_and_failed_liveness_when_the_engine_dies(tmp_path: Path) -> None:
    fatal: list[str] = []
    async with serving(tmp_path) as h:
        h.ctx.lifecycle.on_fatal = fatal.append
        await h.backend.aclose()  # the engine is gone: every call raises BackendUnavailable
        r = await h.client.post("/v1/reorder", json=reorder_body())
        envelope(r, 503, "backend_unavailable")
        assert "retry-after" in r.headers
        # The request woke the watchdog; its canary finds the engine dead: fatal at once.
        await wait_until(lambda: bool(fatal))
        err = envelope(await h.client.get("/health"), 503, "unhealthy")
        assert "engine" in err["message"]
        envelope(await h.client.get("/ready"), 503, "unhealthy")
        envelope(await h.client.post("/v1/reorder", json=reorder_body()), 503, "unhealthy")


async def test_404_and_405_use_the_envelope(served: Harness) -> None:
    envelope(await served.client.get("/v1/nothing"), 404, "not_found")
    envelope(await served.client.get("/v1/reorder"), 405, "method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/reorder", "POST"),
        ("PUT", "/v1/rerank", "POST"),
        ("POST", "/health", "GET"),
        # GET /v1/bias-profiles/{profile_id} also takes this path, with "calibrate" as an id
        # that no profile can have (ids end in __L<slots>): only the schema's POST is named
        # (issue 90; test_schema_fuzz checks every path).
        ("DELETE", "/v1/bias-profiles/calibrate", "POST"),
    ],
)
async def test_405_names_the_allowed_methods(
    served: Harness, method: str, path: str, allow: str
) -> None:
    r = await served.client.request(method, path)
    err = envelope(r, 405, "method_not_allowed")
    assert r.headers["allow"] == allow  # RFC 9110 15.5.6: a 405 must carry Allow
    assert allow in err["message"]


@pytest.mark.parametrize(
    ("reorder", "param", "code"),
    [
        ({"design": {"kind": "cyclic"}}, "reorder.design.kind", "unidentifiable_design"),
        ({"design": {"num_prompts": 999}}, "reorder.design.num_prompts", "limit_exceeded"),
        ({"strategy": "self_consistency", "samples": 600}, "reorder.samples", "limit_exceeded"),
        ({"template": "nope"}, "reorder.template", "invalid_request"),
        ({"strategy": "lore", "rankings": [[0, 9]]}, "reorder.rankings[0]", "invalid_request"),
    ],
)
async def test_rerank_errors_name_the_option_as_the_request_spells_it(
    served: Harness, reorder: dict[str, object], param: str, code: str
) -> None:
    r = await served.client.post("/v1/rerank", json=rerank_body(reorder=reorder))
    err = envelope(r, 422, code)
    assert err["param"] == param, err
    if code == "limit_exceeded":
        assert err["message"].startswith(param)
    # The native route names the same options without the prefix.
    native = await served.client.post("/v1/reorder", json=reorder_body(**reorder))
    assert envelope(native, 422, code)["param"] == param.removeprefix("reorder.")


async def test_rerank_blank_document_is_named_as_a_document(served: Harness) -> None:
    r = await served.client.post("/v1/rerank", json={"query": QUERY, "documents": ["a", "  "]})
    assert envelope(r, 422, "invalid_request")["param"] == "documents[1].text"
