"""EngineClient's policy on a scripted transport: what is retried, what is not, the budgets.

The transport answers from a script (one entry per attempt), so each test knows exactly which
attempts were made; the real server is in test_remote_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest

from service.backends.transport.engine_client import (
    EngineCall,
    EngineClient,
    EngineHTTPError,
    redacted_url,
)
from service.errors import EngineTimeout, EngineUnavailable

Step = Callable[[httpx.Request], httpx.Response]


def answer(status: int = 200, body: object = None, headers: dict[str, str] | None = None) -> Step:
    return lambda request: httpx.Response(status, json=body or {"ok": True}, headers=headers)


def fail(exc: type[Exception]) -> Step:
    def raise_(request: httpx.Request) -> httpx.Response:
        raise exc("scripted", request=request)  # type: ignore[call-arg]

    return raise_


def client(script: list[Step], seen: list[httpx.Request], **kwargs: object) -> EngineClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return script[len(seen) - 1](request)

    return EngineClient(
        "http://engine:8000",
        transport=httpx.MockTransport(handler),
        **kwargs,  # type: ignore[arg-type]
    )


async def test_refused_calls_are_retried_honouring_retry_after() -> None:
    seen: list[httpx.Request] = []
    calls: list[EngineCall] = []
    c = client(
        [
            answer(503, headers={"Retry-After": "0.2"}),
            answer(429),
            fail(httpx.ConnectError),
            answer(),
        ],
        seen,
        api_key="k",
        retries=3,
    )
    c.add_observer(calls.append)
    t = time.perf_counter()
    got = await c.post("/v1/completions", {"x": 1}, tokens=10, request_id="req-1")
    assert got == {"ok": True}
    assert time.perf_counter() - t >= 0.2  # the server's Retry-After was waited
    assert len(seen) == 4
    assert all(r.headers["X-Request-Id"] == "req-1" for r in seen)
    assert all(r.headers["Authorization"] == "Bearer k" for r in seen)
    assert json.loads(seen[0].content) == {"x": 1}
    assert [(k.outcome, k.retries, k.prompt_tokens) for k in calls] == [("ok", 3, 10)]
    assert c.in_flight == 0


async def test_after_the_retries_the_engine_is_unavailable() -> None:
    seen: list[httpx.Request] = []
    c = client([answer(503), answer(503), answer(503)], seen, retries=2)
    with pytest.raises(EngineUnavailable, match=r"HTTP 503.*after 2 retries"):
        await c.get("/v1/models")
    assert len(seen) == 3


@pytest.mark.parametrize("exc", [httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ConnectError])
async def test_a_call_that_was_never_connected_is_retried(exc: type[Exception]) -> None:
    seen: list[httpx.Request] = []
    c = client([fail(exc), answer()], seen, retries=1)
    assert await c.post("/v1/completions", {}) == {"ok": True}
    assert len(seen) == 2


UNSAFE: list[Step] = [
    answer(502),
    answer(504),
    fail(httpx.ReadError),
    fail(httpx.WriteError),
    fail(httpx.RemoteProtocolError),
]


@pytest.mark.parametrize("step", UNSAFE, ids=["502", "504", "read", "write", "protocol"])
async def test_a_call_that_may_have_reached_the_engine_is_not_retried(step: Step) -> None:
    # The engine may have run it (a gateway lost its answer, the connection broke mid-call):
    # a retry could run the work twice.
    seen: list[httpx.Request] = []
    c = client([step, answer()], seen, retries=3)
    with pytest.raises(EngineUnavailable, match="not retried") as raised:
        await c.post("/v1/completions", {})
    assert len(seen) == 1
    assert "engine:8000" not in raised.value.message


@pytest.mark.parametrize("step", UNSAFE, ids=["502", "504", "read", "write", "protocol"])
async def test_an_operator_may_opt_in_to_retrying_calls_that_may_have_run(step: Step) -> None:
    seen: list[httpx.Request] = []
    calls: list[EngineCall] = []
    c = client([step, answer()], seen, retries=3, retry_unsafe=True)
    c.add_observer(calls.append)
    assert await c.post("/v1/completions", {}) == {"ok": True}
    assert len(seen) == 2 and calls[0].retries == 1


@pytest.mark.parametrize(
    ("body", "kind"),
    [(b"<html>Sign in</html>", "text/html"), (b"[1, 2]", "application/json"), (b"\xff", "")],
)
async def test_an_answer_that_is_not_a_json_object_is_the_engine_s_fault(
    body: bytes, kind: str
) -> None:
    # A proxy's login page answered 200 is not data: not read, not counted as "ok".
    seen: list[httpx.Request] = []
    calls: list[EngineCall] = []
    headers = {"content-type": kind} if kind else {}
    c = client(
        [lambda request: httpx.Response(200, content=body, headers=headers), answer()],
        seen,
        retries=3,
    )
    c.add_observer(calls.append)
    with pytest.raises(EngineUnavailable, match="200 with a body that is not a JSON object") as e:
        await c.post("/v1/completions", {})
    assert f"(content-type {kind or 'none'})" in e.value.message
    assert len(seen) == 1
    assert [k.outcome for k in calls] == ["bad_answer"]


async def test_a_read_timeout_is_not_retried() -> None:
    # The server accepted the work and is still at it: a retry would double its load.
    seen: list[httpx.Request] = []
    c = client([fail(httpx.ReadTimeout), answer()], seen, retries=3, timeout_s=1.5)
    with pytest.raises(EngineTimeout, match=r"within 1\.5 s"):
        await c.post("/v1/completions", {})
    assert len(seen) == 1


async def test_an_answer_that_retrying_cannot_change_is_raised_at_once() -> None:
    seen: list[httpx.Request] = []
    c = client([answer(400, {"error": {"message": "prompt too long"}}), answer()], seen, retries=3)
    with pytest.raises(EngineHTTPError) as raised:
        await c.post("/v1/completions", {})
    assert raised.value.status == 400 and raised.value.detail == "prompt too long"
    assert len(seen) == 1


async def test_prompt_tokens_in_flight_stay_under_the_budget() -> None:
    in_flight = 0
    peak = 0
    order: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        tokens = json.loads(request.content)["tokens"]
        in_flight += tokens
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= tokens
        order.append(tokens)
        return httpx.Response(200, json={})

    c = EngineClient(
        "http://engine:8000",
        transport=httpx.MockTransport(handler),
        max_inflight_tokens=100,
        max_concurrency=8,
    )
    sizes = [60, 30, 30, 50, 150]  # 150 is over the whole budget: it runs alone
    await asyncio.gather(*(c.post("/x", {"tokens": n}, tokens=n) for n in sizes))
    assert sorted(order) == sorted(sizes)
    assert peak == 150  # the oversized call, alone; every other moment stayed <= 100
    assert c.in_flight == 0


async def test_calls_in_flight_stay_under_the_concurrency_limit() -> None:
    active = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return httpx.Response(200, json={})

    c = EngineClient(
        "http://engine:8000", transport=httpx.MockTransport(handler), max_concurrency=3
    )
    await asyncio.gather(*(c.get("/v1/models") for _ in range(12)))
    assert peak == 3


class _HeldEngine:
    """An engine that records each call's ``tokens`` as it arrives and holds the call of 60
    until ``release`` is set: the budget's queue forms behind it."""

    def __init__(self, max_concurrency: int = 16) -> None:
        self.release = asyncio.Event()
        self.arrived: list[int] = []
        self.client = EngineClient(
            "http://engine:8000",
            transport=httpx.MockTransport(self._handle),
            max_inflight_tokens=100,
            max_concurrency=max_concurrency,
        )

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        tokens = json.loads(request.content)["tokens"]
        self.arrived.append(tokens)
        if tokens == 60:
            await self.release.wait()
        return httpx.Response(200, json={})

    def post(self, n: int) -> asyncio.Task[object]:
        return asyncio.create_task(self.client.post("/x", {"tokens": n}, tokens=n))

    async def hold_60(self) -> asyncio.Task[object]:
        first = self.post(60)
        while not self.arrived:
            await asyncio.sleep(0.005)
        return first


