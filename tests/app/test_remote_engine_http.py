"""The app with a remote engine that comes and goes (scripted server, in process).

Readiness follows the engine, liveness does not: the process is fine while the engine is down,
requests get ``engine_unavailable`` 503 with Retry-After at once, and the service serves again
on its own when the engine is back. A server that serves another model is fatal at start.
The same faults against a real vLLM server process are in tests/service/test_remote_vllm.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from app.main import create_app
from service.backends.engines.remote_backend import RemoteBackend
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from service.backends.transport.engine_client import EngineClient
from tests.app.conftest import settings_for, wait_until
from tests.service.test_remote_backend import ScriptedServer


class Switch:
    """The scripted server behind a switch: down refuses connections."""

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.up = False
        self.cut = 0
        """Scoring calls still to cut mid-call (a connection closed with no answer)."""
        self.completions = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/completions":
            self.completions += 1
            if self.cut > 0:
                self.cut -= 1
                raise httpx.RemoteProtocolError("Server disconnected", request=request)
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


async def test_one_cut_canary_call_is_asked_again_two_call_the_engine_down(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A keep-alive connection the engine (or a proxy between) was closing cuts one call: not
    # an engine down, which would turn every caller away with 503 until the next check.
    switch = Switch(ScriptedServer(tokenizer))
    switch.up = True
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(switch), retries=0)
    backend = RemoteBackend(client, tokenizer, model_id="tiny")
    app = create_app(settings_for(tmp_path, canary_interval_s=0.05), backend=backend)
    async with app.router.lifespan_context(app):
        ctx = app.state.ctx
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)
        # Every call of Lifecycle.engine, so that a down called and lifted between two polls
        # is still seen.
        downs: list[str | None] = []
        engine = ctx.lifecycle.engine

        def recorded(down: str | None) -> None:
            downs.append(down)
            engine(down)

        monkeypatch.setattr(ctx.lifecycle, "engine", recorded)
        calls = switch.completions
        switch.cut = 1
        await wait_until(lambda: switch.completions >= calls + 3, timeout=10)
        assert ctx.lifecycle.ready and ctx.lifecycle.canary_failures == 0
        assert downs == [] and ctx.metrics.registry.get_sample_value(
            "rag_reorder_canary_failures_total"
        ) in (None, 0.0)
        # Cut again on the second asking: the engine is called down, then back by itself.
        switch.cut = 2
        await wait_until(lambda: bool(downs) and downs[0] is not None, timeout=10)
        assert "RemoteProtocolError" in str(downs[0])
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)


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


class SharedEngine:
    """The scripted server's ``/metrics`` as vLLM's: ``others`` requests of other clients
    (another replica) in its queue beside ``own``'s prompts in flight, each read finding
    them further along (tokens served). ``slow``: seconds each completion call takes."""

    def __init__(self, server: ScriptedServer, own: RemoteBackend | None = None) -> None:
        self.server = server
        self.own = own
        self.others = 0
        self.tokens = 0
        self.slow = 0.0
        server.metrics = self.text

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions" and self.slow:
            await anyio.sleep(self.slow)
        return self.server(request)

    def text(self) -> str:
        running = self.others + (self.own.prompts_in_flight if self.own is not None else 0)
        self.tokens += 10 * running
        return (
            f'vllm:num_requests_running{{model_name="smol"}} {running}\n'
            'vllm:num_requests_waiting{model_name="smol"} 0\n'
            f'vllm:prompt_tokens_total{{model_name="smol"}} {self.tokens}\n'
        )


async def test_background_runs_wait_while_the_shared_engine_serves_other_clients(
    tmp_path: Path, tokenizer: Any
) -> None:
    server = ScriptedServer(tokenizer)
    shared = SharedEngine(server)
    switch = Switch(server)
    switch.up = True
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(switch), retries=0)
    backend = RemoteBackend(client, tokenizer, model_id="tiny")
    # Every auto request is served cold and queues its learning run for the idle engine.
    settings = settings_for(tmp_path, auto_cold_max_s=1e-6, engine_idle_poll_s=0.02)
    app = create_app(settings, backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    passages = [f"Passage {i} says the river is number {i}." for i in range(6)]
    body = {"query": "Which river?", "passages": passages}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        ctx = app.state.ctx
        learner = ctx.engine.learner
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)
        shared.others = 3  # another replica's requests: this one has none in flight
        completions = server.paths.count("/v1/completions")
        r = await http.post("/v1/reorder", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["auto"]["path"] == "cold" and r.json()["auto"]["recorded"]
        await anyio.sleep(0.5)  # 25 reads of the engine's queue
        assert server.paths.count("/metrics") >= 5
        assert not learner.background_free  # still waiting for the engine
        assert server.paths.count("/v1/completions") == completions
        assert ctx.engine.engine_load is not None and ctx.engine.engine_load.others == 3
        assert "rag_reorder_engine_other_requests 3.0" in (await http.get("/metrics")).text
        shared.others = 0  # the other replica's requests are done
        await wait_until(lambda: learner.counters.learning_runs["recorded"] == 1, timeout=10)
        assert server.paths.count("/v1/completions") > completions


async def test_a_background_run_is_cancelled_when_another_client_uses_the_shared_engine(
    tmp_path: Path, tokenizer: Any
) -> None:
    server = ScriptedServer(tokenizer)
    shared = SharedEngine(server)
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(shared), retries=0)
    backend = RemoteBackend(client, tokenizer, model_id="tiny")
    shared.own = backend
    settings = settings_for(tmp_path, auto_cold_max_s=1e-6, engine_idle_poll_s=0.02)
    app = create_app(settings, backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    passages = [f"Passage {i} says the river is number {i}." for i in range(6)]
    body = {"query": "Which river?", "passages": passages}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        ctx = app.state.ctx
        runs = ctx.engine.learner.counters.learning_runs
        await wait_until(lambda: ctx.lifecycle.ready, timeout=15)
        shared.slow = 5.0
        r = await http.post("/v1/reorder", json=body)
        assert r.json()["auto"]["path"] == "cold" and r.json()["auto"]["recorded"]
        await wait_until(lambda: backend.prompts_in_flight > 0)
        # The engine counts the run's own prompts: they do not preempt it.
        await anyio.sleep(0.3)
        assert runs["preempted"] == 0 and backend.prompts_in_flight > 0
        shared.others = 2  # another replica's requests arrive
        await wait_until(lambda: runs["preempted"] == 1, timeout=5)
        assert backend.prompts_in_flight == 0 and runs["recorded"] == 0
