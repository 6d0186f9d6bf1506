"""The alerting and recording rules: one file (deploy/helm/rag-reorder/alerts), two consumers.

1. The file is a Prometheus rule file (groups of recording and alerting rules), every query
   parses with Prometheus' own grammar and names only series the service (or its vLLM engine)
   really exposes or the file records, every selector carries the job matcher the chart swaps
   for the release's, and each alert has a severity, annotations and a runbook in
   docs/operations.md.
2. A real app's scrape has the series the rules select: route names, histogram bucket bounds.
3. The chart renders the same rules as a PrometheusRule (upstream CRD and strict schema), with
   the release's selector, and Compose's Prometheus loads the file it mounts.

No promtool here (no binary downloads): the rule-file schema is the PrometheusRule CRD's group
and rule fields, the same ones Prometheus reads from a rule file.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from markdown.extensions.toc import slugify
from prometheus_client.parser import text_string_to_metric_families

from app.errors import ERROR_TABLE
from app.middleware import ROUTES
from tests.deploy import checks
from tests.deploy.checks import duration_seconds
from tests.deploy.tools import (
    CHART,
    DOCKER,
    ROOT,
    SCHEMAS,
    RenderError,
    crd_errors,
    helm_template,
    promql_parse,
    schema_errors,
)

RULES = CHART / "alerts" / "rag-reorder.rules.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
# The matcher every selector carries: the Compose scrape job, swapped by the chart.
PLACEHOLDER = 'job="rag-reorder"'
RUNBOOK = "docs/operations.md#"
SEVERITIES = {"critical", "warning", "info"}
# Series Prometheus makes itself, not the service.
SYNTHETIC = {"up"}
# The scoring routes the request SLIs are about (POST, admitted, scored).
SCORING_ROUTES = {"/v1/reorder", "/v1/rerank", "/v2/rerank", "/rerank"}
RULE_SCHEMA = json.loads((SCHEMAS / "prometheusrule-monitoring.coreos.com-v1.json").read_text())

_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')

Rule = dict[str, Any]


def load_rules(path: Path = RULES) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def rules_of(data: dict[str, Any]) -> list[Rule]:
    return [rule for group in data["groups"] for rule in group["rules"]]


def alerts_of(data: dict[str, Any]) -> list[Rule]:
    return [r for r in rules_of(data) if "alert" in r]


def recorded(data: dict[str, Any]) -> set[str]:
    return {r["record"] for r in rules_of(data) if "record" in r}


def selectors(expr: str, metrics: list[str]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each vector selector of the expression: metric name and its label matchers."""
    found = []
    for metric in sorted(set(metrics)):
        pattern = rf"(?<![\w:]){re.escape(metric)}(?![\w:])\s*(\{{[^}}]*\}})?"
        for match in re.finditer(pattern, expr):
            found.append((metric, _MATCHER.findall(match.group(1) or "")))
    return found


def matches(matchers: list[tuple[str, str, str]], labels: dict[str, str]) -> bool:
    for name, op, value in matchers:
        have = labels.get(name, "")
        hit = re.fullmatch(value, have) is not None if op in ("=~", "!~") else have == value
        if hit != (op in ("=", "=~")):
            return False
    return True


def anchors(markdown: str) -> set[str]:
    """The ids MkDocs (Python-Markdown's toc) gives the page's headings."""
    return {slugify(h, "-") for h in re.findall(r"^#+\s+(.+?)\s*$", markdown, re.M)}


