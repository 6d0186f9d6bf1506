"""Every RAG_REORDER_* variable the deployment sets is a service setting, with a value it takes.

pydantic-settings ignores an unknown RAG_REORDER_ variable, so a misspelt name in the Dockerfile,
a Compose file or the chart would leave the default in force without a word. Here the names are
checked against service/config/settings.py, and each image's, Compose stack's and rendered pod's
environment is loaded by Settings itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config.settings import Settings
from tests.deploy import checks
from tests.deploy.test_chart import RENDERS
from tests.deploy.test_dockerfile import DOCKERFILE, parse
from tests.deploy.tools import CHART, DOCKER, EXAMPLES, helm_template

PREFIX = "RAG_REORDER_"
SETTINGS = {PREFIX + name.upper() for name in Settings.model_fields}
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}
_INTERPOLATION = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*)|(:?\?)[^}]*)?\}")
# What a required Compose variable (${VAR:?...}) is set to here.
REQUIRED_STAND_IN = {
    "RAG_REORDER_API_KEY": "test-key",
    "RAG_REORDER_ADMIN_API_KEY": "test-admin-key",
    "MODEL_DIR": "/srv/models/model",
}


def deployment_files() -> Iterator[Path]:
    yield DOCKERFILE
    yield from sorted(DOCKER.rglob("*.y*ml"))
    yield from sorted(p for p in CHART.rglob("*") if p.suffix in (".yaml", ".tpl", ".txt", ".json"))
    yield from sorted(EXAMPLES.glob("*.yaml"))


def test_every_variable_named_in_the_deployment_files_is_a_setting() -> None:
    named = {
        (path.name, name)
        for path in deployment_files()
        for name in re.findall(rf"{PREFIX}[A-Z][A-Z0-9_]*", path.read_text())
    }
    assert named, "the deployment files set no RAG_REORDER_ variable at all"
    assert {(where, name) for where, name in named if name not in SETTINGS} == set()


def load_settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """Settings as the server would load them from exactly this environment."""
    unknown = {name for name in env if name.startswith(PREFIX)} - SETTINGS
    assert not unknown, f"not settings: {sorted(unknown)}"
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith(PREFIX)]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return Settings()


def interpolate(value: Any) -> str:
    """A Compose value with its ${...} resolved as when only the required variables are set."""

    def resolve(match: re.Match[str]) -> str:
        name, default_op, default, required_op = match.groups()
        if required_op:
            return REQUIRED_STAND_IN[name]
        if default_op:
            return str(default)
        raise AssertionError(f"${{{name}}} has neither a default nor a required marker")

    return _INTERPOLATION.sub(resolve, str(value))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_each_image_environment_loads(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    _, stages = parse(DOCKERFILE.read_text())
    settings = load_settings(monkeypatch, stages[target].env())
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.backend == {"cpu": "transformers", "gpu": "vllm"}[target]


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("compose.gpu.yaml",),
        ("compose.api-key.yaml",),
        ("compose.api-key.yaml", "compose.admin-key.yaml"),
    ],
    ids=["cpu", "gpu", "key", "admin-key"],
)
def test_each_compose_stack_environment_loads(
    monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...]
) -> None:
    _, stages = parse(DOCKERFILE.read_text())
    target = "gpu" if "compose.gpu.yaml" in overrides else "cpu"
    env = stages[target].env()
    for name in ("compose.yaml", *overrides):
        service = yaml.safe_load((DOCKER / name).read_text())["services"]["rag-reorder"]
        env |= {k: interpolate(v) for k, v in service.get("environment", {}).items()}
    settings = load_settings(monkeypatch, env)
    if "compose.gpu.yaml" in overrides:
        assert settings.backend == "vllm" and settings.model == "/models/model"
    if "compose.api-key.yaml" in overrides:
        assert settings.api_key is not None
        assert settings.api_key.get_secret_value() == REQUIRED_STAND_IN["RAG_REORDER_API_KEY"]
    if "compose.admin-key.yaml" in overrides:
        assert settings.admin_api_key is not None
        admin = settings.admin_api_key.get_secret_value()
        assert admin == REQUIRED_STAND_IN["RAG_REORDER_ADMIN_API_KEY"]
    else:
        assert settings.admin_api_key is None


@pytest.mark.parametrize("name", RENDERS)
def test_each_rendered_pod_environment_loads(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    spec = RENDERS[name]
    docs = helm_template(*spec["files"], set_values=spec["sets"])
    container = checks.server_container(checks.one(docs, "Deployment"))
    _, stages = parse(DOCKERFILE.read_text())
    flavor = container["image"].rsplit("-", 1)[-1]
    env = stages[flavor].env()
    for item in container["env"]:
        # A Secret's value is not in the manifest: any non-empty key stands in for it.
        env[item["name"]] = item.get("value", "from-a-secret")
    settings = load_settings(monkeypatch, env)
    assert settings.drain_timeout_s > 0
    if spec["gpu"]:
        assert settings.backend == "vllm" and settings.max_model_len == 8192
