"""The service never talks itself into refusing work (issue 70): estimates that heal, a
canary that cannot mistake busy for dead, ``auto``'s cold start off the caller's path, and
explore sized to what the engine can run.

The HTTP tests run the real app on the fake backend as an engine of fixed capacity
(``s_per_token``: one call at a time, in arrival order), so the figures are known. A slow
first measurement is made by hand with the meter's own calls, as the warm-up behind a busy
neighbour made it on the real server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from service.config.settings import Settings
from service.learning.learner import Decision, LearnKey, ProfileLearner
from service.runtime.throughput import FRESH_S, MIN_CALLS, WALL_HALF_LIFE_S, ThroughputMeter
from service.state.profile_store import ProfileStore
from service.strategies.request import Estimate
from serving.admission.control import Admission
from serving.admission.deadline import Deadline
from serving.metrics import ServiceMetrics
from tests.app.conftest import Harness, TrackingBackend, serving, wait_until

pytestmark = pytest.mark.anyio

S_PER_TOKEN = 2e-5  # 50,000 prompt tokens/s
TIMEOUT_S = 4.0  # LONG is about 2.3 s at the true rate: within 90% of it, less the 20% margin
TEXTS = [f"Passage {k} is about the river number {k} and the towns along it." for k in range(10)]
TRUTH = {t: float(k % 5) - 2.0 for k, t in enumerate(TEXTS)}
LONG = [f"{t} " + "lorem ipsum dolor sit amet " * 60 for t in TEXTS[:8]]
TRUTH.update({t: float(k % 4) for k, t in enumerate(LONG)})


def recency(slots: int) -> list[float]:
    return [1.0 + j for j in range(slots)]


def body(passages: list[str], k: int = 0, **extra: Any) -> dict[str, Any]:
    shift = k % len(passages)
    return {"query": f"which river is number {k}?", "passages": passages[shift:] + passages[:shift],
            **extra}  # fmt: skip


def slow_calls(meter: ThroughputMeter, rate: float, calls: int, *, before_s: float = 1.0) -> None:
    """Record ``calls`` completed calls at ``rate`` prompt tokens/s, ending ``before_s`` ago
    (what a busy neighbour or a throttled quota made the engine look like)."""
    t = time.monotonic() - before_s - calls
    for _ in range(calls):
        meter.begin(t)
        t += 1.0
        meter.end(t, int(rate))


# --- the meter and admission on their own ------------------------------------------------


def test_the_meter_says_what_its_rate_rests_on_and_old_measurements_fade() -> None:
    meter = ThroughputMeter()
    assert meter.calls(0.0) == 0 and meter.age_s(0.0) is None and not meter.confirmed(0.0)
    t = 1000.0
    for _ in range(MIN_CALLS):  # slow: 100 tokens/s, each call alone on the engine
        meter.begin(t)
        t += 1.0
        meter.end(t, 100)
    assert meter.calls(t) == MIN_CALLS and meter.age_s(t + 5) == pytest.approx(5.0)
    assert meter.confirmed(t)
    # Twenty minutes later one call at 1,000 tokens/s: the old ones weigh 1/16 each, so the
    # estimate follows the new call at once instead of creeping up (47 -> 68/s in the issue).
    later = t + 4 * WALL_HALF_LIFE_S
    meter.begin(later)
    meter.end(later + 1.0, 1000)
    rate = meter.tokens_per_s
    assert rate is not None and rate > 700
    # Those four are past FRESH_S: the rate rests on one call, not confirmed.
    assert later > t + FRESH_S
    assert meter.calls(later + 1.0) == 1 and not meter.confirmed(later + 1.0)


def test_a_newer_call_alone_on_the_engine_contradicts_a_confirmed_rate() -> None:
    meter = ThroughputMeter()
    t = 0.0
    for _ in range(2 * MIN_CALLS):
        meter.begin(t)
        t += 1.0
        meter.end(t, 100)
    assert meter.confirmed(t)
    meter.begin(t)  # a small call alone on the idle engine, 10x faster
    meter.end(t + 0.1, 100)
    assert meter.idle_rate == pytest.approx(1000.0)
    assert meter.best_rate(t + 0.1) == pytest.approx(1000.0)
    assert not meter.confirmed(t + 0.1)


def _admission(timeout_s: float = 10.0, *, rate_canary: bool = True) -> Admission:
    return Admission(
        Settings(request_timeout_s=timeout_s, rate_canary=rate_canary),
        ServiceMetrics(include_default_registry=False),
    )


def test_one_slow_first_measurement_never_refuses_for_good() -> None:
    # Issue 70: the first request behind a busy neighbour seeded 47 tokens/s, and every
    # 10-passage request after it was refused with 422, forever. Now: one call is not enough
    # to refuse for good; on an idle engine the request is admitted (and re-measures) where
    # only requests re-measure (no rate canary; with it, issue 77: 503 while it re-measures).
    admission = _admission(timeout_s=10.0, rate_canary=False)
    asked: list[str] = []
    admission.on_remeasure = lambda: asked.append(admission.remeasure_wanted or "")
    slow_calls(admission.meter, 47.0, 1)
    estimate = Estimate(prompts=20, prompt_tokens=14_000, new_tokens=0, param="passages")
    reservation = admission.reserve(estimate, Deadline.starting_now(10.0, "request_timeout_s"))
    assert reservation.estimated_s == pytest.approx(14_000 / 47, rel=0.01)  # 298 s: admitted
    assert asked == ["doubted"]
    # Behind it (the engine busy), the same request gets 503 + Retry-After, never 422.
    from serving.admission.errors import Overloaded

    with pytest.raises(Overloaded) as busy:
        admission.reserve(estimate, Deadline.starting_now(10.0, "request_timeout_s"))
    assert busy.value.retry_after_s is not None and busy.value.retry_after_s >= 1
    assert "not yet confirmed" in busy.value.message
    admission.release(reservation)


async def test_the_rate_canary_waits_for_the_engine_to_stay_idle() -> None:
    # A client sending one request after another (or a refused caller retrying) sends the
    # next within milliseconds: a canary started at the first idle instant had its forward
    # sit in front of that request. It starts only after _REMEASURE_IDLE_S of idleness.
    from serving.canaries import _idle_for

    admission = _admission()
    estimate = Estimate(prompts=2, prompt_tokens=100, new_tokens=0, param="passages")
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:

        async def traffic() -> None:
            await anyio.sleep(0.2)
            held = admission.reserve(estimate, None)
            await anyio.sleep(0.2)
            admission.release(held)

        tg.start_soon(traffic)
        await _idle_for(admission, 0.5)
    # Idle from 0 to 0.2 s (too short), busy to 0.4 s, then 0.5 s idle on end.
    assert time.monotonic() - t0 >= 0.9


# --- over HTTP ------------------------------------------------------------------------------


def engine() -> TrackingBackend:
    return TrackingBackend(TRUTH, bias=recency, noise=0.05, s_per_token=S_PER_TOKEN)


async def test_a_refusal_on_a_stale_slow_rate_heals_by_itself(tmp_path: Path) -> None:
    async with serving(
        tmp_path,
        backend=engine(),
        request_timeout_s=TIMEOUT_S,
        auto_cold_max_s=0.0,
        rate_canary=True,
    ) as h:
        meter = h.ctx.admission.meter
        # The rate canary's run at start first (it would contradict what follows).
        start = {"reason": "start", "outcome": "measured"}
        await wait_until(lambda: h.metric("rag_reorder_rate_probes_total", start) >= 1, 30)
        # A confirmed but wrong rate: four calls at 100 tokens/s (a hog beside the server).
        slow_calls(meter, 100.0, MIN_CALLS)
        assert meter.confirmed(time.monotonic())
        r = await h.client.post("/v1/reorder", json=body(LONG, strategy="moi"))
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "deadline_unreachable"
        assert "recent calls" in r.json()["error"]["message"]
        # The refusal asked for a re-measurement: the rate canary runs on the idle engine
        # (at most one every 10 s: the one at start was just now).
        labels = {"reason": "refused", "outcome": "measured"}
        await wait_until(lambda: h.metric("rag_reorder_rate_probes_total", labels) >= 1, 30)
        assert not meter.confirmed(time.monotonic())  # the fast canary contradicts it
        # The same request now fits and is answered.
        r = await h.client.post("/v1/reorder", json=body(LONG, strategy="moi"))
        assert r.status_code == 200, r.text
        cap = (await h.client.get("/info")).json()["capacity"]
        assert cap["calls"] >= 2 and cap["age_s"] is not None and cap["remeasure"] is None
        assert cap["best_tokens_per_s"] > 1000
        assert h.metric("rag_reorder_engine_rate_calls") == cap["calls"]


async def test_one_slow_first_call_admits_the_next_request_on_an_idle_engine(
    tmp_path: Path,
) -> None:
    # Twice TIMEOUT_S: the requests after the first run at the measured rate, and beside CI's
    # other lane (.ci/run, 2026-12-07) one part took 1.5 s against 0.7 s estimated and was
    # stopped early (503) with 2 s of a 4 s deadline left; the premise (a first estimate at
    # 20 tokens/s far over any deadline) holds at 8 s as at 4.
    async with serving(
        tmp_path, backend=engine(), request_timeout_s=2 * TIMEOUT_S, auto_cold_max_s=0.0
    ) as h:
        meter = h.ctx.admission.meter
        meter.completed = 0  # as if only the slow warm-up had measured
        slow_calls(meter, 20.0, 1)
        for k in range(3):  # every one admitted and answered: none refused for good
            r = await h.client.post("/v1/reorder", json=body(LONG, k, strategy="moi"))
            assert r.status_code == 200, r.text
        rate = meter.tokens_per_s
        assert rate is not None and rate > 1000
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "unreachable"}) == 0


async def test_a_canary_queued_behind_progressing_work_is_not_a_failure(tmp_path: Path) -> None:
    # Requests of about a second each, back to back from two clients, on a one-call-at-a-time
    # engine; the canary's deadline is 0.4 s and one failure would be fatal. It waits its
    # turn, times out, and is forgiven: calls completed meanwhile.
    backend = TrackingBackend(TRUTH)
    async with serving(
        tmp_path,
        backend=backend,
        canary_interval_s=0.05,
        canary_timeout_s=0.4,
        canary_failures_fatal=1,
        auto_cold_max_s=0.0,
        solver_processes=0,
    ) as h:
        backend.s_per_token = 2e-4  # after the warm-up, which has the canary's deadline
        end = time.monotonic() + 4.0

        async def client(k: int) -> None:
            while time.monotonic() < end:
                r = await h.client.post("/v1/reorder", json=body(TEXTS, k, strategy="moi"))
                assert r.status_code == 200, r.text
                k += 2

        async with anyio.create_task_group() as tg:
            tg.start_soon(client, 0)
            tg.start_soon(client, 1)
        assert h.ctx.lifecycle.alive, h.ctx.lifecycle.fatal
        assert h.metric("rag_reorder_canary_deferred_total") >= 1
        assert h.ctx.lifecycle.canary_failures == 0
        assert (await h.client.get("/health")).status_code == 200


async def test_a_hung_engine_still_fails_the_canary(tmp_path: Path) -> None:
    async with serving(
        tmp_path,
        canary_interval_s=0.05,
        canary_timeout_s=0.5,
        canary_failures_fatal=1,
        solver_processes=0,
    ) as h:
        h.backend.hang = True  # no call completes: not busy, dead
        await wait_until(lambda: not h.ctx.lifecycle.alive, timeout=5.0)
        assert (await h.client.get("/health")).status_code == 503


# --- auto's cold start ---------------------------------------------------------------------


def trusted(h: Harness) -> bool:
    return any(s.trusted for s in h.ctx.engine.learner.status())


async def test_a_cold_auto_answers_at_once_and_learns_in_the_background(tmp_path: Path) -> None:
    # MoI's learning run here is estimated above auto_cold_max_s (0.05 s): callers get the
    # retriever's order at once while the runs are scored in the idle time between them.
    async with serving(
        tmp_path,
        backend=engine(),
        auto_cold_max_s=0.05,
        auto_recalibrate_s=0.05,
        auto_explore_rate=0.0,
    ) as h:
        paths: list[str] = []
        for k in range(60):
            t = time.perf_counter()
            r = await h.client.post("/v1/reorder", json=body(TEXTS, k))
            assert r.status_code == 200, r.text
            auto = r.json()["auto"]
            paths.append(auto["path"])
            if auto["path"] == "cold":
                assert auto["ranker"] == "retriever" and r.json()["order"] == list(range(10))
                assert r.json()["usage"]["prompt_tokens"] == 0
                # prompt_tokens 0 says it waited for no scoring; the time only that nothing else
                # held it (2 s: beside another suite on 2 cores one took 1.07 s).
                assert time.perf_counter() - t < 2.0
            if auto["path"] == "profile":
                break
            # The engine idles between callers: the background run gets its turn.
            await wait_until(lambda: h.ctx.engine.learner.background_free, timeout=30)
            if h.ctx.engine.learner.counters.learning_runs["recorded"] >= 6:
                # Enough runs: the assessment (a thread at the lowest CPU priority, slow on
                # a busy machine) decides; the next request is placed by its profile.
                await wait_until(lambda: trusted(h), timeout=120)
        assert paths[0] == "cold" and paths[-1] == "profile", paths
        info = (await h.client.get("/info")).json()["auto"]
        assert info["background"]["learning"]["recorded"] >= 5
        assert h.metric("rag_reorder_auto_requests_total", {"path": "cold"}) >= 5
        assert (
            h.metric("rag_reorder_auto_background_learning_runs_total", {"outcome": "recorded"})
            == info["background"]["learning"]["recorded"]
        )


async def test_auto_keeps_serving_when_its_background_learning_fails(tmp_path: Path) -> None:
    backend = engine()
    backend.fail_rule = lambda p: "-explore" in p.request_id
    async with serving(
        tmp_path, backend=backend, auto_cold_max_s=0.05, auto_recalibrate_s=0.05
    ) as h:
        for k in range(6):
            r = await h.client.post("/v1/reorder", json=body(TEXTS, k))
            assert r.status_code == 200, r.text
            assert r.json()["auto"]["path"] == "cold"
            await wait_until(lambda: h.ctx.engine.learner.background_free, timeout=10)
        runs = h.ctx.engine.learner.counters.learning_runs
        assert runs["failed"] >= 5 and runs["recorded"] == 0, runs
        assert not trusted(h)


async def test_a_background_run_past_its_deadline_is_given_up(tmp_path: Path) -> None:
    backend = engine()
    async with serving(tmp_path, backend=backend, auto_cold_max_s=0.05, request_timeout_s=0.5) as h:
        r = await h.client.post("/v1/reorder", json=body(TEXTS))
        assert r.json()["auto"]["path"] == "cold" and r.json()["auto"]["recorded"]
        backend.hang = True
        await wait_until(lambda: h.ctx.engine.learner.counters.learning_runs["failed"] == 1)
        assert h.ctx.engine.learner.background_free
        backend.hang = False
        r = await h.client.post("/v1/reorder", json=body(TEXTS, 1))
        assert r.status_code == 200 and r.json()["auto"]["path"] == "cold"


# --- explore sized to what the engine runs ----------------------------------------------------


async def test_explore_is_drawn_only_while_the_engine_can_run_it(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path, auto_explore_rate=1.0)
    store = ProfileStore(settings.profiles_path)
    learner = ProfileLearner(settings, store, root=tmp_path / "auto")
    key = LearnKey("m", "qa_default", 5)
    # A trusted profile held in memory, as after an assessment.
    from service.learning.learner import KeyStatus
    from service.state.profile_store import ProfileTrust

    trust = ProfileTrust(
        verdict="shaped", reason="test", runs=5, flat_p=0.001, spread=1.0, spread_upper=1.2,
        stability=1.0, top_slots=(9, 8), placement_slots=10, resamples=100,
        covariance=tuple(tuple(0.0 for _ in range(5)) for _ in range(5)), assessed_at=0.0,
        source="traffic", learning_since=None, trusted_since=1.0,
    )  # fmt: skip
    stored = store.put(
        model="m", template="qa_default", coefficients=[0.1, 0.1, 0.2, 0.3, 0.3],
        identification="full", runs=5, prompts=100, r2=0.9, source="test", oriented_by="data",
        trust=trust,
    )  # fmt: skip
    learner._status[key] = KeyStatus(key, stored=stored, stamp=store.stamp("m", "qa_default", 5))
    async with anyio.create_task_group() as tg:
        tg.start_soon(learner.run_shadows)
        await wait_until(lambda: learner.background_free)
        gate = anyio.Event()

        async def run() -> tuple[np.ndarray, np.ndarray]:
            await gate.wait()
            raise RuntimeError("not needed")

        first = learner.decide("m", "qa_default", 10, None)
        assert first.path == "explore"
        assert learner.explore_later(first, run)
        # The engine is on that run: the next draws are served by the profile, not dropped.
        for _ in range(5):
            d: Decision = learner.decide("m", "qa_default", 10, None)
            assert d.path == "profile"
        assert learner.counters.explore_skipped == 5
        assert learner.counters.shadow_runs["dropped"] == 0
        gate.set()
        await wait_until(lambda: learner.background_free)
        assert learner.decide("m", "qa_default", 10, None).path == "explore"
        tg.cancel_scope.cancel()
    learner.close()


async def test_a_cold_request_while_the_engine_learns_is_still_served_at_once(
    tmp_path: Path,
) -> None:
    # The background slot holds the first request's learning run: the next caller is not
    # sent to MoI in its own time (the engine would then be its for tens of seconds on a
    # CPU), it is served cold, its run simply not queued.
    backend = engine()
    async with serving(tmp_path, backend=backend, auto_cold_max_s=0.05) as h:
        backend.hang = True  # the learning run holds the engine
        first = (await h.client.post("/v1/reorder", json=body(TEXTS, 0))).json()["auto"]
        assert first["path"] == "cold" and first["recorded"]
        await wait_until(lambda: not h.ctx.engine.learner.background_free)
        t = time.perf_counter()
        r = await h.client.post("/v1/reorder", json=body(TEXTS, 1))
        assert r.status_code == 200 and time.perf_counter() - t < 0.5
        assert r.json()["auto"]["path"] == "cold" and not r.json()["auto"]["recorded"]
        backend.hang = False


async def test_a_cold_request_is_placed_by_the_operators_calibration(tmp_path: Path) -> None:
    # A calibrated profile of this model and template for 8 slots (an operator's, oriented by
    # data): the prior a cold 10-passage request is placed by, resampled to its 10 slots.
    store = ProfileStore(Settings(cache_dir=tmp_path).profiles_path)
    calibrated = store.put(
        model="fake/known-truth", template="qa_default",
        coefficients=[c / 36.0 for c in recency(8)], identification="full", runs=50,
        prompts=800, r2=0.9, source="calibrated", oriented_by="data",
    )  # fmt: skip
    async with serving(tmp_path, backend=engine(), auto_cold_max_s=0.05) as h:
        scored = [{"text": t, "score": float(k)} for k, t in enumerate(TEXTS)]
        r = await h.client.post("/v1/reorder", json={"query": "which river?", "passages": scored})
        assert r.status_code == 200, r.text
        auto = r.json()["auto"]
        assert auto["path"] == "cold" and auto["ranker"] == "request_scores"
        assert auto["profile"] == calibrated.id and calibrated.id in auto["reason"]
        # Recency: the best-scored passage (9) goes last, the next (8) just before it.
        assert r.json()["order"][-2:] == [8, 9]
