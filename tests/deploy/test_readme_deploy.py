"""The deployment guide (docs/deployment.md): every command in it is one these tests can check,
and passes. The README's Deploy section shows a subset of those commands, verbatim.

helm commands run (``--dry-run=client``, offline) and their render passes the same checks as
the chart's; the files that kubectl, Compose and ``docker build`` are pointed at exist and are
the validated ones; the Secrets the README creates are exactly the ones the example values
read. A command of any other kind fails the test: the section holds nothing unchecked.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config.settings import Settings
from tests.deploy import checks
from tests.deploy.test_dockerfile import DOCKERFILE, parse
from tests.deploy.test_observability import COMPOSE_FILES, DASHBOARD
from tests.deploy.tools import CHART, EXAMPLES, ROOT, helm_template, run, schema_errors, tool

README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "deployment.md"
GPU_VALUES = EXAMPLES / "values-gpu.yaml"


def deploy_section() -> str:
    return GUIDE.read_text()


def readme_deploy_section() -> str:
    text = README.read_text()
    start = text.index("\n## Deploy\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def commands(section: str) -> list[list[str]]:
    """The shell commands of the section's bash blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def options(words: list[str], *names: str) -> list[str]:
    """Values of repeated options (``-f X``, ``--set=Y`` and ``--set Y`` forms)."""
    values = []
    for i, word in enumerate(words):
        for name in names:
            if word == name:
                values.append(words[i + 1])
            elif word.startswith(name + "="):
                values.append(word.split("=", 1)[1])
    return values


@pytest.fixture(scope="module")
def section() -> str:
    return deploy_section()


@pytest.fixture(scope="module")
def every_command(section: str) -> list[list[str]]:
    found = commands(section)
    assert found, "the Deploy section has no commands"
    return found