async def test_the_token_budget_serves_calls_in_arrival_order() -> None:
    # A large call queued before small ones gets in first, though the small ones would fit
    # beside what is in flight: otherwise a stream of small calls starves it.
    engine = _HeldEngine(max_concurrency=8)
    first = await engine.hold_60()
    large = engine.post(100)
    await asyncio.sleep(0.02)
    small = [engine.post(10) for _ in range(4)]
    await asyncio.sleep(0.05)
    assert engine.arrived == [60]  # the small calls wait behind the large one
    engine.release.set()
    await asyncio.gather(first, large, *small)
    assert engine.arrived == [60, 100, 10, 10, 10, 10]


async def test_a_cancelled_waiter_does_not_hold_up_the_queue() -> None:
    engine = _HeldEngine()
    first = await engine.hold_60()
    large = engine.post(100)
    await asyncio.sleep(0.02)
    small = engine.post(10)
    await asyncio.sleep(0.02)
    large.cancel()
    await asyncio.wait_for(small, 2)  # in beside the 60, once the large one left the queue
    assert engine.arrived == [60, 10]
    engine.release.set()
    await first
    c = engine.client
    assert c._tokens == 0 and not c._waiters


def test_credentials_in_a_url_are_redacted() -> None:
    assert redacted_url("http://user:s3cret@vllm:8000/v1") == "http://***@vllm:8000/v1"
    assert redacted_url("https://s3cret@vllm") == "https://***@vllm"
    assert redacted_url("http://vllm:8000") == "http://vllm:8000"


async def test_credentials_in_the_url_authenticate_but_appear_nowhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(502) if len(seen) == 1 else httpx.Response(200, json={})

    c = EngineClient("http://user:s3cret@vllm:8000", transport=httpx.MockTransport(handler))
    assert c.redacted_url == "http://***@vllm:8000"
    with pytest.raises(EngineUnavailable) as raised:
        await c.get("/v1/models")
    assert "s3cret" not in raised.value.message and "vllm:8000" not in raised.value.message
    assert "http://***@vllm:8000" in caplog.text and "s3cret" not in caplog.text
    await c.get("/v1/models")
    assert seen[-1].headers["Authorization"] == "Basic dXNlcjpzM2NyZXQ="  # user:s3cret
    # An explicit key wins over the URL's credentials.
    keyed = EngineClient(
        "http://user:s3cret@vllm:8000", api_key="k", transport=httpx.MockTransport(handler)
    )
    await keyed.get("/v1/models")
    assert seen[-1].headers["Authorization"] == "Bearer k"
