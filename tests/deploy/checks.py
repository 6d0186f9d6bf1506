"""What no JSON schema can check in the rendered chart: the pieces have to fit each other.

Each check takes the rendered manifests and returns its problems (empty: fine), so the tests can
show that a broken manifest is caught (tests/deploy/test_chart.py breaks copies on purpose).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Doc = dict[str, Any]

LIVENESS_PATH = "/health"
READINESS_PATH = "/ready"
METRICS_PATH = "/metrics"
GPU_RESOURCE = "nvidia.com/gpu"
IN_FLIGHT_METRIC = "rag_reorder_requests_in_flight"
# After the drain the server closes: uvicorn's 2 s grace for open connections, then the engine
# (vLLM waits 5 s for its engine process before killing it; 5.1 s from SIGTERM to exit was
# measured with the vLLM backend and nothing in flight).
CLOSE_MARGIN_S = 10
# A model load (weights, CUDA graphs, warm-up) may take minutes: at least this startup budget.
MIN_STARTUP_BUDGET_S = 600


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[Doc], kind: str) -> Doc:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def _selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def check_selectors(docs: list[Doc]) -> list[str]:
    """Deployment, Service and PodDisruptionBudget select the pods; the ServiceMonitor selects
    the Service; autoscalers target the Deployment."""
    problems = []
    deployment = one(docs, "Deployment")
    name = deployment["metadata"]["name"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    if not _selects(deployment["spec"]["selector"].get("matchLabels"), pod_labels):
        problems.append("the Deployment's selector does not match its pod template's labels")
    services = of_kind(docs, "Service")
    for svc in services:
        if not _selects(svc["spec"].get("selector"), pod_labels):
            problems.append(f"Service {svc['metadata']['name']} does not select the pods")
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        if pdb["spec"]["selector"].get("matchExpressions") or not _selects(
            pdb["spec"]["selector"].get("matchLabels"), pod_labels
        ):
            problems.append(
                f"PodDisruptionBudget {pdb['metadata']['name']} does not select the pods"
            )
    for monitor in of_kind(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"].get("matchLabels")
        if not any(_selects(selector, s["metadata"].get("labels", {})) for s in services):
            problems.append(f"ServiceMonitor {monitor['metadata']['name']} selects no Service")
    for scaler in of_kind(docs, "HorizontalPodAutoscaler") + of_kind(docs, "ScaledObject"):
        ref = scaler["spec"]["scaleTargetRef"]
        if ref.get("name") != name or ref.get("kind", "Deployment") != "Deployment":
            problems.append(f"{scaler['kind']} does not target Deployment {name}")
    return problems


def _port_matches(port: object, container: Doc) -> bool:
    ports = container.get("ports", [])
    return any(port in (p.get("name"), p["containerPort"]) for p in ports)


def check_probes(docs: list[Doc]) -> list[str]:
    """startup and readiness on /ready, liveness on /health, all on the port the server listens
    on (RAG_REORDER_PORT, bound on every interface); a startup budget long enough for a model
    load, and a rollout deadline past it."""
    problems = []
    deployment = one(docs, "Deployment")
    container = server_container(deployment)
    env = env_of(container)
    listen = env.get("RAG_REORDER_PORT", {}).get("value")
    ports = [p["containerPort"] for p in container.get("ports", [])]
    if listen is None or [int(listen)] != ports:
        problems.append(f"RAG_REORDER_PORT={listen} but the container ports are {ports}")
    if env.get("RAG_REORDER_HOST", {}).get("value") != "0.0.0.0":
        problems.append("RAG_REORDER_HOST must be 0.0.0.0, or probes cannot reach the server")
    expected = {
        "startupProbe": READINESS_PATH,
        "readinessProbe": READINESS_PATH,
        "livenessProbe": LIVENESS_PATH,
    }
    for probe_name, path in expected.items():
        probe = container.get(probe_name)
        if probe is None or "httpGet" not in probe:
            problems.append(f"{probe_name} is missing or not an HTTP probe")
            continue
        get = probe["httpGet"]
        if get.get("path") != path:
            problems.append(f"{probe_name} checks {get.get('path')}, not {path}")
        if not _port_matches(get.get("port"), container):
            problems.append(f"{probe_name} port {get.get('port')!r} is not the server's port")
    startup = container.get("startupProbe", {})
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if budget < MIN_STARTUP_BUDGET_S:
        problems.append(f"startup budget {budget} s is shorter than {MIN_STARTUP_BUDGET_S} s")
    deadline = deployment["spec"].get("progressDeadlineSeconds", 600)
    if deadline <= budget:
        problems.append(f"progressDeadlineSeconds {deadline} <= startup budget {budget}")
    return problems


def _prestop_seconds(container: Doc) -> float | None:
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] in ("sleep", "/bin/sleep"):
        return float(command[1])
    return None


def check_shutdown(docs: list[Doc]) -> list[str]:
    """preStop sleep, then the drain (RAG_REORDER_DRAIN_TIMEOUT_S), then closing: all inside
    terminationGracePeriodSeconds, or the kubelet kills requests mid-drain."""
    problems = []
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(deployment)
    sleep = _prestop_seconds(container)
    if sleep is None or sleep <= 0:
        problems.append("no preStop sleep: endpoints may still route to a draining pod")
        sleep = 0.0
    drain_env = env_of(container).get("RAG_REORDER_DRAIN_TIMEOUT_S", {}).get("value")
    if drain_env is None:
        problems.append("RAG_REORDER_DRAIN_TIMEOUT_S is not set from the chart")
    drain = float(drain_env or 30)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if sleep + drain + CLOSE_MARGIN_S > grace:
        problems.append(
            f"preStop {sleep:g} s + drain {drain:g} s + {CLOSE_MARGIN_S} s to close "
            f"> terminationGracePeriodSeconds {grace}"
        )
    return problems


def check_gpu(docs: list[Doc], *, expect_gpu: bool) -> list[str]:
    """A GPU pod asks for the GPU in limits (extended resources are never overcommitted);
    a CPU pod asks for none."""
    container = server_container(one(docs, "Deployment"))
    resources = container.get("resources", {})
    limit = resources.get("limits", {}).get(GPU_RESOURCE)
    request = resources.get("requests", {}).get(GPU_RESOURCE)
    if not expect_gpu:
        return [f"{GPU_RESOURCE} requested by a CPU deployment"] if limit or request else []
    problems = []
    if not limit or int(limit) < 1:
        problems.append(f"{GPU_RESOURCE} is not in the container's limits")
    if request is not None and request != limit:
        problems.append(f"{GPU_RESOURCE} request {request} differs from its limit {limit}")
    return problems


def autoscaling_queries(docs: list[Doc]) -> list[str]:
    return [
        t["metadata"]["query"]
        for s in of_kind(docs, "ScaledObject")
        for t in s["spec"]["triggers"]
        if t.get("type") == "prometheus"
    ]


def check_autoscaling(docs: list[Doc]) -> list[str]:
    """Scale on requests in flight from Prometheus, never on CPU or memory; the autoscaler
    owns the replica count; never to zero (a cold start loads the model)."""
    problems = []
    scalers = of_kind(docs, "HorizontalPodAutoscaler") + of_kind(docs, "ScaledObject")
    if scalers and "replicas" in one(docs, "Deployment")["spec"]:
        problems.append("Deployment sets replicas while an autoscaler owns them")
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        metrics = hpa["spec"].get("metrics", [])
        kinds = {m["type"] for m in metrics}
        if kinds & {"Resource", "ContainerResource"} or not metrics:
            problems.append("the HPA scales on CPU/memory (or its default, CPU)")
        names = {
            m[m["type"].lower()]["metric"]["name"]
            for m in metrics
            if m["type"] in ("Pods", "Object", "External")
        }
        if IN_FLIGHT_METRIC not in names:
            problems.append(f"the HPA does not scale on {IN_FLIGHT_METRIC}: {sorted(names)}")
        if hpa["spec"].get("minReplicas", 1) < 1:
            problems.append("the HPA may scale to zero")
    for scaled in of_kind(docs, "ScaledObject"):
        triggers = scaled["spec"]["triggers"]
        types = {t["type"] for t in triggers}
        if types - {"prometheus"}:
            problems.append(f"the ScaledObject has non-Prometheus triggers: {sorted(types)}")
        if not any(IN_FLIGHT_METRIC in q for q in autoscaling_queries([scaled])):
            problems.append(f"no ScaledObject trigger queries {IN_FLIGHT_METRIC}")
        if scaled["spec"].get("minReplicaCount", 0) < 1:
            problems.append("the ScaledObject may scale to zero")
    return problems


def check_metrics_scrape(docs: list[Doc]) -> list[str]:
    """The ServiceMonitor scrapes /metrics on the Service's port; when the API key is on, with
    the same Secret the server reads it from (/metrics needs the key)."""
    problems = []
    container = server_container(one(docs, "Deployment"))
    key_ref = env_of(container).get("RAG_REORDER_API_KEY", {}).get("valueFrom", {})
    key_ref = key_ref.get("secretKeyRef")
    port_names = {p.get("name") for s in of_kind(docs, "Service") for p in s["spec"]["ports"]}
    for monitor in of_kind(docs, "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            if endpoint.get("port") not in port_names:
                problems.append(
                    f"ServiceMonitor port {endpoint.get('port')!r} is not a Service port"
                )
            if endpoint.get("path", METRICS_PATH) != METRICS_PATH:
                problems.append(f"ServiceMonitor scrapes {endpoint.get('path')}, not /metrics")
            credentials = endpoint.get("authorization", {}).get("credentials")
            if key_ref and credentials != {"name": key_ref["name"], "key": key_ref["key"]}:
                problems.append("the API key is on but the ServiceMonitor does not send it")
            if not key_ref and credentials:
                problems.append("the ServiceMonitor sends a key the server does not expect")
    return problems


def check_references(docs: list[Doc]) -> list[str]:
    """Mounted volumes exist, a chart-made Secret holds the key the pods read, the service
    account exists, the pods run as non-root without privilege escalation."""
    problems = []
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for container in pod.get("initContainers", []) + pod["containers"]:
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                problems.append(f"{container['name']} mounts undefined volume {mount['name']}")
        if container.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
            problems.append(f"{container['name']} allows privilege escalation")
    if pod.get("securityContext", {}).get("runAsNonRoot") is not True:
        problems.append("the pod does not require a non-root user")
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    for env in server_container(deployment).get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if (
            ref
            and ref["name"] in secrets
            and ref["key"] not in secrets[ref["name"]].get("data", {})
        ):
            problems.append(f"Secret {ref['name']} has no key {ref['key']}")
    accounts = {a["metadata"]["name"] for a in of_kind(docs, "ServiceAccount")}
    if accounts and pod.get("serviceAccountName") not in accounts:
        problems.append(f"serviceAccountName {pod.get('serviceAccountName')} is not rendered")
    return problems


_JOB_MATCHER = re.compile(r'\bjob\s*=\s*"([^"]*)"')


def check_alert_rules(docs: list[Doc]) -> list[str]:
    """The PrometheusRule's queries select the job the chart's ServiceMonitor scrapes into (the
    Service's name): rules on any other job would watch nothing, and RagReorderDown would fire
    for ever on absent(up)."""
    problems = []
    if not of_kind(docs, "ServiceMonitor"):
        return problems  # scraped some other way: prometheusRule.selector says how
    services = {s["metadata"]["name"] for s in of_kind(docs, "Service")}
    for rule_doc in of_kind(docs, "PrometheusRule"):
        for group in rule_doc["spec"]["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                jobs = set(_JOB_MATCHER.findall(rule["expr"]))
                if not jobs:
                    problems.append(f"rule {name} selects no job")
                elif not jobs <= services:
                    problems.append(
                        f"rule {name} selects job {sorted(jobs)}, not {sorted(services)}"
                    )
    return problems


ALL_CHECKS: tuple[Callable[[list[Doc]], list[str]], ...] = (
    check_selectors,
    check_probes,
    check_shutdown,
    check_autoscaling,
    check_metrics_scrape,
    check_references,
    check_alert_rules,
)


def all_problems(docs: list[Doc], *, expect_gpu: bool) -> list[str]:
    problems = [p for check in ALL_CHECKS for p in check(docs)]
    return problems + check_gpu(docs, expect_gpu=expect_gpu)


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?$")


def duration_seconds(text: str) -> float:
    """A Compose/Prometheus duration (1h2m3s, 45s, 500ms) in seconds."""
    match = _DURATION.match(text)
    assert match and text, f"not a duration: {text!r}"
    h, m, s, ms = (int(g) if g else 0 for g in match.groups())
    return h * 3600 + m * 60 + s + ms / 1000
