"""Admission on its own: the deadline check's arithmetic, Retry-After, and the idle rule."""

from __future__ import annotations

import time

import pytest

from app.admission import Admission
from app.exceptions import Overloaded
from app.metrics import ServiceMetrics
from service.capacity import ThroughputMeter
from service.settings import Settings


def measured(rate: float, timeout_s: float = 10.0) -> Admission:
    """An admission whose meter has measured ``rate`` tokens/s."""
    admission = Admission(
        Settings(request_timeout_s=timeout_s), ServiceMetrics(include_default_registry=False)
    )
    admission.meter.begin(0.0)
    admission.meter.end(1.0, int(rate))
    assert admission.meter.tokens_per_s == pytest.approx(rate)
    return admission


def test_a_call_is_admitted_while_the_queue_ahead_and_its_own_work_fit_its_deadline() -> None:
    # Within 90% of the time left: the margin for an engine slower under load than measured.
    admission = measured(1000.0)
    deadline = time.monotonic() + 10.0
    with admission.tokens(4000, deadline), admission.tokens(4000, deadline):
        assert admission.estimated_wait_s == pytest.approx(8.0)
        # 8,000 ahead + 2,000 of its own = 10 s > 9 s: refused, retry in about 1 s.
        with pytest.raises(Overloaded) as refused, admission.tokens(2000, deadline):
            pass
        assert refused.value.retry_after_s == 1
        assert "deadline" in refused.value.message
        # 500 of its own still fits (8.5 s).
        with admission.tokens(500, deadline):
            pass
    assert admission.tokens_in_flight == 0


def test_retry_after_is_when_the_queue_will_have_shrunk_enough() -> None:
    admission = measured(100.0, timeout_s=10.0)
    deadline = time.monotonic() + 10.0
    with admission.tokens(3000, deadline):  # 30 s of work ahead (admitted: the engine idled)
        with pytest.raises(Overloaded) as refused, admission.tokens(200, deadline):
            pass
        # Fits once 30 + 2 - 0.9 x 10 = 23 s of the queue are done.
        assert refused.value.retry_after_s == 23
        # A call longer than a whole deadline fits only an idle engine: after the 30 s.
        with pytest.raises(Overloaded) as refused, admission.tokens(2000, deadline):
            pass
        assert refused.value.retry_after_s == 30


def test_an_idle_engine_admits_any_call_and_an_unmeasured_one_skips_the_check() -> None:
    admission = measured(10.0, timeout_s=1.0)
    with admission.tokens(10_000, time.monotonic() + 1.0):  # 1,000 s: still admitted alone
        pass
    fresh = Admission(Settings(), ServiceMetrics(include_default_registry=False))
    assert fresh.meter.tokens_per_s is None and fresh.estimated_wait_s is None
    with fresh.tokens(10_000, time.monotonic()), fresh.tokens(10_000, time.monotonic()):
        pass


def test_a_failed_or_cancelled_call_adds_nothing_to_the_rate() -> None:
    meter = ThroughputMeter()
    meter.begin(0.0)
    meter.end(2.0, None)  # failed: its 2 s are dropped
    assert meter.tokens_per_s is None
    meter.begin(2.0)
    meter.begin(2.5)
    meter.end(3.0, 500)  # the first finished after 1 s of busy time
    meter.end(4.0, 1000)  # the second 1 s later
    assert meter.tokens_per_s == pytest.approx(750.0, rel=0.02)
    assert meter.completed == 2


def test_the_rate_follows_a_change_within_a_few_half_lives() -> None:
    meter = ThroughputMeter(half_life_s=60.0)
    t = 0.0
    for _ in range(20):  # 200 s at 1,000 tokens/s
        meter.begin(t)
        t += 10.0
        meter.end(t, 10_000)
    for _ in range(30):  # then 300 s at 500 tokens/s
        meter.begin(t)
        t += 10.0
        meter.end(t, 5000)
    rate = meter.tokens_per_s
    assert rate is not None and 500 < rate < 560


def test_the_fixed_token_cap_still_applies_when_set() -> None:
    admission = Admission(
        Settings(max_inflight_prompt_tokens=1000),
        ServiceMetrics(include_default_registry=False),
    )
    with (
        admission.tokens(800),
        pytest.raises(Overloaded, match="in-flight budget"),
        admission.tokens(300),
    ):
        pass
