"""The packages are the layers (issue 91): the ways in (``entrypoints``) above the HTTP edge
(``app``) and the offline tooling, the serving runtime (``serving``) between the HTTP edge and
the domain. Checked from the source, beside lint-imports' contracts: every top-level package is
known to the build, the type check and the contracts, the command line starts in
``entrypoints``, and the HTTP edge neither launches a server nor runs the engine."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("entrypoints", "app", "serving", "offline", "service", "solver")


def _imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (its path) and the modules it imports by absolute name."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_every_package_is_built_type_checked_and_under_the_contracts() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "eval"}
    assert on_disk == set(PACKAGES)
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    linter = PYPROJECT["tool"]["importlinter"]
    acyclic = next(c for c in linter["contracts"] if c["type"] == "acyclic_siblings")
    for package in PACKAGES:
        assert f"{package}*" in include, package
        assert package in PYPROJECT["tool"]["mypy"]["packages"], package
        assert package in linter["root_packages"], package
        assert package in acyclic["ancestors"], package
    layers = next(c for c in linter["contracts"] if c["type"] == "layers" and "containers" not in c)
    assert layers["layers"] == ["entrypoints", "app | offline", "serving", "service", "solver"]


def test_the_command_line_starts_in_entrypoints() -> None:
    assert PYPROJECT["project"]["scripts"]["rag-reorder"] == "entrypoints.cli:main"
    assert (ROOT / "entrypoints" / "__main__.py").is_file()


def test_the_http_edge_neither_launches_a_server_nor_runs_the_engine() -> None:
    """No module of ``app`` starts uvicorn or processes, reaches the offline commands or the
    ways in, or builds the engine (``serving.supervisor`` loads, warms up and watches it)."""
    kept_out = ("uvicorn", "offline", "multiprocessing", "subprocess", "entrypoints")
    kept_out += ("service.backends.factory",)
    for module, names in _imports("app").items():
        found = {n for n in names for out in kept_out if n == out or n.startswith(f"{out}.")}
        assert not found, (module, found)