def _without_env(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def test_the_readme_shows_only_commands_the_guide_checks(
    every_command: list[list[str]],
) -> None:
    shown = commands(readme_deploy_section())
    assert shown, "the README's Deploy section has no commands"
    assert [w for w in shown if w not in every_command] == []


def test_every_command_is_of_a_checked_kind(every_command: list[list[str]]) -> None:
    checked = {
        ("docker", "build"),
        ("docker", "compose"),
        ("curl",),
        ("kubectl",),
        ("helm", "install"),
    }
    for words in map(_without_env, every_command):
        assert tuple(words[:1]) in checked or tuple(words[:2]) in checked, words


def test_docker_builds_name_the_dockerfile_targets(every_command: list[list[str]]) -> None:
    _, stages = parse(DOCKERFILE.read_text())
    # One version for server and client: the client package's VERSION file (pyproject.toml).
    version = re.search(r"^(\S+)$", (ROOT / "clients/python/rag_reorder/VERSION").read_text(), re.M)
    assert version
    builds = [w for w in every_command if w[:2] == ["docker", "build"]]
    assert {options(w, "--target")[0] for w in builds} == {"cpu", "gpu"}
    for words in builds:
        (target,) = options(words, "--target")
        assert target in stages and words[-1] == "."
        assert options(words, "-t") == [f"rag-reorder:{version.group(1)}-{target}"]


def test_compose_commands_use_the_validated_files(every_command: list[list[str]]) -> None:
    runs = [_without_env(w) for w in every_command]
    composes = [w for w in runs if w[:2] == ["docker", "compose"]]
    assert composes
    for words in composes:
        files = [ROOT / f for f in options(words, "-f")]
        assert files and files[0].name == "compose.yaml"
        assert set(files) <= set(COMPOSE_FILES), files


def test_the_gpu_compose_command_sets_the_model_folder(every_command: list[list[str]]) -> None:
    gpu = [w for w in every_command if "docker/compose.gpu.yaml" in w]
    assert gpu and all(w[0].startswith("MODEL_DIR=/") for w in gpu)


def test_curl_targets_the_port_compose_publishes(every_command: list[list[str]]) -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert "127.0.0.1:8000:8000" in compose["services"]["rag-reorder"]["ports"]
    for words in every_command:
        if words[0] == "curl":
            assert re.fullmatch(r"localhost:8000/(ready|health)", words[-1]), words


def _helm_installs(every_command: list[list[str]]) -> list[list[str]]:
    installs = [w for w in every_command if w[:2] == ["helm", "install"]]
    assert installs, "the Deploy section shows no helm install"
    return installs


def test_helm_install_runs(every_command: list[list[str]]) -> None:
    for words in _helm_installs(every_command):
        chart = ROOT / words[3]
        proc = run([tool("helm"), *words[1:3], str(chart), *words[4:], "--dry-run=client"])
        assert proc.returncode == 0, proc.stderr


def _render(words: list[str]) -> tuple[list[checks.Doc], list[Path]]:
    files = [ROOT / f for f in options(words, "-f", "--values")]
    sets = tuple(options(words, "--set"))
    (namespace,) = options(words, "-n", "--namespace")
    return helm_template(*files, set_values=sets, release=words[2], namespace=namespace), files


def test_helm_install_renders_a_deployment_whose_pieces_fit(
    every_command: list[list[str]],
) -> None:
    for words in _helm_installs(every_command):
        docs, files = _render(words)
        assert GPU_VALUES in files, "the README's install is the GPU one"
        assert checks.all_problems(docs, expect_gpu=True) == []
        assert [e for doc in docs for e in schema_errors(doc)] == []
        image = checks.server_container(checks.one(docs, "Deployment"))["image"]
        assert image == f"{options(words, '--set')[0].split('=', 1)[1]}:0.1.0-gpu"


def test_the_secrets_created_are_the_ones_the_pods_read(
    every_command: list[list[str]],
) -> None:
    created: set[tuple[str, str]] = set()
    for words in every_command:
        if words[0] == "kubectl" and "secret" in words:
            name = words[words.index("generic") + 1]
            for literal in options(words, "--from-literal"):
                created.add((name, literal.split("=", 1)[0]))
    read: set[tuple[str, str]] = set()
    for words in _helm_installs(every_command):
        docs, _ = _render(words)
        pod = checks.one(docs, "Deployment")["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    read.add((ref["name"], ref["key"]))
    assert created == read


def test_kubectl_applies_valid_manifests_into_the_release_namespace(
    every_command: list[list[str]],
) -> None:
    (namespace,) = {options(w, "-n")[0] for w in _helm_installs(every_command)}
    kubectls = [w for w in every_command if w[0] == "kubectl"]
    assert ["kubectl", "create", "namespace", namespace] in kubectls
    for words in kubectls:
        if "apply" in words:
            assert options(words, "-n") == [namespace]
            for path in options(words, "-f"):
                docs: list[dict[str, Any]] = list(yaml.safe_load_all((ROOT / path).read_text()))
                assert [e for doc in docs for e in schema_errors(doc)] == [], path


def test_every_path_the_section_names_exists(section: str) -> None:
    paths = set(re.findall(r"(?<![\w/.])((?:docker|deploy)/[\w./-]+\w|Dockerfile)", section))
    assert DASHBOARD.relative_to(ROOT).as_posix() in paths
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


def test_the_metrics_it_names_exist(section: str, exposed_metrics: set[str]) -> None:
    named = set(re.findall(r"`((?:rag_reorder_|vllm:)\w+)`", section))
    assert named
    series = {n for n in named if n in exposed_metrics}
    families = {n for n in named - series if any(m.startswith(n + "_") for m in exposed_metrics)}
    assert named - series - families == set()


def test_the_settings_and_chart_values_it_names_exist(section: str) -> None:
    fields = {"RAG_REORDER_" + name.upper() for name in Settings.model_fields}
    settings = set(re.findall(r"RAG_REORDER_[A-Z][A-Z0-9_]*", section))
    assert settings and settings <= fields
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    keys = {
        k
        for k in re.findall(r"`([a-z]\w*(?:\.\w+)+)`", section)
        if not k.endswith((".json", ".yaml", ".py", ".com"))
    }
    assert keys
    for key in keys:
        node: Any = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not in values.yaml"
            node = node[part]
