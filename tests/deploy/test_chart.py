"""The Helm chart, rendered offline with real helm and checked three ways.

1. Every manifest validates against Kubernetes' strict JSON schemas (the chart's floor version
   and the newest), and the custom resources against validators generated from the upstream
   CRDs and against strict schemas of the fields the chart writes (tests/deploy/schemas).
2. The pieces fit (tests/deploy/checks.py): selectors, probe paths and ports, shutdown timing,
   the GPU, autoscaling on requests in flight, the scrape with the API key.
3. Both catch what they are for: broken copies of the manifests and bad values must fail.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from service.config.settings import Settings
from tests.deploy import checks
from tests.deploy.checks import Doc
from tests.deploy.tools import (
    CHART,
    EXAMPLES,
    RenderError,
    crd_errors,
    helm_template,
    promql_parse,
    run,
    schema_errors,
    tool,
)

GPU = EXAMPLES / "values-gpu.yaml"
HPA = EXAMPLES / "values-hpa.yaml"
REMOTE = EXAMPLES / "values-remote-engine.yaml"
# Every optional feature on the CPU image, with the chart creating the API-key Secret.
ALL_FEATURES = (
    "apiKey.enabled=true",
    "apiKey.value=test-key",
    "adminApiKey.enabled=true",
    "adminApiKey.value=admin-test-key",
    "serviceMonitor.enabled=true",
    "autoscaling.enabled=true",
    "grafanaDashboard.enabled=true",
    "prometheusRule.enabled=true",
    "tracing.endpoint=http://otel-collector.observability.svc:4318",
    "tracing.sampleRatio=0.25",
)
RENDERS: dict[str, dict[str, Any]] = {
    "default": {"files": (), "sets": (), "gpu": False},
    "gpu": {"files": (GPU,), "sets": (), "gpu": True},
    "gpu-hpa": {"files": (GPU, HPA), "sets": (), "gpu": True},
    # Weights already in a folder on the volume: no download, no Hugging Face cache.
    "gpu-model-folder": {
        "files": (GPU,),
        "sets": (
            "model.download.enabled=false",
            "model.volume.hfCache=false",
            "model.name=/models/Llama-3.1-8B-Instruct",
        ),
        "gpu": True,
    },
    "cpu-all-features": {"files": (), "sets": ALL_FEATURES, "gpu": False},
    # CPU pods scoring with the team's own vLLM deployment (issue 39).
    "remote-engine": {"files": (REMOTE,), "sets": (), "gpu": False},
    # Bias profiles on a shared claim (POST /v1/bias-profiles/calibrate writes there).
    "cpu-profile-volume": {
        "files": (),
        "sets": ("biasProfiles.volume.enabled=true", "biasProfiles.volume.existingClaim=profiles"),
        "gpu": False,
    },
}
# The settings the chart sets from its own values; values.schema.json refuses them in settings.
MANAGED_SETTINGS = {
    "HOST",
    "PORT",
    "MODEL",
    "BACKEND",
    "ENGINE_URL",
    "ENGINE_API_KEY",
    "API_KEY",
    "ADMIN_API_KEY",
    "STATE_URL",
    "STATE_PASSWORD",
    "DRAIN_TIMEOUT_S",
    "OTEL_ENDPOINT",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {
        name: helm_template(*spec["files"], set_values=spec["sets"])
        for name, spec in RENDERS.items()
    }


def kinds(docs: list[Doc]) -> set[str]:
    return {d["kind"] for d in docs}


@pytest.mark.parametrize("name", RENDERS)
def test_every_manifest_validates_against_its_schema(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    errors = [e for doc in rendered[name] for e in schema_errors(doc)]
    assert errors == []


@pytest.mark.parametrize("name", RENDERS)
def test_the_pieces_fit(rendered: dict[str, list[Doc]], name: str) -> None:
    assert checks.all_problems(rendered[name], expect_gpu=RENDERS[name]["gpu"]) == []


def test_each_render_has_the_resources_its_values_ask_for(
    rendered: dict[str, list[Doc]],
) -> None:
    base = {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"}
    assert kinds(rendered["default"]) == base
    monitoring = {"ServiceMonitor", "PrometheusRule", "ConfigMap"}
    assert kinds(rendered["gpu"]) == base | {"ScaledObject"} | monitoring
    assert kinds(rendered["gpu-hpa"]) == base | {"HorizontalPodAutoscaler"} | monitoring
    assert kinds(rendered["gpu-model-folder"]) == kinds(rendered["gpu"])
    assert kinds(rendered["cpu-all-features"]) == base | {"ScaledObject", "Secret"} | monitoring


def test_gpu_values_run_a_real_model_from_the_volume(rendered: dict[str, list[Doc]]) -> None:
    deployment = checks.one(rendered["gpu"], "Deployment")
    container = checks.server_container(deployment)
    env = checks.env_of(container)
    assert container["image"].endswith(":0.1.0-gpu")
    assert env["RAG_REORDER_MODEL"]["value"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert env["RAG_REORDER_BACKEND"]["value"] == "vllm"
    assert env["HF_HOME"]["value"] == "/models"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert mounts["/dev/shm"]["name"] == "dshm"
    init = deployment["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["download-model"]
    assert checks.env_of(init[0])["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"


def test_a_model_folder_on_the_volume_is_mounted_read_only(
    rendered: dict[str, list[Doc]],
) -> None:
    pod = checks.one(rendered["gpu-model-folder"], "Deployment")["spec"]["template"]["spec"]
    env = checks.env_of(checks.server_container({"spec": {"template": {"spec": pod}}}))
    assert "initContainers" not in pod and "HF_HOME" not in env
    assert env["RAG_REORDER_MODEL"]["value"] == "/models/Llama-3.1-8B-Instruct"
    (claim,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert claim["persistentVolumeClaim"] == {"claimName": "rag-reorder-models", "readOnly": True}


def test_the_admin_key_comes_from_its_own_secret(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu-all-features"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {"rag-reorder-api-key", "rag-reorder-admin-api-key"}
    env = checks.env_of(checks.server_container(checks.one(docs, "Deployment")))
    ref = env["RAG_REORDER_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "rag-reorder-admin-api-key", "key": "admin-api-key"}
    default = checks.one(rendered["default"], "Deployment")
    assert "RAG_REORDER_ADMIN_API_KEY" not in checks.env_of(checks.server_container(default))


def test_bias_profiles_on_a_claim_are_mounted_writable_and_named_to_the_service(
    rendered: dict[str, list[Doc]],
) -> None:
    pod = checks.one(rendered["cpu-profile-volume"], "Deployment")["spec"]["template"]["spec"]
    server = checks.server_container({"spec": {"template": {"spec": pod}}})
    path = "/var/lib/rag-reorder/profiles"
    assert checks.env_of(server)["RAG_REORDER_BIAS_PROFILE_DIR"]["value"] == path
    # The replicas' shared traffic sample lives on the same claim.
    assert checks.env_of(server)["RAG_REORDER_TRAFFIC_SAMPLE_DIR"]["value"] == f"{path}/traffic"
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "bias-profiles"]
    assert mount == {"name": "bias-profiles", "mountPath": path}  # writable
    (claim,) = [v for v in pod["volumes"] if v["name"] == "bias-profiles"]
    assert claim["persistentVolumeClaim"] == {"claimName": "profiles"}
    default = checks.one(rendered["default"], "Deployment")
    default_env = checks.env_of(checks.server_container(default))
    assert "RAG_REORDER_BIAS_PROFILE_DIR" not in default_env
    assert "RAG_REORDER_TRAFFIC_SAMPLE_DIR" not in default_env


def test_tracing_sets_the_endpoint_and_sampler_only_when_asked(
    rendered: dict[str, list[Doc]],
) -> None:
    def env(name: str) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in _server(rendered[name]).get("env", [])}

    on = env("cpu-all-features")
    assert on["RAG_REORDER_OTEL_ENDPOINT"] == "http://otel-collector.observability.svc:4318"
    assert on["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert on["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    off = env("default")
    assert not {"RAG_REORDER_OTEL_ENDPOINT", "OTEL_TRACES_SAMPLER"} & off.keys()


def test_the_dashboard_configmap_carries_the_dashboard_file(
    rendered: dict[str, list[Doc]],
) -> None:
    config_map = checks.one(rendered["gpu"], "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "rag-reorder.json").read_text())
    assert json.loads(config_map["data"]["rag-reorder.json"]) == shipped


@pytest.mark.parametrize("name", RENDERS)
def test_autoscaling_queries_parse_and_name_real_metrics(
    rendered: dict[str, list[Doc]], name: str, exposed_metrics: set[str]
) -> None:
    queries = checks.autoscaling_queries(rendered[name])
    for query, parsed in zip(queries, promql_parse(queries), strict=True):
        assert parsed["errors"] == [], query
        assert parsed["metrics"], query
        assert set(parsed["metrics"]) <= exposed_metrics, query


@pytest.mark.parametrize("files", [(), (GPU,), (GPU, HPA)], ids=["default", "gpu", "gpu-hpa"])
def test_helm_lint_strict(files: tuple[Any, ...]) -> None:
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    for path in files:
        args += ["--values", str(path)]
    proc = run(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_model_claim_validates() -> None:
    import yaml

    claim = yaml.safe_load((EXAMPLES / "model-pvc.yaml").read_text())
    assert schema_errors(claim) == []
    gpu_values = yaml.safe_load(GPU.read_text())
    assert gpu_values["model"]["volume"]["existingClaim"] == claim["metadata"]["name"]


def test_the_remote_engine_example_points_cpu_pods_at_the_engine(
    rendered: dict[str, list[Doc]],
) -> None:
    server = _server(rendered["remote-engine"])
    env = {e["name"]: e for e in server["env"]}
    assert env["RAG_REORDER_BACKEND"]["value"] == "remote"
    assert env["RAG_REORDER_ENGINE_URL"]["value"].startswith("http://vllm.")
    assert env["RAG_REORDER_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "vllm-api-key",
        "key": "api-key",
    }
    assert "nvidia.com/gpu" not in str(server.get("resources", {}))
    # Without an engine secret the variable is not set at all.
    assert "RAG_REORDER_ENGINE_API_KEY" not in {
        e["name"] for e in _server(rendered["default"])["env"]
    }


def test_settings_keys_in_the_values_schema_are_the_service_settings() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = set(schema["properties"]["settings"]["propertyNames"]["enum"])
    fields = {name.upper() for name in Settings.model_fields}
    assert allowed == fields - MANAGED_SETTINGS


# --- the checks catch broken manifests -------------------------------------------------------


def _deployment(docs: list[Doc]) -> Doc:
    return checks.one(docs, "Deployment")


def _server(docs: list[Doc]) -> Doc:
    return checks.server_container(_deployment(docs))


def _set_pdb_selector(docs: list[Doc]) -> None:
    checks.one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] = {
        "app.kubernetes.io/name": "other"
    }


def _probe_on_wrong_path(docs: list[Doc]) -> None:
    _server(docs)["livenessProbe"]["httpGet"]["path"] = "/ready"


def _readiness_on_health(docs: list[Doc]) -> None:
    _server(docs)["readinessProbe"]["httpGet"]["path"] = "/health"


def _probe_on_wrong_port(docs: list[Doc]) -> None:
    _server(docs)["startupProbe"]["httpGet"]["port"] = 8080


def _short_grace(docs: list[Doc]) -> None:
    _deployment(docs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30


def _no_prestop(docs: list[Doc]) -> None:
    del _server(docs)["lifecycle"]


def _gpu_only_in_requests(docs: list[Doc]) -> None:
    del _server(docs)["resources"]["limits"]["nvidia.com/gpu"]


def _service_selects_nothing(docs: list[Doc]) -> None:
    checks.one(docs, "Service")["spec"]["selector"] = {"app": "rag-reorder"}


def _monitor_on_wrong_port(docs: list[Doc]) -> None:
    checks.one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] = "metrics"


def _monitor_without_key(docs: list[Doc]) -> None:
    del checks.one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]


def _scale_on_cpu(docs: list[Doc]) -> None:
    checks.one(docs, "ScaledObject")["spec"]["triggers"] = [
        {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "60"}}
    ]


def _hpa_on_cpu(docs: list[Doc]) -> None:
    checks.one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"] = [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 60},
            },
        }
    ]


def _startup_too_short(docs: list[Doc]) -> None:
    _server(docs)["startupProbe"]["failureThreshold"] = 3


def _replicas_beside_autoscaler(docs: list[Doc]) -> None:
    _deployment(docs)["spec"]["replicas"] = 2


def _server_on_loopback(docs: list[Doc]) -> None:
    for env in _server(docs)["env"]:
        if env["name"] == "RAG_REORDER_HOST":
            env["value"] = "127.0.0.1"


BREAKAGES: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    ("default", _set_pdb_selector, "PodDisruptionBudget"),
    ("default", _probe_on_wrong_path, "livenessProbe checks /ready"),
    ("default", _readiness_on_health, "readinessProbe checks /health"),
    ("default", _probe_on_wrong_port, "startupProbe port 8080"),
    ("default", _short_grace, "> terminationGracePeriodSeconds 30"),
    ("default", _no_prestop, "no preStop sleep"),
    ("default", _service_selects_nothing, "does not select the pods"),
    ("default", _startup_too_short, "startup budget"),
    ("default", _server_on_loopback, "RAG_REORDER_HOST"),
    ("gpu", _gpu_only_in_requests, "not in the container's limits"),
    ("gpu", _monitor_on_wrong_port, "is not a Service port"),
    ("gpu", _monitor_without_key, "does not send it"),
    ("gpu", _scale_on_cpu, "non-Prometheus triggers"),
    ("gpu", _replicas_beside_autoscaler, "autoscaler owns them"),
    ("gpu-hpa", _hpa_on_cpu, "CPU/memory"),
]


@pytest.mark.parametrize(
    ("name", "breakage", "expected"),
    BREAKAGES,
    ids=[b[1].__name__.lstrip("_") for b in BREAKAGES],
)
def test_the_checks_catch_a_broken_manifest(
    rendered: dict[str, list[Doc]],
    name: str,
    breakage: Callable[[list[Doc]], None],
    expected: str,
) -> None:
    docs = copy.deepcopy(rendered[name])
    breakage(docs)
    problems = checks.all_problems(docs, expect_gpu=RENDERS[name]["gpu"])
    assert any(expected in p for p in problems), problems


def test_a_cpu_render_with_a_gpu_is_caught(rendered: dict[str, list[Doc]]) -> None:
    assert checks.check_gpu(rendered["gpu"], expect_gpu=False)


# --- the schemas catch what they are for ----------------------------------------------------


def _typo_in_probe(docs: list[Doc]) -> Doc:
    server = _server(docs)
    server["livenessprobe"] = server.pop("livenessProbe")
    return _deployment(docs)


def _port_as_word(docs: list[Doc]) -> Doc:
    _server(docs)["ports"][0]["containerPort"] = "eight thousand"
    return _deployment(docs)


def _pdb_selector_misplaced(docs: list[Doc]) -> Doc:
    pdb = checks.one(docs, "PodDisruptionBudget")
    pdb["spec"]["selector"]["labels"] = pdb["spec"]["selector"].pop("matchLabels")
    return pdb


def _monitor_unknown_field(docs: list[Doc]) -> Doc:
    monitor = checks.one(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["bearerToken"] = "plain text"
    return monitor


def _keda_numeric_threshold(docs: list[Doc]) -> Doc:
    scaled = checks.one(docs, "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 16
    return scaled


SCHEMA_BREAKAGES: list[tuple[str, Callable[[list[Doc]], Doc]]] = [
    ("default", _typo_in_probe),
    ("default", _port_as_word),
    ("default", _pdb_selector_misplaced),
    ("gpu", _monitor_unknown_field),
    ("gpu", _keda_numeric_threshold),
]


@pytest.mark.parametrize(
    ("name", "breakage"),
    SCHEMA_BREAKAGES,
    ids=[b[1].__name__.lstrip("_") for b in SCHEMA_BREAKAGES],
)
def test_the_schemas_catch_an_invalid_manifest(
    rendered: dict[str, list[Doc]], name: str, breakage: Callable[[list[Doc]], Doc]
) -> None:
    docs = copy.deepcopy(rendered[name])
    assert schema_errors(breakage(docs)) != []


def _monitor_scheme(docs: list[Doc]) -> Doc:
    monitor = checks.one(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["scheme"] = "ftp"
    return monitor


def _monitor_interval_in_words(docs: list[Doc]) -> Doc:
    monitor = checks.one(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    return monitor


def _keda_without_target(docs: list[Doc]) -> Doc:
    scaled = checks.one(docs, "ScaledObject")
    del scaled["spec"]["scaleTargetRef"]
    return scaled


CRD_BREAKAGES = [_monitor_scheme, _monitor_interval_in_words, _keda_without_target]


@pytest.mark.parametrize("breakage", CRD_BREAKAGES, ids=lambda b: b.__name__.lstrip("_"))
def test_the_upstream_crd_validators_catch_an_invalid_resource(
    rendered: dict[str, list[Doc]], breakage: Callable[[list[Doc]], Doc]
) -> None:
    broken = breakage(copy.deepcopy(rendered["gpu"]))
    assert crd_errors(checks.one(rendered["gpu"], broken["kind"])) == []
    assert crd_errors(broken) != []


# --- bad values never render ----------------------------------------------------------------

BAD_VALUES = {
    "unknown key": ("image.flavr=gpu", "additional properties 'flavr' not allowed"),
    "unknown flavor": ("image.flavor=tpu", "/image/flavor"),
    "misspelt setting": ("settings.MAX_MODEL_LENGTH=8192", "propertyName 'MAX_MODEL_LENGTH'"),
    "setting the chart manages": ("settings.PORT=9000", "propertyName 'PORT'"),
    "tracing endpoint without a scheme": (
        "tracing.endpoint=otel-collector:4318",
        "/tracing/endpoint",
    ),
    "sample ratio over one": ("tracing.sampleRatio=2", "/tracing/sampleRatio"),
    "scale to zero": ("autoscaling.minReplicas=0", "/autoscaling/minReplicas"),
    "bad digest": ("image.digest=latest", "/image/digest"),
    "grace shorter than the drain": (
        "lifecycle.terminationGracePeriodSeconds=30",
        "terminationGracePeriodSeconds (30) must be at least",
    ),
    "api key from nowhere": ("apiKey.enabled=true", "apiKey.enabled needs"),
    "admin key from nowhere": ("adminApiKey.enabled=true", "adminApiKey.enabled needs"),
    "download without a cache volume": (
        "model.download.enabled=true,model.name=org/model",
        "model.download needs model.volume",
    ),
    "volume without a claim": ("model.volume.enabled=true", "existingClaim"),
    "profile volume without a claim": (
        "biasProfiles.volume.enabled=true",
        "biasProfiles.volume.enabled needs",
    ),
    "profile folder set twice": (
        "biasProfiles.volume.enabled=true,biasProfiles.volume.existingClaim=p,"
        "settings.BIAS_PROFILE_DIR=/x",
        "keep one",
    ),
    "traffic folder set twice": (
        "biasProfiles.volume.enabled=true,biasProfiles.volume.existingClaim=p,"
        "settings.TRAFFIC_SAMPLE_DIR=/x",
        "traffic sample folder; keep one",
    ),
    "rollout deadline inside the startup budget": (
        "progressDeadlineSeconds=300",
        "progressDeadlineSeconds must exceed",
    ),
}


@pytest.mark.parametrize(("value", "message"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_values_are_refused(value: str, message: str) -> None:
    with pytest.raises(RenderError) as refused:
        helm_template(set_values=(value,))
    assert message in str(refused.value)
