"""Admission on its own: the deadline check's arithmetic, Retry-After, the idle rule, the
meter's measurement under cancellations, the start before any measurement, and the request's
prompts x characters budget charged before its prompts are rendered."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from service.backends.base import ChatMessage, Encoding
from service.backends.fakes.fake import FakeBackend
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.config.settings import Settings
from service.errors import LimitExceeded
from service.passage import Passage
from service.prompting.prompts import build_prompts
from service.runtime.throughput import ThroughputMeter
from serving.admission.backends import AdmittedBackend
from serving.admission.control import Admission
from serving.admission.deadline import Deadline
from serving.admission.errors import Overloaded
from serving.metrics import ServiceMetrics
from tests.app.conftest import PASSAGES, measured, serving


def test_a_call_is_admitted_while_the_queue_ahead_and_its_own_work_fit_its_deadline() -> None:
    # Within 90% of the time left: the margin for an engine slower under load than measured.
    admission = measured(1000.0)
    deadline = Deadline.starting_now(10.0, "request_timeout_s")
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
    deadline = Deadline.starting_now(10.0, "request_timeout_s")
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
    # 1,000 s: still admitted alone
    with admission.tokens(10_000, Deadline.starting_now(1.0, "request_timeout_s")):
        pass
    fresh = Admission(Settings(), ServiceMetrics(include_default_registry=False))
    assert fresh.meter.tokens_per_s is None and fresh.estimated_wait_s is None
    # Unmeasured: no deadline check (within unmeasured_inflight_prompt_tokens).
    now = Deadline(time.monotonic(), 120.0, "request_timeout_s")
    with fresh.tokens(10_000, now), fresh.tokens(10_000, now):
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


def test_a_call_cancelled_beside_another_does_not_inflate_the_rate() -> None:
    # Issue 54: A and B start together, B is cancelled at 9 s (its deadline), A completes at
    # 10 s with 1,000 tokens. The engine was busy 10 s for them: ~100 tokens/s. Restarting the
    # clock at the cancellation measured 1,000 tokens/s, and admission over-admitted by 10x.
    meter = ThroughputMeter()
    meter.begin(0.0)
    meter.begin(0.0)
    meter.end(9.0, None)
    meter.end(10.0, 1000)
    assert meter.tokens_per_s == pytest.approx(100.0, rel=0.01)


def test_under_overload_cancellations_keep_the_rate_at_the_engines() -> None:
    # An engine of 100 tokens/s serving calls of 500 tokens one at a time (5 s each), with two
    # more queued behind each that their deadlines cancel before they start: the rate must stay
    # about 100/s however many are cancelled, not grow with them.
    meter = ThroughputMeter()
    t = 0.0
    for _ in range(20):
        meter.begin(t)  # served
        meter.begin(t + 0.1)  # queued, cancelled at 4 s and 4.5 s
        meter.begin(t + 0.2)
        meter.end(t + 4.0, None)
        meter.end(t + 4.5, None)
        meter.end(t + 5.0, 500)
        t += 5.0
    assert meter.tokens_per_s == pytest.approx(100.0, rel=0.01)
    assert meter.completed == 20


def test_a_failure_that_leaves_the_engine_idle_drops_its_time() -> None:
    meter = ThroughputMeter()
    meter.begin(0.0)
    meter.begin(1.0)
    meter.end(2.0, None)  # one still in flight: the clock keeps running from 0
    meter.end(30.0, None)  # idle now: the 30 s are dropped
    meter.begin(100.0)
    meter.end(101.0, 1000)  # measured from 100 s, not from 0 s or 30 s
    assert meter.tokens_per_s == pytest.approx(1000.0)


def test_before_any_measurement_the_tokens_in_flight_are_capped() -> None:
    # Issue 54: after a restart under queued traffic, with no rate yet and no fixed cap, 64
    # large requests were admitted at once; now the unmeasured cap bounds them.
    admission = Admission(
        Settings(unmeasured_inflight_prompt_tokens=100_000),
        ServiceMetrics(include_default_registry=False),
    )
    deadline = Deadline.starting_now(120.0, "request_timeout_s")
    refused = 0
    with admission.tokens(150_000, deadline):  # alone: always admitted, even over the cap
        for _ in range(64):
            with (
                pytest.raises(Overloaded, match="not yet measured"),
                admission.tokens(40_000, deadline),
            ):
                pass
            refused += 1
    assert refused == 64
    # (That call's completion measured a rate; a fresh admission is unmeasured again.)
    admission = Admission(
        Settings(unmeasured_inflight_prompt_tokens=100_000),
        ServiceMetrics(include_default_registry=False),
    )
    with admission.tokens(40_000, deadline), admission.tokens(40_000, deadline):
        with pytest.raises(Overloaded) as over, admission.tokens(40_000, deadline):
            pass
        assert over.value.retry_after_s is None  # the configured retry_after_s
        # Once a rate is known (the warm-up's seed), the deadline rule replaces the cap.
        admission.seed(100_000, 1.0)
        with admission.tokens(40_000, deadline):
            pass


def test_a_seeded_rate_makes_deadline_admission_work_from_the_first_request() -> None:
    admission = Admission(
        Settings(request_timeout_s=10.0), ServiceMetrics(include_default_registry=False)
    )
    admission.seed(120, 0.12)  # the warm-up probe: 120 prompt tokens in 0.12 s
    assert admission.meter.tokens_per_s == pytest.approx(1000.0)
    assert admission.meter.completed == 0
    deadline = Deadline.starting_now(10.0, "request_timeout_s")
    with (
        admission.tokens(4000, deadline),
        admission.tokens(4000, deadline),
        pytest.raises(Overloaded, match="deadline"),
        admission.tokens(2000, deadline),
    ):
        pass


def test_a_seed_weighs_its_seconds_and_is_ignored_once_a_call_completed() -> None:
    meter = ThroughputMeter()
    meter.seed(120, 0.12)
    meter.begin(0.0)
    meter.end(10.0, 5000)  # the first real call: 10 s against the seed's 0.12 s
    rate = meter.tokens_per_s
    assert rate is not None and 500 <= rate < 510
    meter.seed(1_000_000, 1.0)
    assert meter.tokens_per_s == rate


class CountingTokenizer(ByteTokenizer):
    """Counts the prompts rendered and the texts tokenised."""

    def __init__(self) -> None:
        self.rendered = 0
        self.encoded = 0

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        self.rendered += 1
        return super().render_chat(messages, add_generation_prompt=add_generation_prompt)

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        self.encoded += len(texts)
        return super().encode_batch(texts)


class CountingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__({})
        self.counting = CountingTokenizer()

    @property
    def tokenizer(self) -> CountingTokenizer:
        return self.counting


def test_prompts_x_characters_are_refused_before_the_prompts_are_tokenised() -> None:
    # Issue 54: a request inside every input limit (100 passages of 32,768 characters, 512
    # prompts) rendered and tokenised all its prompts (gigabytes) before any length check.
    backend = CountingBackend()
    settings = Settings(max_prompt_chars_x_prompts=10_000)
    admission = Admission(settings, ServiceMetrics(include_default_registry=False))
    passages = [Passage("x" * 1000) for _ in range(4)]
    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2], [2, 3, 0, 1]]

    def request() -> AdmittedBackend:
        return AdmittedBackend(backend, admission, settings)

    admitted = request()
    two = build_prompts(admitted.tokenizer, "qa_default", "q?", passages, orders[:2])
    assert len(two) == 2  # two prompts of about 4,300 characters fit 10,000
    backend.counting.rendered = backend.counting.encoded = 0
    with pytest.raises(LimitExceeded) as refused:
        # The same request's next call: its third prompt would cross the budget.
        build_prompts(admitted.tokenizer, "qa_default", "q?", passages, orders[2:])
    assert refused.value.param == "prompt_chars_x_prompts"
    assert refused.value.limit == 10_000 and refused.value.value > 10_000
    assert backend.counting.rendered == 0 and backend.counting.encoded == 0
    # The budget is the request's: a new request starts from nothing.
    assert len(build_prompts(request().tokenizer, "qa_default", "q?", passages, orders[2:])) == 2


async def test_422_prompts_x_characters_over_http(tmp_path: Path) -> None:
    async with serving(tmp_path, max_prompt_chars_x_prompts=1024) as h:
        started = h.backend.started
        r = await h.client.post(
            "/v1/reorder",
            json={"query": "q?", "passages": PASSAGES, "strategy": "moi"},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "limit_exceeded"
        assert err["param"] == "prompt_chars_x_prompts" and err["limit"] == 1024
        assert err["value"] > 1024
        assert h.backend.started == started


def test_a_refused_calibration_s_retry_after_is_priced_against_its_own_deadline() -> None:
    """Issue 90: a calibration's retry gets a fresh ``calibration_timeout_s`` (100 s here),
    not ``request_timeout_s`` (10 s): the queue ahead has to shrink only until the
    calibration's own work fits that."""
    from service.strategies.request import Estimate

    admission = measured(1000.0, timeout_s=10.0)  # 1,000 prompt tokens/s
    ahead = admission.reserve(
        Estimate(prompts=1, prompt_tokens=90_000, new_tokens=0, param="passages"), None
    )  # 90 s of work queued
    calibration = Estimate(prompts=10, prompt_tokens=20_000, new_tokens=0, param="queries")
    with pytest.raises(Overloaded) as refused:  # 90 + 20 s > 90 s usable of 100 s
        admission.reserve(calibration, Deadline.starting_now(100.0, "calibration_timeout_s"))
    # Retried once 20 s of the queue are done, its 20 s fit behind the other 70 (90 s usable);
    # priced against request_timeout_s it was told 90 s (the whole queue).
    assert refused.value.retry_after_s == 20
    # The same through a call not admitted as a whole (AdmittedBackend.score's path).
    with (
        pytest.raises(Overloaded) as call,
        admission.tokens(20_000, Deadline.starting_now(100.0, "calibration_timeout_s")),
    ):
        pass
    assert call.value.retry_after_s == 20
    admission.release(ahead)
