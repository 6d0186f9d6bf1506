"""The per-request work metrics the dashboard plots: fit quality, reordering, solver time; and
the scrape-time collectors' counters summed over several workers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from service.backends.base import ScoreResult, SpanLogprobs, SpanRequest
from service.backends.scheduling.scheduler import ForwardScheduler
from service.learning.generator_online import GeneratorCounters
from service.learning.learner import LearnerCounters
from serving import metrics as metrics_module
from serving.metrics import ServiceMetrics
from tests.app.conftest import PASSAGES, QUERY, serving


async def test_a_moi_request_records_its_fit_and_a_retriever_request_none(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path) as h:
        r = await h.client.post(
            "/v1/reorder", json={"query": QUERY, "passages": PASSAGES, "strategy": "moi"}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        r2 = body["diagnostics"]["r2"]
        assert r2 is not None and 0.0 <= r2 <= 1.0
        assert h.metric("rag_reorder_fit_r2_count") == 1
        assert h.metric("rag_reorder_fit_r2_sum") == pytest.approx(r2)
        assert h.metric("rag_reorder_solver_duration_seconds_count") == 1
        # The fake backend's truth puts the second passage first: the order changed.
        assert body["order"] != list(range(len(PASSAGES)))
        assert h.metric("rag_reorder_order_changed_total", {"strategy": "moi"}) == 1

        r = await h.client.post(
            "/v1/reorder", json={"query": QUERY, "passages": PASSAGES, "strategy": "retriever"}
        )
        assert r.status_code == 200, r.text
        assert h.metric("rag_reorder_fit_r2_count") == 1
        assert h.metric("rag_reorder_solver_duration_seconds_count") == 1
        assert h.metric("rag_reorder_strategy_requests_total", {"strategy": "retriever"}) == 1
        assert h.metric("rag_reorder_order_changed_total", {"strategy": "retriever"}) == 0


def _result(r2: float | None, order: list[int]) -> Any:
    # Only the fields ServiceMetrics.observe reads.
    usage = SimpleNamespace(prompt_tokens=10, scored_tokens=4, prompts_failed=0, generated_tokens=0)
    return SimpleNamespace(
        prompts=2,
        usage=usage,
        timing=SimpleNamespace(scoring_s=0.5, solver_s=0.001),
        strategy="moi",
        order=order,
        fit=SimpleNamespace(r2=r2),
    )


@pytest.mark.parametrize("r2", [None, float("nan"), float("inf")])
def test_an_unestimated_r2_is_not_observed(r2: float | None) -> None:
    metrics = ServiceMetrics(include_default_registry=False)
    metrics.observe(_result(r2, [0, 1]))
    get = metrics.registry.get_sample_value
    assert get("rag_reorder_fit_r2_count") == 0
    assert get("rag_reorder_solver_duration_seconds_count") == 1
    assert get("rag_reorder_order_changed_total", {"strategy": "moi"}) is None


def test_r2_lands_in_its_bucket() -> None:
    metrics = ServiceMetrics(include_default_registry=False)
    metrics.observe(_result(0.93, [1, 0]))
    get = metrics.registry.get_sample_value
    assert get("rag_reorder_fit_r2_bucket", {"le": "0.9"}) == 0
    assert get("rag_reorder_fit_r2_bucket", {"le": "0.95"}) == 1
    assert get("rag_reorder_order_changed_total", {"strategy": "moi"}) == 1


async def test_the_scheduler_metrics_follow_its_forwards() -> None:
    async def forward(batch: list[SpanRequest]) -> list[ScoreResult]:
        return [SpanLogprobs(r.request_id, (-1.0,)) for r in batch]

    scheduler = ForwardScheduler(forward, token_budget=100, row_budget=99, head_mode="mask")
    metrics = ServiceMetrics(include_default_registry=False)
    metrics.track_scheduler(scheduler)
    reqs = [SpanRequest(str(i), tuple(range(20)), 1, 2) for i in range(7)]
    await scheduler.score(reqs)

    def value(name: str, **labels: str) -> float:
        sample = metrics.registry.get_sample_value(name, labels)
        assert sample is not None, name
        return sample

    # 7 prompts of 20 tokens under 100 padded tokens: forwards of 5 and 2.
    assert value("rag_reorder_batch_fill_ratio_count") == 2
    assert value("rag_reorder_batch_fill_ratio_sum") == pytest.approx(1.0 + 0.4)
    assert value("rag_reorder_batch_wait_seconds_count") == 7
    assert value("rag_reorder_batch_requests_bucket", le="1.0") == 2
    assert value("rag_reorder_batch_queue_prompts") == 0


class _Worker:
    """One simulated worker process of ``entrypoints.workers``: its own pid in the shared metrics
    folder, its learner's, generator sampler's and state store's in-memory totals (only what
    the metrics read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
        # prometheus_client picks the file of a value by the pid when the value is made:
        # every value this worker's metrics make is made here, under its pid.
        value_class = values.MultiProcessValue(lambda: pid)  # type: ignore[no-untyped-call]
        monkeypatch.setattr(values, "ValueClass", value_class)
        self.learner = SimpleNamespace(counters=LearnerCounters(), status=list)
        self.generator = SimpleNamespace(counters=GeneratorCounters(), calls=0, status=list)
        self.state = SimpleNamespace(
            up=True, pending=0, dropped=0, failures={"read": 0, "write": 0, "lock": 0}
        )
        self.metrics = ServiceMetrics(include_default_registry=False)
        self.metrics.track_auto(self.learner)  # type: ignore[arg-type]
        self.metrics.track_generator(self.generator)  # type: ignore[arg-type]
        self.metrics.track_state(self.state)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """This worker's /metrics body, parsed: value by (sample name, labels)."""
        body, _ = self.metrics.render("text/plain")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }


def test_every_workers_scrape_time_counters_are_summed_in_any_workers_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    a, b = _Worker(monkeypatch, 101), _Worker(monkeypatch, 102)
    a.learner.counters.paths["profile"] += 3
    a.learner.counters.drift_events += 1
    a.state.failures["write"] += 2
    b.learner.counters.paths["profile"] += 1
    b.learner.counters.paths["moi"] += 2
    b.learner.counters.drift_events += 1
    b.state.failures["write"] += 1
    b.state.dropped += 4
    b.state.up = False
    a.generator.calls, b.generator.calls = 5, 2
    b.generator.counters.answers["contained"] += 1
    b.metrics.sync_counters()  # b's periodic write (sync_forever); a's own scrape writes a's
    for scrape in (a.scrape(), b.scrape()):
        assert scrape["rag_reorder_auto_requests_total", (("path", "profile"),)] == 4
        assert scrape["rag_reorder_auto_requests_total", (("path", "moi"),)] == 2
        assert scrape["rag_reorder_auto_requests_total", (("path", "cold"),)] == 0
        assert scrape["rag_reorder_auto_drift_events_total", ()] == 2
        assert scrape["rag_reorder_state_store_failures_total", (("operation", "write"),)] == 3
        assert scrape["rag_reorder_state_store_dropped_writes_total", ()] == 4
        assert scrape["rag_reorder_generator_calls_total", ()] == 7
        assert scrape["rag_reorder_generator_answers_total", (("attribution", "contained"),)] == 1
    # Gauges are the scraping worker's own.
    assert a.scrape()["rag_reorder_state_store_up", ()] == 1
    assert b.scrape()["rag_reorder_state_store_up", ()] == 0

    # a dies (its file stays); its successor counts from 0 in a file of its own: the sums
    # never go back, and grow by what the successor counts.
    c = _Worker(monkeypatch, 103)
    c.learner.counters.paths["profile"] += 1
    for scrape in (c.scrape(), b.scrape()):
        assert scrape["rag_reorder_auto_requests_total", (("path", "profile"),)] == 5
        assert scrape["rag_reorder_auto_drift_events_total", ()] == 2
        assert scrape["rag_reorder_state_store_failures_total", (("operation", "write"),)] == 3


async def test_a_worker_writes_its_counters_without_being_scraped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics_module, "MIRROR_S", 0.01)
    a, b = _Worker(monkeypatch, 201), _Worker(monkeypatch, 202)
    task = asyncio.create_task(b.metrics.sync_forever())
    b.learner.counters.recalibrations["trusted"] += 2
    await asyncio.sleep(0.1)
    assert a.scrape()["rag_reorder_auto_recalibrations_total", (("outcome", "trusted"),)] == 2
    b.learner.counters.drift_events += 1
    task.cancel()  # a draining worker writes its last counts
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.scrape()["rag_reorder_auto_drift_events_total", ()] == 1


async def test_one_process_has_nothing_to_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = ServiceMetrics(include_default_registry=False)
    learner = SimpleNamespace(counters=LearnerCounters(), status=list)
    metrics.track_auto(learner)  # type: ignore[arg-type]
    learner.counters.drift_events += 1
    await asyncio.wait_for(metrics.sync_forever(), 1)  # returns at once
    assert metrics.registry.get_sample_value("rag_reorder_auto_drift_events_total") == 1