def rule_file_problems(data: dict[str, Any], exposed: set[str]) -> list[str]:
    """Everything about the rule file on its own: each problem as a line."""
    group_schema = {**RULE_SCHEMA["properties"]["spec"], "$schema": RULE_SCHEMA["$schema"]}
    problems = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(group_schema).iter_errors(data)
    ]
    if problems:
        return problems
    groups = [g["name"] for g in data["groups"]]
    if len(groups) != len(set(groups)):
        problems.append(f"group names repeat: {groups}")
    records = [r["record"] for r in rules_of(data) if "record" in r]
    if len(records) != len(set(records)):
        problems.append(f"recording rules repeat: {records}")
    for name in records:
        if not re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name):
            problems.append(f"recording rule {name} is not level:metric:operations")
    keys = [(r["alert"], r["labels"].get("severity")) for r in alerts_of(data) if "labels" in r]
    if len(keys) != len(set(keys)):
        problems.append(f"an alert repeats with the same severity: {keys}")
    known = exposed | recorded(data) | SYNTHETIC
    rules = rules_of(data)
    exprs = [r["expr"] for r in rules]
    used: set[str] = set()
    for rule, parsed in zip(rules, promql_parse(exprs), strict=True):
        name = rule.get("alert") or rule.get("record")
        expr = rule["expr"]
        if parsed["errors"]:
            problems.append(f"{name}: PromQL syntax error at {parsed['errors']}")
            continue
        used |= set(parsed["metrics"])
        unknown = set(parsed["metrics"]) - known
        if unknown:
            problems.append(f"{name}: unknown metrics {sorted(unknown)}")
        for metric, matchers in selectors(expr, parsed["metrics"]):
            if ("job", "=", "rag-reorder") not in matchers:
                problems.append(f"{name}: {metric} is selected without {PLACEHOLDER}")
        for grouping in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            if not {"namespace", "job"} <= {g.strip() for g in grouping.split(",")}:
                problems.append(f"{name}: by/on ({grouping}) drops namespace or job")
        if "alert" in rule:
            problems += alert_problems(rule)
    unused = recorded(data) - used
    if unused:
        problems.append(f"recording rules no alert uses: {sorted(unused)}")
    return problems


def alert_problems(rule: Rule) -> list[str]:
    name = rule["alert"]
    problems = []
    if "for" not in rule or duration_seconds(rule["for"]) <= 0:
        problems.append(f"{name}: no `for`: one bad evaluation would page")
    if rule.get("labels", {}).get("severity") not in SEVERITIES:
        problems.append(f"{name}: severity is not one of {sorted(SEVERITIES)}")
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        if not annotations.get(key):
            problems.append(f"{name}: no {key} annotation")
    for key, text in annotations.items():
        if text.count("{{") != text.count("}}"):
            problems.append(f"{name}: unbalanced template in {key}")
    if "ratio" in rule["expr"] and "$value" not in annotations.get("description", ""):
        problems.append(f"{name}: the description does not give the value")
    url = annotations.get("runbook_url", "")
    if url != RUNBOOK + slugify(name, "-"):
        problems.append(f"{name}: runbook_url {url!r} is not {RUNBOOK}{slugify(name, '-')}")
    return problems


# --- the file --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    return load_rules()


def test_the_rule_file_is_valid(rules: dict[str, Any], exposed_metrics: set[str]) -> None:
    assert rule_file_problems(rules, exposed_metrics) == []


def test_the_alerts_are_the_documented_set(rules: dict[str, Any]) -> None:
    names = {r["alert"] for r in alerts_of(rules)}
    assert 8 <= len(names) <= 13, sorted(names)
    # The service down, a replica not ready, the error budget, latency: the four that page or
    # ticket in any service; the rest are this service's own causes.
    assert {
        "RagReorderDown",
        "RagReorderUnavailable",
        "RagReorderErrorBudgetBurn",
        "RagReorderLatencyHigh",
    } <= names
    critical = {r["alert"] for r in alerts_of(rules) if r["labels"]["severity"] == "critical"}
    assert critical == {"RagReorderDown", "RagReorderUnavailable", "RagReorderErrorBudgetBurn"}


def test_the_error_budget_burns_on_two_window_pairs(rules: dict[str, Any]) -> None:
    """The SRE workbook's multi-window alerts: 14.4x over 1 h and 5 m pages, 6x over 6 h and
    30 m tickets; each long window paired with one a twelfth of it, so the alert resets soon
    after the burn stops."""
    burns = {
        r["labels"]["severity"]: r["expr"]
        for r in alerts_of(rules)
        if r["alert"] == "RagReorderErrorBudgetBurn"
    }
    assert set(burns) == {"critical", "warning"}
    for severity, (factor, long, short) in {
        "critical": ("14.4", "1h", "5m"),
        "warning": ("6", "6h", "30m"),
    }.items():
        expr = burns[severity]
        windows = re.findall(r"ratio_rate(\w+)\{", expr)
        assert windows == [long, short], expr
        assert expr.count(f"({factor} * 0.005)") == 2, expr


