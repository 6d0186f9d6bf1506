"""The app with a remote engine that comes and goes (scripted server, in process).

Readiness follows the engine, liveness does not: the process is fine while the engine is down,
requests get ``engine_unavailable`` 503 with Retry-After at once, and the service serves again
on its own when the engine is back. A server that serves another model is fatal at start.
The same faults against a real vLLM server process are in tests/service/test_remote_vllm.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from service.backends.engine_client import EngineClient
from service.backends.remote_backend import RemoteBackend
from service.backends.tokenizer_files import load_prompt_tokenizer
from tests.app.conftest import settings_for, wait_until
from tests.service.test_remote_backend import ScriptedServer


class Switch:
    """The scripted server behind a switch: down refuses connections."""

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.up = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        return self.server(request)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_prompt_tokenizer(tiny_model_dir, name="tiny")


async def test_readiness_follows_the_engine_and_the_service_recovers_on_its_own(
    tmp_path: Path, tokenizer: Any
) -> None:
    switch = Switch(ScriptedServer(tokenizer))
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(switch), retries=0)
    backend = RemoteBackend(client, tokenizer, model_id="tiny")
    app = create_app(settings_for(tmp_path, canary_interval_s=0.2), backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    body = {"query": "Which river?", "passages": ["The Danube flows east.", "Rome is old."]}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        ctx = app.state.ctx
        await wait_until(lambda: ctx.lifecycle.engine_down is not None)
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.headers["Retry-After"]
        assert ready.json()["error"]["code"] == "engine_unavailable"
        r = await http.post("/v1/reorder", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert (await http.get("/info")).json()["engine"].startswith("unavailable: ")
        # The engine comes up: connect, warm-up, ready, served.
        switch.up = True
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)
        assert (await http.post("/v1/reorder", json=body)).status_code == 200
        assert (await http.get("/info")).json()["engine"] == "ok"
        # It goes away: the next request fails at once, readiness follows, liveness holds.
        switch.up = False
        r = await http.post("/v1/reorder", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        await wait_until(lambda: not ctx.lifecycle.ready, timeout=10)
        assert (await http.get("/health")).status_code == 200
        # And back again.
        switch.up = True
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)
        assert (await http.post("/v1/reorder", json=body)).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'rag_reorder_engine_calls_total{outcome="ok",path="/v1/completions"}' in metrics
        assert "rag_reorder_engine_calls_in_flight" in metrics


async def test_a_server_with_another_model_is_fatal_at_start(
    tmp_path: Path, tokenizer: Any
) -> None:
    server = ScriptedServer(tokenizer, served="someone-elses-model")
    switch = Switch(server)
    switch.up = True
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(switch))
    backend = RemoteBackend(client, tokenizer, model_id="tiny", served_model="smol")
    app = create_app(settings_for(tmp_path), backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        ctx = app.state.ctx
        await wait_until(lambda: ctx.lifecycle.fatal is not None)
        assert "someone-elses-model" in ctx.lifecycle.fatal and "smol" in ctx.lifecycle.fatal
        assert (await http.get("/health")).status_code == 503
