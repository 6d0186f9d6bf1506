"""``dense`` through the HTTP app: concurrent requests share the encoder's forwards and its
figures are in ``/info``; and the reorder routes run no dependency in the thread pool."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import get_args

import pytest

from app.dependencies import Ctx, RequestId, get_context, get_request_id
from tests.app.conftest import serving

pytestmark = pytest.mark.anyio

TEXTS = [f"Passage {k} tells of the river number {k} and its towns." for k in range(6)]


async def test_concurrent_dense_requests_share_forwards_and_info_says_so(tmp_path: Path) -> None:
    # A wait for company, so the requests meet however the event loop schedules them.
    async with serving(tmp_path, dense_batch_wait_ms=300, dense_cache_entries=16) as h:
        assert (await h.client.get("/info")).json()["dense"] is None  # not loaded yet
        bodies = [{"query": f"which river is number {k}?", "passages": TEXTS, "strategy": "dense"}
                  for k in range(4)]  # fmt: skip
        rs = await asyncio.gather(*(h.client.post("/v1/reorder", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in rs)
        assert [r.json()["ranking"][0] for r in rs] == [0, 1, 2, 3]
        d = (await h.client.get("/info")).json()["dense"]
        assert d["requests"] == 4 and d["texts"] == 4 * 7 and d["device"] == "cpu"
        # The passages are the same in every request: later requests read them from the cache
        # or shared the first forward; either way fewer forwards than requests.
        assert d["forwards"] < 4 and d["rows"] + d["cache_hits"] >= 4 + 6


def test_the_request_dependencies_run_on_the_event_loop() -> None:
    """FastAPI runs a plain ``def`` dependency in its thread pool: a thread hand-off on every
    request of the no-model path for what is a dictionary lookup. Every route's dependencies
    are these two."""
    for dep in (get_context, get_request_id):
        assert inspect.iscoroutinefunction(dep), dep
    for name, typ in (("Ctx", Ctx), ("RequestId", RequestId)):
        (marker,) = get_args(typ)[1:]
        assert marker.dependency in (get_context, get_request_id), name
