"""The per-request work metrics the dashboard plots: fit quality, reordering, solver time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.metrics import ServiceMetrics
from service.backends.base import ScoreResult, SpanLogprobs, SpanRequest
from service.backends.scheduler import ForwardScheduler
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