BROKEN_RULES = {
    "unknown metric": (
        lambda d: d["groups"][1]["rules"][2].update(
            expr='max by (namespace, job) (rag_reorder_is_ready{job="rag-reorder"}) == 0'
        ),
        "unknown metrics ['rag_reorder_is_ready']",
    ),
    "syntax error": (
        lambda d: d["groups"][1]["rules"][1].update(expr='up{job="rag-reorder"} ==='),
        "PromQL syntax error",
    ),
    "selector without the job": (
        lambda d: d["groups"][1]["rules"][1].update(expr="up == 0"),
        f"up is selected without {PLACEHOLDER}",
    ),
    "aggregation dropping the job": (
        lambda d: d["groups"][1]["rules"][2].update(
            expr='max by (namespace) (rag_reorder_ready{job="rag-reorder"}) == 0'
        ),
        "drops namespace or job",
    ),
    "no for": (lambda d: d["groups"][1]["rules"][0].pop("for"), "no `for`"),
    "no severity": (lambda d: d["groups"][1]["rules"][0]["labels"].clear(), "severity"),
    "no runbook": (
        lambda d: d["groups"][1]["rules"][0]["annotations"].pop("runbook_url"),
        "no runbook_url",
    ),
    "runbook elsewhere": (
        lambda d: d["groups"][1]["rules"][0]["annotations"].update(
            runbook_url="docs/operations.md#alerts"
        ),
        "is not docs/operations.md#ragreorderdown",
    ),
    "misspelt field": (
        lambda d: d["groups"][1]["rules"][0].update(annotation={}),
        "'annotation' was unexpected",
    ),
    "for on a recording rule": (
        lambda d: d["groups"][0]["rules"][0].update({"for": "5m"}),
        "groups/0/rules/0",
    ),
    "unused recording rule": (
        lambda d: d["groups"][0]["rules"].append(
            {
                "record": "namespace_job:rag_reorder_ready:max",
                "expr": 'max by (namespace, job) (rag_reorder_ready{job="rag-reorder"})',
            }
        ),
        "recording rules no alert uses",
    ),
}


@pytest.mark.parametrize(("breakage", "expected"), BROKEN_RULES.values(), ids=BROKEN_RULES.keys())
def test_a_broken_rule_file_is_caught(
    rules: dict[str, Any], exposed_metrics: set[str], breakage: Any, expected: str
) -> None:
    broken = copy.deepcopy(rules)
    breakage(broken)
    problems = rule_file_problems(broken, exposed_metrics)
    assert any(expected in p for p in problems), problems


# --- the runbooks ----------------------------------------------------------------------------


