"""The validation tools tests/deploy runs, found where scripts/deploy-tools.sh installs them.

Nothing here builds or runs an image or talks to a cluster: helm renders, JSON schemas validate,
hadolint lints, Prometheus' grammar parses. A missing tool skips on a developer's machine (with
the command that installs it) and fails under CI, so CI can never pass by validating nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "rag-reorder"
EXAMPLES = ROOT / "deploy" / "examples"
DOCKER = ROOT / "docker"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
BIN = Path(sys.executable).parent
PROMQL_CHECK = BIN.parent / "deploy-tools" / "promql" / "check.cjs"
INSTALL_HINT = "run scripts/deploy-tools.sh after `make install`"

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.29.0", "1.37.0")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def missing(what: str) -> NoReturn:
    message = f"{what} is not installed: {INSTALL_HINT}"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def tool(name: str) -> str:
    """Path of an executable: next to this interpreter (the venv) first, then PATH."""
    local = BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        missing(name)
    return found


def run(args: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


class RenderError(Exception):
    """``helm template`` refused the values (schema or a template's ``fail``)."""


def helm_template(
    *values_files: Path,
    set_values: tuple[str, ...] = (),
    release: str = "rag-reorder",
    namespace: str = "rag",
) -> list[dict[str, Any]]:
    """Render the chart; returns the manifests. Raises RenderError with helm's message."""
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace]
    for path in values_files:
        args += ["--values", str(path)]
    for item in set_values:
        args += ["--set", item]
    proc = run(args)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def promql_parse(exprs: list[str]) -> list[dict[str, list[Any]]]:
    """Parse with Prometheus' Lezer grammar: per expression, syntax-error offsets and metrics."""
    node = shutil.which("node")
    if node is None:
        missing("node")
    if not PROMQL_CHECK.is_file():
        missing("the PromQL grammar (@prometheus-io/lezer-promql)")
    proc = run([node, str(PROMQL_CHECK)], stdin=json.dumps(exprs))
    assert proc.returncode == 0, proc.stderr
    result: list[dict[str, list[Any]]] = json.loads(proc.stdout)
    return result


@cache
def _crd_validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# Custom resources: their schemas are vendored in tests/deploy/schemas (no cluster to ask).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Validate one manifest: Kubernetes' strict schemas (every version in KUBE_VERSIONS) for
    built-in kinds, the vendored CRD schemas for custom ones; unknown kinds are an error."""
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate")
    key = (doc.get("apiVersion"), doc.get("kind"))
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if key in CRD_SCHEMAS:
        validator = _crd_validator(CRD_SCHEMAS[key])  # type: ignore[index]
        return [
            f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)
        ]
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{where}: no schema for {key} in Kubernetes {version}")
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.absolute_path))
            errors.append(f"{where} (Kubernetes {version}): {path}: {exc.message}")
    return errors
