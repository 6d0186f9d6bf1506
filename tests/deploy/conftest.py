"""Fixtures: the metric names the service (and its vLLM engine) really expose."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from app.metrics import ServiceMetrics
from tests.deploy.tools import ROOT, missing

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
}


def service_metric_names() -> set[str]:
    """Series names /metrics can carry for the service's own registry (rag_reorder_*)."""
    metrics = ServiceMetrics(include_default_registry=False)
    names = set()
    for family in metrics.registry.collect():
        suffixes = _SUFFIXES.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def vllm_metric_names() -> set[str]:
    """Series names of vLLM's own metrics, read from the vLLM the project tests against
    (.venv-vllm, built by scripts/vllm-venv.sh before the main test run)."""
    venv = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
    sources = sorted(venv.glob("lib/python3*/site-packages/vllm/v1/metrics/*.py"))
    if not sources:
        missing("the vLLM virtualenv (scripts/vllm-venv.sh)")
    bases = set()
    for source in sources:
        bases |= set(re.findall(r"[\"'](vllm:[a-z0-9_]+)[\"']", source.read_text()))
    every = ("", "_total", "_bucket", "_sum", "_count")
    return {base + suffix for base in bases for suffix in every}


@pytest.fixture(scope="session")
def exposed_metrics() -> set[str]:
    return service_metric_names() | vllm_metric_names()