def _alerts_section() -> str:
    text = OPERATIONS.read_text()
    start = text.index("\n## Alerts\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_every_alert_has_a_runbook_in_operations(rules: dict[str, Any]) -> None:
    ids = anchors(OPERATIONS.read_text())
    for rule in alerts_of(rules):
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in ids, f"{rule['alert']}: no heading #{anchor} in docs/operations.md"


def test_the_alert_table_lists_every_alert_with_its_severity(rules: dict[str, Any]) -> None:
    section = _alerts_section()
    # | [Alert](#anchor) | severity[, severity] | threshold, for | meaning | first response |
    rows = re.findall(r"^\| \[(\w+)\]\(#(\w+)\) \| (\w+(?:, \w+)*) \|", section, re.M)
    table = {name: (anchor, severity) for name, anchor, severity in rows}
    expected: dict[str, set[str]] = {}
    for rule in alerts_of(rules):
        expected.setdefault(rule["alert"], set()).add(rule["labels"]["severity"])
    assert set(table) == set(expected)
    for name, severities in expected.items():
        anchor, listed = table[name]
        assert anchor == slugify(name, "-")
        assert set(listed.split(", ")) == severities, name


def test_the_thresholds_in_the_docs_are_the_files(rules: dict[str, Any]) -> None:
    """Each alert's `for` appears in its table row: the docs cannot drift from the file."""
    section = _alerts_section()
    for rule in alerts_of(rules):
        row = next(line for line in section.splitlines() if line.startswith(f"| [{rule['alert']}]"))
        assert f"for {rule['for']}" in row, row


# --- the rules select what a real scrape has -------------------------------------------------


def test_the_selectors_name_real_routes_statuses_and_buckets(rules: dict[str, Any]) -> None:
    statuses = {"200"} | {str(kind.status) for kind in ERROR_TABLE.values()}
    exprs = [r["expr"] for r in rules_of(rules)]
    for expr, parsed in zip(exprs, promql_parse(exprs), strict=True):
        for _, matchers in selectors(expr, parsed["metrics"]):
            for name, op, value in matchers:
                if name == "route":
                    routes = value.split("|") if op == "=~" else [value]
                    assert set(routes) <= ROUTES, expr
                    if op == "=~":
                        assert set(routes) == SCORING_ROUTES, expr
                if name == "status":
                    assert any(re.fullmatch(value, s) for s in statuses), expr


async def test_a_real_scrape_has_the_series_the_rules_select(
    tmp_path: Path, rules: dict[str, Any], exposed_metrics: set[str]
) -> None:
    """The service on the fake backend answers a reorder, a rerank, a failed request and a
    calibration; its /metrics then has a sample for every selector of the rules (job and
    status aside: Prometheus adds the job, and no test waits for a 504). A labelled family no
    request has touched yet is declared but empty; its selector may then only name the job."""
    from tests.app.conftest import PASSAGES, QUERY, serving

    async with serving(tmp_path) as h:
        for path, body in (
            ("/v1/reorder", {"query": QUERY, "passages": PASSAGES}),
            ("/v1/rerank", {"query": QUERY, "documents": PASSAGES}),
            ("/v1/bias-profiles/calibrate", {}),
        ):
            response = await h.client.post(path, json=body)
            assert response.status_code < 500, response.text
        h.backend.error = RuntimeError("boom")
        response = await h.client.post("/v1/reorder", json={"query": QUERY, "passages": PASSAGES})
        assert response.status_code >= 500
        scrape = (await h.client.get("/metrics")).text
    families = list(text_string_to_metric_families(scrape))
    samples = [(s.name, s.labels) for f in families for s in f.samples]
    declared = {f.name for f in families}
    exprs = [r["expr"] for r in rules_of(rules)]
    checked = 0
    for expr, parsed in zip(exprs, promql_parse(exprs), strict=True):
        for metric, matchers in selectors(expr, parsed["metrics"]):
            if metric in SYNTHETIC | recorded(rules) or metric.startswith("vllm:"):
                continue
            wanted = [m for m in matchers if m[0] not in ("job", "namespace", "status")]
            if any(name == metric and matches(wanted, labels) for name, labels in samples):
                checked += 1
                continue
            family = re.sub(r"_(total|bucket|count|sum)$", "", metric)
            assert family in declared and not wanted, f"no sample for {metric}{wanted}"
    assert checked >= 10


# --- the chart -------------------------------------------------------------------------------


def expected_groups(data: dict[str, Any], selector: str) -> list[dict[str, Any]]:
    groups = copy.deepcopy(data["groups"])
    for rule in rules_of({"groups": groups}):
        rule["expr"] = rule["expr"].replace(PLACEHOLDER, selector)
    return groups


def _prometheus_rule(*sets: str, release: str = "rag-reorder") -> dict[str, Any]:
    docs = helm_template(set_values=("prometheusRule.enabled=true", *sets), release=release)
    return checks.one(docs, "PrometheusRule")


def test_the_chart_renders_no_rules_by_default() -> None:
    assert checks.of_kind(helm_template(), "PrometheusRule") == []


@pytest.mark.parametrize("release", ["rag-reorder", "search"])
def test_the_prometheusrule_carries_the_files_rules_for_the_release(
    rules: dict[str, Any], release: str
) -> None:
    docs = helm_template(
        set_values=("prometheusRule.enabled=true", "serviceMonitor.enabled=true"),
        release=release,
        namespace="rag",
    )
    rule = checks.one(docs, "PrometheusRule")
    assert schema_errors(rule) == []
    fullname = checks.one(docs, "Service")["metadata"]["name"]
    selector = f'job="{fullname}",namespace="rag"'
    assert rule["spec"]["groups"] == expected_groups(rules, selector)
    assert checks.check_alert_rules(docs) == []
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == release


def test_the_rules_follow_the_values(rules: dict[str, Any]) -> None:
    rule = _prometheus_rule(
        "prometheusRule.labels.release=kube-prometheus-stack",
        'prometheusRule.selector=job="rag"\\,cluster="eu-1"',
        "prometheusRule.runbookBaseUrl=https://docs.example.com/rag-reorder/operations/",
        "prometheusRule.additionalAlertLabels.team=search",
        "prometheusRule.additionalAlertLabels.severity=none",
        "prometheusRule.disabledAlerts={RagReorderEngineSaturated,RagReorderCalibrationFailed}",
    )
    assert schema_errors(rule) == []
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rendered = rules_of(rule["spec"])
    assert all('job="rag",cluster="eu-1"' in r["expr"] for r in rendered)
    alerts = {(r["alert"], r["labels"]["severity"]): r for r in rendered if "alert" in r}
    disabled = {"RagReorderEngineSaturated", "RagReorderCalibrationFailed"}
    kept = [r for r in alerts_of(rules) if r["alert"] not in disabled]
    assert set(alerts) == {(r["alert"], r["labels"]["severity"]) for r in kept}
    for r in alerts.values():
        assert r["labels"]["team"] == "search"  # added; the file's severity kept
        anchor = slugify(r["alert"], "-")
        assert r["annotations"]["runbook_url"] == (
            f"https://docs.example.com/rag-reorder/operations/#{anchor}"
        )


BAD_RULE_VALUES = {
    "unknown alert disabled": (
        "prometheusRule.disabledAlerts={RagReorderTypo}",
        "RagReorderTypo is not an alert",
    ),
    "selector not matchers": ("prometheusRule.selector=rag-reorder", "/prometheusRule/selector"),
    "relative runbook base": (
        "prometheusRule.runbookBaseUrl=docs/ops",
        "/prometheusRule/runbookBaseUrl",
    ),
    "misspelt key": ("prometheusRule.lables.release=x", "additional properties 'lables'"),
}


@pytest.mark.parametrize(("value", "message"), BAD_RULE_VALUES.values(), ids=BAD_RULE_VALUES.keys())
def test_bad_rule_values_are_refused(value: str, message: str) -> None:
    with pytest.raises(RenderError) as refused:
        helm_template(set_values=("prometheusRule.enabled=true", value))
    assert message in str(refused.value)


def test_the_crd_and_strict_schemas_catch_a_broken_prometheusrule() -> None:
    rule = _prometheus_rule()
    assert crd_errors(rule) == []
    bad_for = copy.deepcopy(rule)
    bad_for["spec"]["groups"][1]["rules"][0]["for"] = "5 minutes"
    assert crd_errors(bad_for) != []
    misspelt = copy.deepcopy(rule)
    misspelt["spec"]["groups"][1]["rules"][0]["annotation"] = {}
    assert any("annotation" in e for e in schema_errors(misspelt))


def test_the_check_catches_rules_on_another_job() -> None:
    docs = helm_template(set_values=("prometheusRule.enabled=true", "serviceMonitor.enabled=true"))
    broken = copy.deepcopy(docs)
    rule = checks.one(broken, "PrometheusRule")
    rule["spec"]["groups"][1]["rules"][0]["expr"] = 'absent(up{job="other"})'
    assert any("selects job ['other']" in p for p in checks.check_alert_rules(broken))


# --- Compose ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.api-key.yml"])
def test_compose_prometheus_loads_the_rule_file(config: str) -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    mounts = dict(
        v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"] if v.startswith(".")
    )
    prometheus = yaml.safe_load((DOCKER / "prometheus" / config).read_text())
    (job,) = prometheus["scrape_configs"]
    assert f'job="{job["job_name"]}"' == PLACEHOLDER
    loaded = []
    for pattern in prometheus["rule_files"]:
        for source, target in mounts.items():
            folder = (DOCKER / source).resolve()
            if folder.is_dir():
                loaded += [
                    path
                    for path in folder.iterdir()
                    if fnmatch.fnmatch(f"{target}/{path.name}", pattern)
                ]
    assert loaded == [RULES.resolve()]
    # The API-key override swaps the scrape config only; the rules mount stays (Compose merges
    # volumes by target).
    override = yaml.safe_load((DOCKER / "compose.api-key.yaml").read_text())
    targets = [v.split(":")[1] for v in override["services"]["prometheus"]["volumes"]]
    assert targets == ["/etc/prometheus/prometheus.yml"]
