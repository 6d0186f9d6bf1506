"""The response cache (``app.response_cache``, ``service.state.response_cache``): what a hit
looks like, that it is never served across options or callers' bodies, never after the
profile it was placed by changed, never for an error or a server-side random draw; its byte
bound, its TTL, Redis shared by two replicas and Redis down.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import SecretStr, ValidationError

from app.response_cache import ResponseCaching
from service.config.settings import Settings
from service.state.response_cache import ResponseCache, entry_size
from tests.app.conftest import (
    PASSAGES,
    Harness,
    TrackingBackend,
    reorder_body,
    rerank_body,
    serving,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.anyio

ON = {"cache_max_bytes": 2**22}
# What differs between two answers to one request: the request's id and this request's
# work (a hit did none).
PER_REQUEST = ("id", "usage", "timing", "cached")
SCORED = [{"text": t, "score": float(i)} for i, t in enumerate(PASSAGES)]


def caching(h: Harness) -> ResponseCaching:
    c = h.app.state.response_cache
    assert isinstance(c, ResponseCaching)
    return c


def answer(j: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in j.items() if k not in PER_REQUEST}
    if "meta" in out:  # the rerank envelope: the native response is in meta.reorder
        out["meta"] = {**out["meta"], "reorder": answer(out["meta"]["reorder"])}
    return out


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


async def test_a_refire_is_served_from_the_cache_under_its_own_id(tmp_path: Path) -> None:
    async with serving(tmp_path, **ON) as h:
        body = reorder_body(strategy="moi")
        first = await h.client.post("/v1/reorder", json=body, headers={"X-Request-Id": "a-1"})
        calls = h.backend.started
        assert first.status_code == 200 and first.headers["X-Cache"] == "miss"
        assert first.json()["cached"] is False and first.json()["usage"]["prompt_tokens"] > 0
        second = await h.client.post("/v1/reorder", json=body, headers={"X-Request-Id": "b-2"})
        assert second.status_code == 200 and second.headers["X-Cache"] == "hit"
        j = second.json()
        assert j["cached"] is True and j["id"] == "b-2" and second.headers["X-Request-Id"] == "b-2"
        assert h.backend.started == calls  # no model call
        assert j["usage"] == {k: 0 for k in j["usage"]}
        assert j["timing"]["scoring_s"] == 0 and j["timing"]["total_s"] < 0.5
        assert answer(j) == answer(first.json())
        assert h.metric("rag_reorder_cache_hits_total", {"tier": "local"}) == 1
        assert h.metric("rag_reorder_cache_misses_total") == 1
        assert h.metric("rag_reorder_cache_bytes") == caching(h).cache.bytes_held > 0

        # The rerank routes: the same, with the rerank envelope's usage.
        rb = rerank_body(reorder={"strategy": "moi"}, top_n=2)
        r1 = (await h.client.post("/v1/rerank", json=rb)).json()
        r2 = await h.client.post("/v1/rerank", json=rb)
        assert r2.headers["X-Cache"] == "hit" and r2.json()["id"] != r1["id"]
        assert r2.json()["results"] == r1["results"] and r2.json()["usage"]["total_tokens"] == 0
        assert r2.json()["meta"]["reorder"]["cached"] is True
        # Another route of the same shape is its own key.
        r3 = await h.client.post("/v2/rerank", json=rb)
        assert r3.headers["X-Cache"] == "miss"


async def test_without_the_setting_nothing_is_cached(tmp_path: Path) -> None:
    async with serving(tmp_path) as h:
        body = reorder_body(strategy="moi")
        await h.client.post("/v1/reorder", json=body)
        r = await h.client.post("/v1/reorder", json=body)
        assert "X-Cache" not in r.headers and r.json()["cached"] is False
        assert h.app.state.response_cache is None


async def test_a_cached_answer_is_never_served_for_other_options(tmp_path: Path) -> None:
    """Two callers: each option (or passage order, or a passage's score) that changes the
    body is another key, and every answer the cache serves is the one a server without it
    gives for that body. Unknown rerank fields (ignored) and headers change nothing."""
    variants: list[tuple[str, dict[str, Any]]] = [
        ("/v1/reorder", reorder_body(strategy="moi")),
        ("/v1/reorder", reorder_body(strategy="moi", seed=7)),
        ("/v1/reorder", reorder_body(strategy="moi", design={"seed": 3})),
        ("/v1/reorder", reorder_body(strategy="moi", top_n=2)),
        ("/v1/reorder", reorder_body(strategy="moi", placement="litm")),
        ("/v1/reorder", reorder_body(strategy="shuffle")),
        ("/v1/reorder", reorder_body(strategy="shuffle", seed=1)),
        ("/v1/reorder", {"query": "another question?", "passages": PASSAGES,
                         "strategy": "shuffle"}),
        ("/v1/reorder", reorder_body(strategy="moi", passages=PASSAGES[::-1])),
        ("/v1/reorder", reorder_body(strategy="moi", passages=SCORED)),
        ("/v1/rerank", rerank_body(reorder={"strategy": "moi"})),
        ("/v1/rerank", rerank_body(reorder={"strategy": "moi", "results_order": "placement"})),
        ("/v1/rerank", rerank_body(reorder={"strategy": "moi"}, return_documents=False)),
    ]  # fmt: skip
    async with serving(tmp_path / "off") as plain:
        expected = [
            answer((await plain.client.post(route, json=body)).json()) for route, body in variants
        ]
    # Nearly every variant answers apart (on 4 passages two MoI seeds may fit alike).
    assert len({repr(e) for e in expected}) >= len(expected) - 1
    async with serving(tmp_path / "on", **ON) as h:
        for rounds in range(2):
            for (route, body), want in zip(variants, expected, strict=True):
                caller = {"X-Forwarded-For": f"10.0.0.{rounds}", "X-Request-Id": f"r{rounds}"}
                r = await h.client.post(route, json=body, headers=caller)
                assert r.status_code == 200, r.text
                assert r.headers["X-Cache"] == ("miss" if rounds == 0 else "hit")
                assert answer(r.json()) == want
        # An ignored field on the lenient rerank body is the same request.
        r = await h.client.post(
            "/v1/rerank", json={**rerank_body(reorder={"strategy": "moi"}), "extra": 1}
        )
        assert r.headers["X-Cache"] == "hit" and answer(r.json()) == expected[10]


async def test_a_profile_changing_under_the_cache_is_a_miss(tmp_path: Path) -> None:
    """``auto`` placing by the profile the operator names: a new version of that profile
    (here its direction reversed) is a miss and placed by the new one, never the old."""
    texts = PASSAGES
    body = {"query": "which passage?", "passages": texts,
            "bias_profile": "generator__qa_default__L4"}  # fmt: skip

    def store(coefficients: list[float]) -> None:
        h.ctx.engine.profiles.put(
            model="generator", template="qa_default", coefficients=coefficients,
            identification="answers", runs=50, prompts=200, r2=1.0, source="answers",
            oriented_by="data",
        )  # fmt: skip

    async with serving(tmp_path, auto_explore_rate=0.0, **ON) as h:
        store([0.4, 0.3, 0.2, 0.1])  # primacy: the best passage first
        r1 = await h.client.post("/v1/reorder", json=body)
        j1 = r1.json()
        assert j1["auto"]["path"] == "profile" and r1.headers["X-Cache"] == "miss"
        assert j1["order"][0] == j1["ranking"][0]
        assert (await h.client.post("/v1/reorder", json=body)).headers["X-Cache"] == "hit"
        store([0.1, 0.2, 0.3, 0.4])  # recency: the best passage last
        r2 = await h.client.post("/v1/reorder", json=body)
        j2 = r2.json()
        assert r2.headers["X-Cache"] == "miss" and j2["cached"] is False
        assert j2["order"][-1] == j2["ranking"][0] != j2["order"][0]
        r3 = await h.client.post("/v1/reorder", json=body)
        assert r3.headers["X-Cache"] == "hit" and r3.json()["order"] == j2["order"]
        # A drift withdraws a profile by storing it again: the same, whatever else changed.
        store([0.1, 0.2, 0.3, 0.4])
        assert (await h.client.post("/v1/reorder", json=body)).headers["X-Cache"] == "miss"


async def test_server_side_draws_and_errors_are_never_cached(tmp_path: Path) -> None:
    async with serving(tmp_path, **ON) as h:
        # auto without a trusted profile: a learning run (path moi), kept each time.
        body = reorder_body()
        for _ in range(2):
            r = await h.client.post("/v1/reorder", json=body)
            assert r.json()["auto"]["path"] == "moi" and r.headers["X-Cache"] == "miss"
        assert len(caching(h).cache) == 0
        # An error is not stored: the same request after the fault is computed.
        moi = reorder_body(strategy="moi")
        h.backend.error = RuntimeError("engine bug")
        assert (await h.client.post("/v1/reorder", json=moi)).status_code == 500
        h.backend.error = None
        r = await h.client.post("/v1/reorder", json=moi)
        assert r.status_code == 200 and r.headers["X-Cache"] == "miss"
        assert (await h.client.post("/v1/reorder", json=moi)).headers["X-Cache"] == "hit"


async def test_the_byte_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    async with serving(tmp_path, **ON) as h:
        cache = caching(h).cache
        a, b = reorder_body(strategy="moi"), reorder_body(strategy="moi", seed=1)
        await h.client.post("/v1/reorder", json=a)
        one = cache.bytes_held
        cache.max_bytes = one + one // 2  # room for one response
        await h.client.post("/v1/reorder", json=b)
        assert len(cache) == 1 and cache.bytes_held <= cache.max_bytes
        assert h.metric("rag_reorder_cache_evictions_total", {"reason": "bytes"}) == 1
        assert (await h.client.post("/v1/reorder", json=a)).headers["X-Cache"] == "miss"
        assert h.metric("rag_reorder_cache_bytes") == cache.bytes_held <= cache.max_bytes


async def test_an_entry_expires_after_the_ttl(tmp_path: Path) -> None:
    async with serving(tmp_path, cache_ttl_s=0.2, **ON) as h:
        body = reorder_body(strategy="moi")
        await h.client.post("/v1/reorder", json=body)
        assert (await h.client.post("/v1/reorder", json=body)).headers["X-Cache"] == "hit"
        await anyio.sleep(0.3)
        assert (await h.client.post("/v1/reorder", json=body)).headers["X-Cache"] == "miss"
        assert h.metric("rag_reorder_cache_evictions_total", {"reason": "ttl"}) == 1


def test_the_store_bounds_bytes_and_time_on_its_clock() -> None:
    now = [0.0]
    cache = ResponseCache(max_bytes=300, ttl_s=10.0, max_entry_bytes=200, clock=lambda: now[0])

    async def go() -> None:
        for k in "abc":
            assert await cache.put(k, "x" * 90)
        assert cache.bytes_held == 3 * entry_size("a", "x" * 90) and len(cache) == 3
        assert await cache.get("a") is not None  # a is now the most recently used
        assert await cache.put("d", "x" * 90)  # b goes, not a
        assert await cache.get("b") is None and await cache.get("a") is not None
        assert cache.counters.evictions == {"bytes": 1, "ttl": 0}
        assert not await cache.put("big", "x" * 250)  # over max_entry_bytes: not kept
        assert await cache.get("big") is None
        now[0] = 10.0
        assert await cache.get("a") is None and cache.counters.evictions["ttl"] == 1
        assert await cache.put("e", "y")  # the expired at the front go first
        assert cache.bytes_held == entry_size("e", "y") + sum(
            entry_size(k, "x" * 90) for k in "cd" if k in cache._entries
        )

    anyio.run(go)


def test_cache_redis_needs_state_url() -> None:
    with pytest.raises(ValidationError, match="cache_redis needs state_url"):
        Settings(cache_redis=True, cache_max_bytes=2**20)


async def test_two_replicas_share_the_cache_through_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    shared = {
        "state_url": SecretStr(redis_server.url),
        "state_password": SecretStr(redis_server.password),
        "state_key_prefix": f"cache-{time.monotonic_ns()}",
        "state_refresh_s": 0.05,
        "cache_redis": True,
        **ON,
    }
    body = reorder_body(strategy="moi")
    async with (
        # Replicas share answers when their settings are equal (they are in the key).
        serving(tmp_path, **shared) as a,
        serving(tmp_path, backend=TrackingBackend(dict.fromkeys(PASSAGES, 0.0)),
                **shared) as b,
    ):  # fmt: skip
        first = await a.client.post("/v1/reorder", json=body)
        assert first.headers["X-Cache"] == "miss"
        calls = b.backend.started
        # b's backend would answer otherwise (every passage equal): its answer is a's.
        r = await b.client.post("/v1/reorder", json=body)
        assert r.headers["X-Cache"] == "hit" and r.json()["cached"] is True
        assert answer(r.json()) == answer(first.json()) and b.backend.started == calls
        assert b.metric("rag_reorder_cache_hits_total", {"tier": "redis"}) == 1
        # Another option on b is its own key, computed by b.
        other = await b.client.post("/v1/reorder", json=reorder_body(strategy="moi", seed=5))
        assert other.headers["X-Cache"] == "miss" and b.backend.started > calls


async def test_redis_down_never_fails_a_request(tmp_path: Path) -> None:
    dead = RedisServer(tmp_path / "dead")  # a port nothing listens on
    async with serving(
        tmp_path,
        state_url=SecretStr(dead.url),
        state_refresh_s=5.0,
        state_timeout_s=0.2,
        cache_redis=True,
        **ON,
    ) as h:
        body = reorder_body(strategy="moi")
        t = time.perf_counter()
        first = await h.client.post("/v1/reorder", json=body)
        assert first.status_code == 200 and first.headers["X-Cache"] == "miss"
        second = await h.client.post("/v1/reorder", json=body)
        assert second.status_code == 200 and second.headers["X-Cache"] == "hit"
        # One failed call, then Redis is left alone for state_refresh_s: no second wait.
        assert time.perf_counter() - t < 2.0
        assert h.metric("rag_reorder_cache_redis_failures_total") == 1
        assert h.metric("rag_reorder_cache_hits_total", {"tier": "local"}) == 1
