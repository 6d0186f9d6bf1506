"""Whole-request admission (issue 62): each strategy states its model calls before the first
one, admission checks the whole estimate at the measured prefill and decode rates, refuses at
once what cannot finish even on an idle engine (422 ``deadline_unreachable``) and keeps the
place of what it admitted.

The HTTP tests run the real app on the fake backend as an engine of fixed capacity
(``s_per_token`` for prefill, ``s_per_new_token`` for decode, one call at a time), so the
figures are known.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from service.config.settings import Settings
from service.errors import DeadlineUnreachable
from service.runtime.throughput import ThroughputMeter
from service.strategies.request import Estimate
from serving.admission.control import Admission, Reservation
from serving.admission.deadline import Deadline
from serving.admission.errors import Overloaded
from serving.metrics import ServiceMetrics
from tests.app.conftest import QUERY, Harness, TrackingBackend, measured, serving, wait_ready


def _measured(prefill: float, decode: float | None = None, timeout_s: float = 10.0) -> Admission:
    """An admission whose meter measured ``prefill`` prompt tokens/s (and ``decode`` answer
    tokens/s) from real calls."""
    admission = measured(prefill, timeout_s)
    meter = admission.meter
    if decode is not None:
        # Twice 1,000 prompt tokens (1000 / prefill s) then 100 answer tokens (100 / decode s).
        t = time.monotonic() - 1.0
        for _ in range(2):
            meter.begin(t)
            t += 1000 / prefill + 100 / decode
            meter.end(t, 1000, 100)
        assert meter.decode_tokens_per_s == pytest.approx(decode)
    return admission


def _estimate(prompt_tokens: int, new_tokens: int = 0, param: str = "passages") -> Estimate:
    return Estimate(prompts=10, prompt_tokens=prompt_tokens, new_tokens=new_tokens, param=param)


def test_decode_is_measured_apart_from_prefill() -> None:
    meter = ThroughputMeter()
    meter.begin(0.0)
    meter.end(2.0, 2000)  # prefill: 1,000 tokens/s
    meter.begin(2.0)
    # 500 prompt tokens (0.5 s at the prefill rate) and 64 answer tokens in 2.5 s: 2 s decode.
    meter.end(4.5, 500, 64)
    assert meter.tokens_per_s == pytest.approx(1000.0)
    assert meter.decode_tokens_per_s == pytest.approx(32.0)
    assert meter.seconds_for(1000, 64) == pytest.approx(1.0 + 2.0)
    # A generation before any prefill rate cannot be split: it adds to neither.
    fresh = ThroughputMeter()
    fresh.begin(0.0)
    fresh.end(1.0, 500, 64)
    assert fresh.tokens_per_s is None and fresh.decode_tokens_per_s is None


def test_work_over_the_deadline_on_an_idle_engine_is_refused_with_the_estimate() -> None:
    admission = _measured(1000.0, decode=20.0, timeout_s=10.0)
    deadline = Deadline.starting_now(10.0, "request_timeout_s")
    # 5,000 prompt tokens (5 s) + 200 answer tokens (10 s): 15 s > 7.5 s (9 s usable, less the
    # 20% margin for the estimate's own error).
    with pytest.raises(DeadlineUnreachable) as refused:
        admission.reserve(_estimate(5000, 200, "samples"), deadline)
    err = refused.value
    assert err.param == "samples" and err.code == "deadline_unreachable"
    assert err.value == pytest.approx(15.0) and err.limit == pytest.approx(7.5)
    for part in ("15.0 s", "5000 prompt tokens", "200 answer tokens", "request_timeout_s", "50%"):
        assert part in err.message, err.message
    assert admission.tokens_in_flight == 0
    # Counted as prompt tokens (as before the decode rate), it would have looked like 4.2 s.
    fits = admission.reserve(_estimate(4000, 60), deadline)  # 4 + 3 s
    assert fits.estimated_s == pytest.approx(7.0)
    admission.release(fits)
    assert admission.tokens_in_flight == 0


def test_a_rate_from_the_warm_up_seed_alone_never_refuses_for_good() -> None:
    # Without the rate canary only requests re-measure: admitted on the idle engine.
    admission = Admission(
        Settings(request_timeout_s=10.0, rate_canary=False),
        ServiceMetrics(include_default_registry=False),
    )
    admission.seed(100, 1.0)  # a tiny probe: 100 tokens/s, far below the engine's real rate
    # 50 s by the seed: admitted, the engine is idle
    reservation = admission.reserve(
        _estimate(5000), Deadline.starting_now(10.0, "request_timeout_s")
    )
    assert reservation.estimated_s == pytest.approx(50.0)
    admission.release(reservation)
    # With it (the default), 503 + Retry-After while it re-measures: never a 422.
    canary = Admission(
        Settings(request_timeout_s=10.0), ServiceMetrics(include_default_registry=False)
    )
    canary.seed(100, 1.0)
    with pytest.raises(Overloaded) as busy:
        canary.reserve(_estimate(5000), Deadline.starting_now(10.0, "request_timeout_s"))
    assert busy.value.retry_after_s is not None and canary.remeasure_wanted == "doubted"


def test_a_reserved_request_keeps_its_place_and_newer_arrivals_queue_behind_it() -> None:
    admission = _measured(1000.0, timeout_s=10.0)
    deadline = Deadline.starting_now(10.0, "request_timeout_s")
    first = admission.reserve(_estimate(6000), deadline)  # 6 s, idle: in
    # Before its first call, its tokens are in flight: a newer 4 s request would end at 10 s.
    assert admission.tokens_in_flight == 6000
    assert admission.estimated_wait_s == pytest.approx(6.0)
    with pytest.raises(Overloaded) as shed:
        admission.reserve(_estimate(4000), deadline)
    assert shed.value.retry_after_s is not None
    # Its own calls are not checked again, even with the deadline almost gone: they draw on
    # the reservation, which shrinks by what they take.
    almost_gone = Deadline(time.monotonic() + 0.01, 10.0, "request_timeout_s")
    with admission.tokens(2500, almost_gone, reservation=first):
        assert first.tokens == 3500
        assert admission.tokens_in_flight == 6000
    assert admission.tokens_in_flight == 3500
    # A call larger than what is left takes the rest; the excess is held while it runs.
    with admission.tokens(4000, almost_gone, reservation=first):
        assert first.tokens == 0 and admission.tokens_in_flight == 4000
    admission.release(first)
    assert admission.tokens_in_flight == 0


def test_release_gives_back_what_the_calls_did_not_take() -> None:
    admission = _measured(1000.0)
    reservation = admission.reserve(_estimate(3000, 100), None)
    assert isinstance(reservation, Reservation)
    assert admission.tokens_in_flight == 3100
    with admission.tokens(1000, None, reservation=reservation):
        pass
    admission.release(reservation)
    admission.release(reservation)  # idempotent
    assert admission.tokens_in_flight == 0 and admission.estimated_wait_s == 0.0


# ---------------------------------------------------------------------------------------------
# Over HTTP: each strategy that calls the model, small (fits) then large (refused at once).

S_PER_TOKEN = 1e-4  # prefill: 10,000 tokens/s
S_PER_NEW_TOKEN = 5e-3  # decode: 200 answer tokens/s, 50x slower per token
TIMEOUT_S = 3.0

_WORD = "lorem ipsum dolor sit amet "
SHORT = [f"Passage number {i} says {_WORD * 8}".strip() for i in range(4)]
# Eight of them fill most of the fake model's 32,768-token context.
LONG = [f"Long passage number {i} says {_WORD * 140}".strip() for i in range(8)]
TRUTH = {t: float(i % 5) for i, t in enumerate(SHORT + LONG)}

# strategy -> (options): the small request (4 short passages) takes a fraction of the deadline;
# the large one (8 long passages) is estimated over it. ``min_distraction`` is
# left out: without a stored positional profile it is refused before any model call.
CASES: dict[str, dict[str, Any]] = {
    "moi": {},
    "auto": {},
    "query_likelihood": {"samples": 4},
    "convex_score": {},
    "query_generation": {},
    "bayes_saliency": {},
    "longllmlingua": {},
    "lore": {"max_answer_tokens": 8},
    "self_consistency": {"samples": 4, "max_answer_tokens": 8},
}


def _body(strategy: str, passages: list[str], options: dict[str, Any]) -> dict[str, Any]:
    return {"query": QUERY, "passages": passages, "strategy": strategy, **options}


async def _measure_prefill(h: Harness) -> None:
    """Scored requests first: admission refuses for good only on rates confirmed by several
    recent real calls of each kind (prefill by scored calls, decode by generations)."""
    for _ in range(8):
        r = await h.client.post("/v1/reorder", json=_body("moi", SHORT, {}))
        assert r.status_code == 200, r.text
        if h.ctx.admission.meter.confirmed(time.monotonic()):
            return
    raise AssertionError("the prefill rate was not confirmed after 8 requests")


@pytest.mark.parametrize("strategy", list(CASES))
async def test_each_strategy_fits_when_small_and_is_refused_at_once_when_it_cannot(
    tmp_path: Path, strategy: str
) -> None:
    options = CASES[strategy]
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN, s_per_new_token=S_PER_NEW_TOKEN)
    async with serving(tmp_path, backend=backend, request_timeout_s=TIMEOUT_S) as h:
        await _measure_prefill(h)
        for _ in range(2 if "max_answer_tokens" in options else 1):  # decode measured twice
            ok = await h.client.post("/v1/reorder", json=_body(strategy, SHORT, options))
            assert ok.status_code == 200, ok.text
        if strategy == "auto":
            assert ok.json()["auto"]["path"] == "moi"  # no profile yet: MoI, admitted whole
        timing = ok.json()["timing"]
        # Roughly what the calls took: the rates so far are the warm-up probe's (and, for a
        # first generation, no decode rate yet).
        assert timing["scoring_s"] / 3 < timing["estimated_s"] < 3 * timing["scoring_s"] + 0.1
        calls = backend.stats.score_calls + backend.stats.generate_calls

        t = time.perf_counter()
        r = await h.client.post("/v1/reorder", json=_body(strategy, LONG, options))
        elapsed = time.perf_counter() - t
        if strategy == "auto":
            # Learning, and MoI over auto_cold_max_s: served at once in the retriever's
            # order, its MoI run learned from in the background (issue 70), never a 422.
            assert r.status_code == 200, r.text
            assert r.json()["auto"]["path"] == "cold" and r.json()["auto"]["recorded"]
            assert elapsed < 1.0
            assert backend.stats.score_calls + backend.stats.generate_calls == calls
            return
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "deadline_unreachable", err
        assert err["value"] > err["limit"] == pytest.approx(0.9 * TIMEOUT_S / 1.2)
        assert "estimated at" in err["message"] and "request_timeout_s" in err["message"]
        assert elapsed < 1.0
        # Refused before any model call, nothing left reserved.
        assert backend.stats.score_calls + backend.stats.generate_calls == calls
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "unreachable"}) == 1
        assert h.ctx.admission.tokens_in_flight == 0


async def test_a_long_answer_budget_is_refused_by_the_measured_decode_rate(tmp_path: Path) -> None:
    # 4 x 256 answer tokens take 5 s at 200/s; counted as prompt tokens, as before issue 62,
    # they looked like 0.1 s, and the request was admitted to a 504.
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN, s_per_new_token=S_PER_NEW_TOKEN)
    async with serving(tmp_path, backend=backend, request_timeout_s=TIMEOUT_S) as h:
        await _measure_prefill(h)
        for _ in range(2):  # decode is confirmed by two generations
            first = await h.client.post("/v1/reorder", json=_body("lore", SHORT, CASES["lore"]))
            assert first.status_code == 200, first.text
        assert h.ctx.admission.meter.decode_tokens_per_s == pytest.approx(200, rel=0.3)
        r = await h.client.post(
            "/v1/reorder", json=_body("lore", SHORT, {"max_answer_tokens": 256})
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "deadline_unreachable" and err["param"] == "passages"
        assert err["value"] == pytest.approx(4 * 256 / 200, rel=0.3)
        assert "1024 answer tokens" in err["message"]
        # A budget that fits is answered.
        fits = await h.client.post(
            "/v1/reorder", json=_body("lore", SHORT, {"max_answer_tokens": 64})
        )
        assert fits.status_code == 200, fits.text


# ---------------------------------------------------------------------------------------------
# No 504 for admitted work (issue 77): rates measured before ready, no admission on a doubt
# that cannot fit even at the engine's best, and a long request stopped early by its own pace.


def test_work_over_its_deadline_even_at_the_best_rate_is_not_admitted_on_a_doubt() -> None:
    admission = measured(100.0, timeout_s=10.0)  # confirmed at 100 prompt tokens/s
    meter = admission.meter
    t = time.monotonic() - 0.5
    meter.begin(t)
    meter.end(t + 0.1, 100)  # a newer call alone on the engine at 1,000/s contradicts it
    now = time.monotonic()
    assert not meter.confirmed(now) and meter.best_rate(now) == pytest.approx(1000.0)
    deadline = Deadline(now + 10.0, 10.0, "request_timeout_s")
    # 5,000 tokens: over the deadline at the estimate, 5 s at the best rate: the doubt may be
    # the estimate's, so it is admitted on the idle engine (its calls re-measure).
    fits = admission.reserve(_estimate(5000), deadline)
    admission.release(fits)
    # 20,000 tokens: 20 s even at the best rate. Admitted, it ran into a 504; now 503 at
    # once, nothing reserved, the canary asked to re-measure, and never a 422 on a doubt.
    admission.remeasure_s = 3.2
    with pytest.raises(Overloaded) as refused:
        admission.reserve(_estimate(20_000), deadline)
    assert refused.value.retry_after_s == 4  # the queue (none) and the canary's 3.2 s
    assert "re-measured" in refused.value.message and "20.0 s even at" in refused.value.message
    assert admission.tokens_in_flight == 0 and admission.remeasure_wanted == "doubted"


async def test_both_rates_are_measured_before_ready_and_price_the_first_generation(
    tmp_path: Path,
) -> None:
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN, s_per_new_token=S_PER_NEW_TOKEN)
    async with serving(
        tmp_path, backend=backend, request_timeout_s=TIMEOUT_S, rate_canary=True, ready=False
    ) as h:
        await wait_ready(h.client, timeout=60)  # the canary adds about 1.5 s to the warm-up
        # At ready, the rate canary has scored and generated on this engine: the decode rate
        # is this engine's, not the prior (before, it ran after ready and only scored, and
        # the first request preempted it).
        cap = (await h.client.get("/info")).json()["capacity"]
        start = {"reason": "start", "outcome": "measured"}
        assert h.metric("rag_reorder_rate_probes_total", start) == 1
        assert cap["decode_tokens_per_s"] == pytest.approx(1 / S_PER_NEW_TOKEN, rel=0.3)
        assert cap["prefill_tokens_per_s"] > 0.3 / S_PER_TOKEN
        metrics = (await h.client.get("/metrics")).text
        assert "rag_reorder_engine_decode_tokens_per_second 0.0" not in metrics
        # The first generating request: 4 x 512 answer tokens, 10 s at this engine's decode,
        # over twice the 2.7 s its deadline allows. Priced by the prior (8 prompt tokens an
        # answer token) it looked like 1.7 s and was admitted to a 504; now it is refused at
        # once (503 while the rate is not yet confirmed by enough calls).
        t = time.perf_counter()
        r = await h.client.post(
            "/v1/reorder", json=_body("lore", SHORT, {"max_answer_tokens": 512})
        )
        assert r.status_code == 503, r.text
        assert time.perf_counter() - t < 2.0  # milliseconds when the machine is not loaded
        assert "even at the fastest rate" in r.json()["error"]["message"]
        assert "Retry-After" in r.headers
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "deadline"}) == 1
        # One that fits is answered, its estimate within 2x of what it took.
        ok = await h.client.post(
            "/v1/reorder", json=_body("lore", SHORT, {"max_answer_tokens": 64})
        )
        assert ok.status_code == 200, ok.text
        timing = ok.json()["timing"]
        assert 0.5 < timing["estimated_s"] / timing["scoring_s"] < 2.0, timing


async def test_a_long_request_that_its_own_pace_shows_will_miss_is_stopped_early(
    tmp_path: Path,
) -> None:
    timeout_s = 6.0  # twice the others': a loaded test machine must not eat the margin
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN, s_per_new_token=S_PER_NEW_TOKEN)
    body = _body("self_consistency", SHORT, {"samples": 24, "max_answer_tokens": 8})
    async with serving(tmp_path, backend=backend, request_timeout_s=timeout_s) as h:
        await _measure_prefill(h)
        for _ in range(2):
            assert (await h.client.post("/v1/reorder", json=_body("lore", SHORT, {}))).is_success
        # Estimated at about half its deadline: sent in parts of a fifth of it, answered.
        calls = backend.stats.generate_calls
        ok = await h.client.post("/v1/reorder", json=body)
        assert ok.status_code == 200, ok.text
        assert backend.stats.generate_calls - calls >= 2
        timing = ok.json()["timing"]
        assert 0.5 < timing["estimated_s"] / timing["scoring_s"] < 2, timing
        # A busy neighbour arrives: the engine runs 3x slower than its measured rates. The
        # same request was admitted and cancelled at its deadline, a 504 after 6 s; now its
        # first part (a fifth of the deadline at the measured rates, about 3.6 s at this
        # pace) shows it will miss, and it is told then, 503 with Retry-After.
        backend.s_per_token *= 3
        backend.s_per_new_token *= 3
        t = time.perf_counter()
        r = await h.client.post("/v1/reorder", json=body)
        elapsed = time.perf_counter() - t
        assert r.status_code == 503, r.text
        assert "stopped early" in r.json()["error"]["message"] and "Retry-After" in r.headers
        assert elapsed < timeout_s
        assert h.metric("rag_reorder_admission_rejections_total", {"reason": "progress"}) == 1
        assert h.ctx.admission.tokens_in_flight == 0


async def test_a_504_says_what_admission_expected_of_the_request(tmp_path: Path) -> None:
    # A 504 of admitted work is an estimate that was wrong: its message says which estimate
    # (the benchmark's 504 rows had none to compare).
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN)
    async with serving(tmp_path, backend=backend, request_timeout_s=1.0) as h:
        ok = await h.client.post("/v1/reorder", json=_body("moi", SHORT, {}))
        assert ok.status_code == 200, ok.text
        backend.hang = True  # the engine stops answering: the request runs into its deadline
        r = await h.client.post("/v1/reorder", json=_body("moi", SHORT, {}))
        assert r.status_code == 504, r.text
        assert "admission estimated its model calls at" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------
# "Never" is not "retry" (issue 90 item 11).


def test_work_over_its_deadline_by_more_than_any_rate_error_is_refused_at_once() -> None:
    """A moi request estimated at 3,956,961 s against a 108 s deadline got 503 "rate not yet
    confirmed ... retry after 22 s" at every retry. No error in a rate explains an estimate
    36,000x over: a 422 at once, on an unconfirmed rate too, with the figures."""
    admission = Admission(
        Settings(request_timeout_s=108.0), ServiceMetrics(include_default_registry=False)
    )
    admission.seed(100, 1.0)  # the warm-up probe alone: not confirmed
    now = time.monotonic()
    assert not admission.meter.confirmed(now)
    huge = _estimate(4_000_000, param="design.num_prompts")  # 40,000 s at 100 tokens/s
    for _ in range(3):  # every retry the same answer, none a 503
        with pytest.raises(DeadlineUnreachable) as refused:
            admission.reserve(huge, Deadline.starting_now(108.0, "request_timeout_s"))
        err = refused.value
        assert err.param == "design.num_prompts" and err.value == pytest.approx(40_000.0)
        assert err.limit == pytest.approx(0.9 * 108.0 / 1.2)
        for part in ("40000 s", "494x", "100x the fastest rate", "400.0 s", "request_timeout_s"):
            assert part in err.message, err.message
    assert admission.tokens_in_flight == 0
    # Within the bound the rate may be what is wrong: a doubt, as before (503 while the
    # canary re-measures): 100,000 tokens is 1,000 s at the seed, 10 s at 100x it.
    with pytest.raises(Overloaded):
        admission.reserve(_estimate(100_000), Deadline.starting_now(108.0, "request_timeout_s"))


def test_a_re_measurement_asked_for_stays_wanted_until_the_rate_is_confirmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rate canary is one of the recent calls a confirmation needs: the ask was cleared
    by the first, and the caller told to retry was refused on the same unconfirmed rate
    (3 calls in the last 300 s at the third retry). Now the ask holds until the rate is
    confirmed, and for at most FRESH_S."""
    from service.runtime.throughput import FRESH_S

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    admission = Admission(
        Settings(request_timeout_s=10.0), ServiceMetrics(include_default_registry=False)
    )
    admission.seed(100, 1.0)
    with pytest.raises(Overloaded) as refused:
        admission.reserve(_estimate(5000), Deadline(clock[0] + 10.0, 10.0, "request_timeout_s"))
    assert "not confirmed: 1 of the 4 recent calls it needs" in refused.value.message
    assert admission.remeasure_wanted == "doubted"
    wanted_after: list[str | None] = []
    for _ in range(10):
        clock[0] += 11.0  # the canary loop's spacing
        with admission.measured(500):  # a canary: 500 prompt tokens in 1 s, alone
            clock[0] += 1.0
        admission.remeasure_wanted = None  # what the canary loop does once it has measured
        wanted_after.append(admission.remeasure_wanted)
        if admission.meter.confirmed(clock[0]):
            break
    assert admission.meter.confirmed(clock[0])
    assert wanted_after[:-1] and all(w == "unconfirmed" for w in wanted_after[:-1])
    assert wanted_after[-1] is None
    # Never confirmed (no canary can run): the ask lapses after FRESH_S, not at once.
    other = Admission(
        Settings(request_timeout_s=10.0), ServiceMetrics(include_default_registry=False)
    )
    other.seed(100, 1.0)
    other.remeasure("doubted")
    other.remeasure_wanted = None
    assert other.remeasure_wanted == "unconfirmed"
    clock[0] += FRESH_S + 1.0
    assert other.remeasure_wanted is None


