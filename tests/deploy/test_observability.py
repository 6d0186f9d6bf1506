"""docker/: the Compose files, Prometheus' scrape config, Grafana's provisioning, the dashboard.

Compose files validate against the compose-spec JSON schema (the copy check-jsonschema ships);
the dashboard against a schema of Grafana's model, and every query parses with Prometheus' own
grammar and names only metrics the service (or its vLLM engine) really registers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.checks import CLOSE_MARGIN_S, duration_seconds
from tests.deploy.tools import CHART, DOCKER, ROOT, SCHEMAS, promql_parse, run, tool

COMPOSE = DOCKER / "compose.yaml"
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))
DASHBOARD = CHART / "dashboards" / "rag-reorder.json"
SERVICE = "rag-reorder"
CONTAINER_PORT = 8000
# Grafana variables, replaced by values of the same syntax before parsing.
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$job": ".*"}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose_errors(path: Path) -> str:
    """check-jsonschema with its vendored compose-spec schema; '' when valid."""
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])
    return "" if proc.returncode == 0 else proc.stdout + proc.stderr


# --- Compose ---------------------------------------------------------------------------------


def test_there_are_the_six_compose_files() -> None:
    assert [p.name for p in COMPOSE_FILES] == [
        "compose.admin-key.yaml",
        "compose.api-key.yaml",
        "compose.gpu.yaml",
        "compose.redis.yaml",
        "compose.remote.yaml",
        "compose.yaml",
    ]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec(path: Path) -> None:
    assert compose_errors(path) == ""


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c["services"][SERVICE].__setitem__("stop_grace_perod", "45s"),
        lambda c: c["services"][SERVICE].__setitem__("ports", 8000),
        lambda c: c["services"]["grafana"].__setitem__("depends_on", {"prometheus": {}}),
    ],
    ids=["misspelt key", "ports not a list", "depends_on without condition"],
)
def test_the_compose_schema_catches_an_invalid_file(tmp_path: Path, breakage: Any) -> None:
    compose = load(COMPOSE)
    breakage(compose)
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    assert compose_errors(broken) != ""


def test_the_service_drains_before_compose_kills_it() -> None:
    for path in (COMPOSE, DOCKER / "compose.gpu.yaml"):
        service = load(path)["services"][SERVICE]
        drain = float(service["environment"]["RAG_REORDER_DRAIN_TIMEOUT_S"])
        grace = duration_seconds(service["stop_grace_period"])
        assert drain + CLOSE_MARGIN_S <= grace, (
            f"{path.name}: drain {drain} s, stop_grace_period {grace} s"
        )


def test_compose_builds_the_dockerfile_targets() -> None:
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    # One version for server and client: the client package's VERSION file (pyproject.toml).
    version = re.search(r"^(\S+)$", (ROOT / "clients/python/rag_reorder/VERSION").read_text(), re.M)
    assert version
    cpu = load(COMPOSE)["services"][SERVICE]
    gpu = load(DOCKER / "compose.gpu.yaml")["services"][SERVICE]
    assert (DOCKER / cpu["build"]["context"] / cpu["build"]["dockerfile"]).is_file()
    for service, target in ((cpu, "cpu"), (gpu, "gpu")):
        assert service["build"]["target"] == target and target in stages
        assert service["image"] == f"rag-reorder:{version.group(1)}-{target}"


def test_every_bind_mount_source_exists() -> None:
    for path in COMPOSE_FILES:
        for service in load(path)["services"].values():
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith("."):
                    assert (DOCKER / source).exists(), f"{path.name}: {source}"


def test_compose_health_checks_probe_readiness() -> None:
    for path in (COMPOSE, DOCKER / "compose.gpu.yaml"):
        test = load(path)["services"][SERVICE]["healthcheck"]["test"]
        assert test[0] == "CMD" and f"127.0.0.1:{CONTAINER_PORT}/ready" in test[-1]


# --- Prometheus ------------------------------------------------------------------------------


def _scrape(path: Path) -> dict[str, Any]:
    config = load(path)
    assert duration_seconds(config["global"]["scrape_timeout"]) < duration_seconds(
        config["global"]["scrape_interval"]
    )
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"{SERVICE}:{CONTAINER_PORT}"]}]
    result: dict[str, Any] = job
    return result


def test_prometheus_scrapes_the_service() -> None:
    compose = load(COMPOSE)
    job = _scrape(DOCKER / "prometheus" / "prometheus.yml")
    assert "authorization" not in job
    assert "RAG_REORDER_API_KEY" not in compose["services"][SERVICE]["environment"]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    assert f"127.0.0.1:{CONTAINER_PORT}:{CONTAINER_PORT}" in compose["services"][SERVICE]["ports"]


def test_with_an_api_key_prometheus_scrapes_with_it() -> None:
    override = load(DOCKER / "compose.api-key.yaml")
    job = _scrape(DOCKER / "prometheus" / "prometheus.api-key.yml")
    (secret,) = override["secrets"]
    assert override["secrets"][secret] == {"environment": "RAG_REORDER_API_KEY"}
    assert override["services"]["prometheus"]["secrets"] == [secret]
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": f"/run/secrets/{secret}",
    }
    assert (
        "RAG_REORDER_API_KEY" in override["services"][SERVICE]["environment"]["RAG_REORDER_API_KEY"]
    )
    (mount,) = override["services"]["prometheus"]["volumes"]
    assert mount.endswith(":/etc/prometheus/prometheus.yml:ro")


# --- Grafana ---------------------------------------------------------------------------------


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    grafana = load(COMPOSE)["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    provisioning = DOCKER / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = load(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = load(provisioning / "dashboards" / "rag-reorder.yaml")["providers"]
    dashboards_dir = provider["options"]["path"]
    source = next(s for s, target in mounts.items() if target == dashboards_dir)
    assert (DOCKER / source / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"


# --- the dashboard ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return result


def panels_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries_of(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels_of(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def to_promql(expr: str) -> str:
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    # label_values(metric, label) is Grafana's, not PromQL: check its metric selector.
    match = re.fullmatch(r"label_values\((.+),\s*\w+\)", expr)
    return match.group(1) if match else expr


def dashboard_problems(dashboard: dict[str, Any], exposed: set[str]) -> list[str]:
    """Schema, layout, variables and queries: each problem as a line."""
    schema = json.loads((SCHEMAS / "grafana-dashboard.json").read_text())
    problems = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(dashboard)
    ]
    if problems:
        return problems
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids repeat: {ids}")
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        if g["x"] + g["w"] > 24:
            problems.append(f"panel {panel['title']!r} is wider than the grid")
        here = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        if cells & here:
            problems.append(f"panel {panel['title']!r} overlaps another")
        cells |= here
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels_of(dashboard):
        datasources = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
        if any(d != {"type": "prometheus", "uid": "${datasource}"} for d in datasources):
            problems.append(f"panel {panel['title']!r} does not use the $datasource variable")
        refs = [t["refId"] for t in panel["targets"]]
        if len(refs) != len(set(refs)):
            problems.append(f"panel {panel['title']!r} repeats a refId")
    exprs = queries_of(dashboard)
    for expr in exprs:
        for used in re.findall(r"\$\{?(\w+)", expr):
            if used not in variables and not used.startswith("__"):
                problems.append(f"undefined variable ${used} in {expr}")
    for expr, parsed in zip(exprs, promql_parse([to_promql(e) for e in exprs]), strict=True):
        if parsed["errors"]:
            problems.append(f"PromQL syntax error at {parsed['errors']} in {expr}")
        unknown = set(parsed["metrics"]) - exposed
        if unknown:
            problems.append(f"unknown metrics {sorted(unknown)} in {expr}")
    return problems


def test_the_dashboard_is_valid(dashboard: dict[str, Any], exposed_metrics: set[str]) -> None:
    assert dashboard_problems(dashboard, exposed_metrics) == []


# What the dashboard must show (issue 7), as the metrics each needs.
REQUIRED = {
    "request rate": {"rag_reorder_http_requests_total"},
    "latency percentiles": {"rag_reorder_http_request_duration_seconds_bucket"},
    "prompts per request": {"rag_reorder_request_prompts_bucket"},
    "tokens per second": {"rag_reorder_prompt_tokens_total", "rag_reorder_scored_tokens_total"},
    "solver time": {"rag_reorder_solver_duration_seconds_bucket"},
    "fit quality": {"rag_reorder_fit_r2_bucket"},
    "order differs from the retriever's": {
        "rag_reorder_order_changed_total",
        "rag_reorder_strategy_requests_total",
    },
    "failures by type": {"rag_reorder_request_failures_total"},
    "transformers engine (issue 22)": {
        "rag_reorder_batch_queue_prompts",
        "rag_reorder_batch_fill_ratio_bucket",
        "rag_reorder_batch_wait_seconds_bucket",
    },
    "remote engine (issue 39)": {
        "rag_reorder_engine_calls_total",
        "rag_reorder_engine_call_duration_seconds_bucket",
        "rag_reorder_engine_calls_in_flight",
        "rag_reorder_engine_retries_total",
    },
    "overload (issue 44)": {
        "rag_reorder_requests_within_deadline_total",
        "rag_reorder_estimated_wait_seconds",
        "rag_reorder_queue_wait_seconds_bucket",
    },
    "profile-first strategy (issue 53)": {
        "rag_reorder_auto_requests_total",
        "rag_reorder_auto_profile_trusted",
        "rag_reorder_auto_profile_age_seconds",
        "rag_reorder_auto_learning_runs",
        "rag_reorder_auto_recalibrations_total",
        "rag_reorder_auto_drift_events_total",
    },
    "engine": {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
    },
}


@pytest.mark.parametrize("what", REQUIRED)
def test_the_dashboard_shows(dashboard: dict[str, Any], what: str) -> None:
    used = {m for parsed in promql_parse(queries_of(dashboard)) for m in parsed["metrics"]}
    assert REQUIRED[what] <= used


def test_percentile_panels_use_histogram_quantile(dashboard: dict[str, Any]) -> None:
    for expr in queries_of(dashboard):
        if "_bucket" in expr:
            assert re.search(r"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(", expr), expr


BROKEN_DASHBOARDS = {
    "unknown metric": (
        lambda d: d["panels"][2]["targets"][0].update(
            expr='sum(rag_reorder_requests_inflight{job=~"$job"})'
        ),
        "unknown metrics ['rag_reorder_requests_inflight']",
    ),
    # vLLM's V0 name for the KV-cache share; V1 renamed it vllm:kv_cache_usage_perc.
    "retired vLLM metric": (
        lambda d: d["panels"][2]["targets"][0].update(
            expr='max(vllm:gpu_cache_usage_perc{job=~"$job"})'
        ),
        "unknown metrics ['vllm:gpu_cache_usage_perc']",
    ),
    "syntax error": (
        lambda d: d["panels"][2]["targets"][0].update(
            expr='sum by (le) rate(rag_reorder_http_requests_total{job=~"$job"}[5m])'
        ),
        "PromQL syntax error",
    ),
    "undefined variable": (
        lambda d: d["panels"][2]["targets"][0].update(expr='sum(rag_reorder_ready{job=~"$jobs"})'),
        "undefined variable $jobs",
    ),
    "overlap": (lambda d: d["panels"][3]["gridPos"].update(x=0), "overlaps another"),
    "duplicate id": (lambda d: d["panels"][3].update(id=d["panels"][2]["id"]), "ids repeat"),
    "missing targets": (lambda d: d["panels"][2].pop("targets"), "'targets' is a required"),
    "fixed datasource": (
        lambda d: d["panels"][2].update(datasource={"type": "prometheus", "uid": "prom-1"}),
        "does not use the $datasource variable",
    ),
}


@pytest.mark.parametrize(
    ("breakage", "expected"), BROKEN_DASHBOARDS.values(), ids=BROKEN_DASHBOARDS.keys()
)
def test_a_broken_dashboard_is_caught(
    dashboard: dict[str, Any], exposed_metrics: set[str], breakage: Any, expected: str
) -> None:
    broken = json.loads(json.dumps(dashboard))
    breakage(broken)
    problems = dashboard_problems(broken, exposed_metrics)
    assert any(expected in p for p in problems), problems


def test_the_adapter_rule_serves_the_metric_the_hpa_asks_for(exposed_metrics: set[str]) -> None:
    adapter = load(ROOT / "deploy" / "examples" / "prometheus-adapter-values.yaml")
    (rule,) = adapter["rules"]["custom"]
    hpa_values = load(ROOT / "deploy" / "examples" / "values-hpa.yaml")
    metric = hpa_values["autoscaling"]["hpa"]["metricName"]
    assert rule["name"]["as"] == metric
    (selector_metric,) = promql_parse([rule["seriesQuery"]])[0]["metrics"]
    assert selector_metric == metric and metric in exposed_metrics
