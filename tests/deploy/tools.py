"""The validation tools tests/deploy runs, found where scripts/deploy-tools.sh installs them.

Nothing here builds or runs an image or talks to a cluster: helm renders, JSON schemas validate,
hadolint lints, Prometheus' grammar parses. A missing tool fails the test with the command that
installs it, never skips it: a deployment check that did not run must not look like one that
passed (`make test` installs every tool before pytest runs).
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
CRD_CHECK = BIN.parent / "deploy-tools" / "crds" / "check.mjs"
# Where each tool comes from: the dev dependencies (`make install`) or scripts/deploy-tools.sh.
FROM_PYPROJECT = "run `make install` (pyproject.toml's dev dependencies)"
FROM_DEPLOY_TOOLS = "run scripts/deploy-tools.sh after `make install`"
INSTALLED_BY = {
    "helm": FROM_DEPLOY_TOOLS,
    "hadolint": FROM_PYPROJECT,
    "check-jsonschema": FROM_PYPROJECT,
}

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.29.0", "1.37.0")


def missing(what: str, how: str) -> NoReturn:
    pytest.fail(f"{what} is not installed: {how}", pytrace=False)


def tool(name: str) -> str:
    """Path of an executable: next to this interpreter (the venv) first, then PATH."""
    local = BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        missing(name, INSTALLED_BY.get(name, FROM_DEPLOY_TOOLS))
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


def _node(script: Path, what: str, payload: object) -> Any:
    """Run one of the Node checkers deploy-tools.sh installs: JSON in on stdin, JSON out."""
    node = shutil.which("node")
    if node is None:
        missing("node", "install Node.js 20 or later (scripts/deploy-tools.sh needs it too)")
    if not script.is_file():
        missing(what, FROM_DEPLOY_TOOLS)
    proc = run([node, str(script)], stdin=json.dumps(payload))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def promql_parse(exprs: list[str]) -> list[dict[str, list[Any]]]:
    """Parse with Prometheus' Lezer grammar: per expression, syntax-error offsets and metrics."""
    result: list[dict[str, list[Any]]] = _node(
        PROMQL_CHECK, "the PromQL grammar (@prometheus-io/lezer-promql)", exprs
    )
    return result


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Errors of a custom resource under the validators generated from its upstream CRD."""
    (errors,) = _node(CRD_CHECK, "the CRD validators (@kubernetes-models/*)", [doc])
    return [str(e) for e in errors]


@cache
def _crd_validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# Custom resources, checked twice (no cluster to ask): against the upstream CRD's schema
# (crd_errors: types, enums, required fields; unknown fields pass, as the API server prunes
# them) and against the strict schemas in tests/deploy/schemas, written for the fields the
# chart sets, where a misspelt or misplaced field fails as `kubectl apply` (strict field
# validation) would fail it.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Validate one manifest: Kubernetes' strict schemas (every version in KUBE_VERSIONS) for
    built-in kinds, the upstream CRD's and the strict vendored schema for custom ones; unknown
    kinds are an error."""
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate", FROM_PYPROJECT)
    key = (doc.get("apiVersion"), doc.get("kind"))
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if key in CRD_SCHEMAS:
        validator = _crd_validator(CRD_SCHEMAS[key])  # type: ignore[index]
        return [f"{where} (CRD): {e}" for e in crd_errors(doc)] + [
            f"{where} (strict): {'/'.join(map(str, e.absolute_path))}: {e.message}"
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
