"""Fixtures: the metric names the service (and its vLLM engine) really expose."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from service.config.settings import Settings
from service.learning.learner import ProfileLearner
from service.learning.outcomes import OutcomeMonitor
from service.state.profile_store import ProfileStore
from service.state.traffic import TrafficSampler, TrafficSpool
from serving.metrics import ServiceMetrics
from tests.deploy import vllm_metrics

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
}


def service_metric_names() -> set[str]:
    """Series names /metrics can carry for the service's own registry (rag_reorder_*)."""
    metrics = ServiceMetrics(include_default_registry=False)
    metrics.track_traffic(TrafficSampler(0.0, 1))  # as create_app does
    settings = Settings(cache_dir=Path(tempfile.gettempdir()) / "rag-reorder-metric-names")
    metrics.track_auto(ProfileLearner(settings, ProfileStore(settings.profiles_path)))
    # As create_app does with the holdout on (the spool is not read while no key is known).
    spool = TrafficSpool(settings.profiles_path / "auto" / "outcomes", 100)
    metrics.track_outcomes(OutcomeMonitor(settings, spool))
    names = set()
    for family in metrics.registry.collect():
        suffixes = _SUFFIXES.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


@pytest.fixture(scope="session")
def exposed_metrics() -> set[str]:
    # vLLM's from the committed list (tests/deploy/vllm_metrics.py), checked against the
    # pinned vLLM by test_the_vllm_metric_list_is_the_pinned_vllms.
    return service_metric_names() | vllm_metrics.load()[1]
