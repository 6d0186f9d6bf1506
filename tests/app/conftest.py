"""Route-test fixtures: the real app on the fake backend, in process, lifespan included."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from app.main import create_app
from service.backends.base import ScoreResult, SpanRequest
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.runtime.throughput import MIN_CALLS
from serving.admission.control import Admission
from serving.context import AppContext
from serving.metrics import ServiceMetrics

QUERY = "which passage answers the question?"
# Four passages with known utilities; the fake backend scores by them (and a primacy bias).
TRUTH = {
    "The first passage talks about rivers.": -1.0,
    "The second passage is the real answer.": 2.0,
    "The third passage mentions the answer in passing.": 0.8,
    "The fourth passage is about something else.": -0.4,
}
PASSAGES = list(TRUTH)
BEST_FIRST = sorted(range(len(PASSAGES)), key=lambda i: -TRUTH[PASSAGES[i]])


class TrackingBackend(FakeBackend):
    """The fake backend, counting score calls started and cancelled, and the request ids seen.

    ``error`` makes ``score`` raise it (an unexpected backend bug, not a prompt failure).
    """

    def __init__(self, truth: dict[str, float], **kwargs: Any) -> None:
        super().__init__(truth, **kwargs)
        self.started = 0
        self.cancelled = 0
        self.request_ids: list[str] = []
        self.error: Exception | None = None

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.started += 1
        self.request_ids.extend(r.request_id for r in requests)
        if self.error is not None:
            raise self.error
        try:
            return await super().score(requests)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise


@dataclass
class Harness:
    app: FastAPI
    client: httpx.AsyncClient
    backend: TrackingBackend

    @property
    def ctx(self) -> AppContext:
        ctx = self.app.state.ctx
        assert isinstance(ctx, AppContext)
        return ctx

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.ctx.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else float(value)


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await anyio.sleep(0.005)


async def wait_ready(client: httpx.AsyncClient, timeout: float = 30.0) -> None:
    # A wait, not a timing check: on a 2-core machine shared with other suites (load 30 seen)
    # a warm-up that takes 0.3 s alone took over 5 s. A harness that never gets ready still
    # fails, with /ready's last answer.
    deadline = time.monotonic() + timeout
    while (response := await client.get("/ready")).status_code != 200:
        if time.monotonic() > deadline:
            raise AssertionError(f"/ready never turned 200: {response.text}")
        await anyio.sleep(0.005)


def settings_for(tmp_path: Path, **overrides: Any) -> Settings:
    # Canaries (liveness and rate) off unless a test asks: they would add score calls at
    # random moments. Writes open, as on the local quick start; test_errors shows them
    # closed by default.
    base: dict[str, Any] = {
        "cache_dir": tmp_path,
        "canary_interval_s": 0,
        "rate_canary": False,
        "open_writes": True,
    }
    base.update(overrides)
    return Settings(**base)


@asynccontextmanager
async def serving(
    tmp_path: Path,
    *,
    backend: TrackingBackend | None = None,
    ready: bool = True,
    headers: dict[str, str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """The app with its lifespan running and an httpx client on it (no sockets)."""
    backend = backend if backend is not None else TrackingBackend(TRUTH)
    app = create_app(settings_for(tmp_path, **overrides), backend=backend)
    # raise_app_exceptions=False: the 500 path must be answered by the app, as on a server.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client,
    ):
        if ready:
            await wait_ready(client)
        yield Harness(app, client, backend)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Harness]:
    async with serving(tmp_path) as h:
        yield h


def reorder_body(**extra: Any) -> dict[str, Any]:
    return {"query": QUERY, "passages": PASSAGES, **extra}


def rerank_body(**extra: Any) -> dict[str, Any]:
    return {"query": QUERY, "documents": PASSAGES, **extra}


def measured(rate: float, timeout_s: float = 10.0) -> Admission:
    """An admission whose meter has measured ``rate`` tokens/s."""
    admission = Admission(
        Settings(request_timeout_s=timeout_s), ServiceMetrics(include_default_registry=False)
    )
    # Enough recent calls for the rate to be confirmed (it may refuse work for good), just
    # before now: admission reads the clock.
    t0 = time.monotonic() - 2.0 * MIN_CALLS
    for i in range(MIN_CALLS):
        admission.meter.begin(t0 + i)
        admission.meter.end(t0 + i + 1.0, int(rate))
    assert admission.meter.tokens_per_s == pytest.approx(rate)
    assert admission.meter.confirmed(time.monotonic())
    return admission
