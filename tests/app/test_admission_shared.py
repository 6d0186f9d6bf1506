"""Admission across worker processes (``workers`` > 1): the budgets and the queue ahead are
the engine's, summed over the workers' shared counts; the rate is the engine process's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.backends.engines.engine_socket import EngineMeter
from service.config.settings import Settings
from service.runtime import shared_counts
from service.runtime.shared_counts import SharedCounts
from service.runtime.throughput import ThroughputMeter
from serving.admission.control import Admission
from serving.admission.errors import Overloaded
from serving.metrics import ServiceMetrics


def two_workers(tmp_path: Path, **settings: object) -> tuple[Admission, Admission]:
    shared_counts.create(tmp_path / "counts", 2)
    s = Settings(**settings)  # type: ignore[arg-type]
    return tuple(  # type: ignore[return-value]
        Admission(s, ServiceMetrics(include_default_registry=False),
                  SharedCounts(tmp_path / "counts", slot))
        for slot in (0, 1)
    )  # fmt: skip


def test_the_concurrency_limit_counts_every_workers_requests(tmp_path: Path) -> None:
    a, b = two_workers(tmp_path, max_concurrent_requests=2)
    with a.request(), b.request():
        with pytest.raises(Overloaded, match="2 requests in flight, the limit is 2"), a.request():
            pass
        assert (a.in_flight, b.in_flight) == (1, 1)  # each drains its own
    with a.request(), a.request():
        pass


def test_the_token_budget_and_the_queue_ahead_are_the_engines(tmp_path: Path) -> None:
    a, b = two_workers(tmp_path, max_inflight_prompt_tokens=1000)
    with b.tokens(700):
        assert a.tokens_in_flight == 700
        refused = pytest.raises(Overloaded, match=r"400 prompt tokens do not fit .*700 of 1000")
        with refused, a.tokens(400):
            pass
    assert a.tokens_in_flight == 0


def test_a_workers_admission_prices_work_at_the_engine_processs_rate() -> None:
    engine = ThroughputMeter()
    t0 = time.monotonic() - 100
    for i in range(5):
        engine.begin(t0 + i)
        engine.end(t0 + i + 0.5, 5_000)
    copy = EngineMeter()
    copy.update(dict(vars(engine)))
    admission = Admission(Settings(), ServiceMetrics(include_default_registry=False), meter=copy)
    assert admission.meter.tokens_per_s == pytest.approx(10_000)
    with admission.tokens(2_000):  # timed by the engine process, not here
        pass
    assert admission.meter.completed == 5