async def test_work_admitted_to_re_measure_is_answered_for_good_by_its_own_pace(
    tmp_path: Path,
) -> None:
    """A self_consistency request on a freshly started server got 503 after 26 s of work,
    and its retry was refused at once. Work admitted over its deadline on a rate in doubt
    (the warm-up probe's alone) is the re-measurement; once its own parts show it cannot
    finish, the answer is a 422 with the figures, not a 503 to retry."""
    timeout_s = 6.0
    backend = TrackingBackend(TRUTH, s_per_token=S_PER_TOKEN, s_per_new_token=S_PER_NEW_TOKEN)
    async with serving(tmp_path, backend=backend, request_timeout_s=timeout_s, ready=False) as h:
        await wait_ready(h.client, timeout=60)
        meter = h.ctx.admission.meter
        assert not meter.confirmed(time.monotonic())  # only the warm-up probe so far
        body = _body("moi", LONG, {})
        # The engine is 3x slower than its probe showed (a cold start, a busy neighbour).
        backend.s_per_token *= 3
        backend.s_per_new_token *= 3
        t = time.perf_counter()
        r = await h.client.post("/v1/reorder", json=body)
        elapsed = time.perf_counter() - t
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "deadline_unreachable" and err["param"] == "design.num_prompts", err
        assert "admitted on an idle engine to re-measure" in err["message"]
        assert "the rate is now" in err["message"]
        assert "Retry-After" not in r.headers and elapsed < timeout_s
        assert h.ctx.admission.tokens_in_flight == 0


def test_the_plausibility_bound_holds_with_several_workers() -> None:
    """With ``workers`` > 1 each worker's admission reads the engine process's meter
    (``EngineMeter``, updated from its ``vars``): the fastest rate shown travels with it, and
    a worker refuses the same work at once, though its own copy measured nothing."""
    from service.backends.engines.engine_socket import EngineMeter

    engine = ThroughputMeter()
    engine.seed(100, 1.0, time.monotonic())
    worker_meter = EngineMeter()
    worker_meter.update(dict(vars(engine)))
    assert worker_meter.least_seconds_for(4_000_000) == pytest.approx(400.0)
    worker = Admission(
        Settings(request_timeout_s=108.0, workers=2),
        ServiceMetrics(include_default_registry=False),
        meter=worker_meter,
    )
    with pytest.raises(DeadlineUnreachable, match="100x the fastest rate"):
        worker.reserve(_estimate(4_000_000), Deadline.starting_now(108.0, "request_timeout_s"))
