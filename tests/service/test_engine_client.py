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

from service.backends.engine_client import EngineCall, EngineClient, EngineHTTPError
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
    c = client([answer(502), answer(502), answer(502)], seen, retries=2)
    with pytest.raises(EngineUnavailable, match=r"HTTP 502.*after 2 retries"):
        await c.get("/v1/models")
    assert len(seen) == 3


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
