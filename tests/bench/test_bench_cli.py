"""The benchmarks' shared command line (``bench/report.py``), and that every benchmark script
still starts: a benchmark is run rarely, by hand or on a lent GPU, so a broken import or
option would otherwise surface only when its device time is already being spent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]
# Helpers imported by the scripts, not scripts themselves.
LIBRARIES = {"__init__", "report", "server_process", "overload", "workload"}
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if p.stem not in LIBRARIES)

DOC = """Peak memory of each phase,
measured side by side.

Usage: python -m bench.x
"""


def test_parser_defaults_and_description() -> None:
    ap = report.parser("memory_phases", DOC, data=True)
    args = ap.parse_args([])
    assert args.out == str(ROOT / "results" / "bench" / "memory_phases.json")
    assert args.data == str(ROOT.parent / "shared" / "data" / "nq_open_dev.jsonl")
    # The whole first paragraph, not its first line cut mid-sentence.
    assert ap.description == "Peak memory of each phase, measured side by side."
    assert ap.prog == "python -m bench.memory_phases"


def test_parser_without_data_has_no_data_option() -> None:
    ap = report.parser("solver", DOC)
    with pytest.raises(SystemExit):
        ap.parse_args(["--data", "x.jsonl"])


@pytest.mark.parametrize("kind", ["function", "coroutine"])
def test_main_runs_and_writes_to_out(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "deep" / "result.json"
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--out", str(out), "--n", "3"])
    ap = report.parser("x", DOC)
    ap.add_argument("--n", type=int, default=1)

    def run(args: Any) -> dict[str, Any]:
        return {"n": args.n, "kind": kind}

    async def arun(args: Any) -> dict[str, Any]:
        return run(args)

    assert report.main(ap, run if kind == "function" else arun) == 0
    assert json.loads(out.read_text()) == {"n": 3, "kind": kind}


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Every script's ``--help``: exit code, stdout, stderr. Run in one process's forks
    (``help_driver.py``): the third-party imports once, each script's own imports in a fresh
    child."""
    out = tmp_path_factory.mktemp("help")
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("help_driver.py")), str(out)]
        + [str(p) for p in SCRIPTS],
        cwd=ROOT,
        timeout=1200,
        check=True,
    )
    results: dict[str, tuple[int, str, str]] = {}
    for p in SCRIPTS:
        rc, stdout, stderr = ((out / f"{p.stem}.{s}").read_text() for s in ("rc", "out", "err"))
        results[p.stem] = (int(rc), stdout, stderr)
    return results


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_script_starts(
    script: Path, helps: dict[str, tuple[int, str, str]]
) -> None:
    # --help imports everything the script imports and builds its parser, and measures nothing.
    code, stdout, stderr = helps[script.stem]
    assert code == 0, stderr[-2000:]
    assert "--out" in stdout
    # A script that reads the development questions takes their path: the lent GPU has no
    # ../shared (2026-11-27: bench/load.py read it unconditionally and every load stage failed).
    source = script.read_text()
    if "DATA" in source or "data=True" in source:
        assert "--data" in stdout


def test_the_benchmarks_import_no_circle() -> None:
    # bench/ is outside the import contracts (lint-imports reads the product's packages): the
    # scripts' own imports of each other, lazy ones included, must form no cycle.
    import ast

    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "bench").glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "bench" and len(parts) > 1:
                    found.add(parts[1])
                elif node.module == "bench":
                    found.update(a.name for a in node.names)
        edges[path.stem] = found & names

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(name for name in edges if reaches(name, name, {name}))
    assert not circles, f"bench modules in an import circle: {circles}"


def _product_packages() -> set[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}


def test_no_benchmark_is_named_like_a_product_package() -> None:
    # `python -m bench.x` puts the checkout's root first on the path, so `import service` is the
    # product's; a bench/service.py would be the same name to a reader and to a static import
    # map, which then cannot tell which one a script imports.
    packages = _product_packages()
    assert {"app", "service", "solver"} <= packages, packages
    clashes = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.stem in packages)
    assert not clashes, f"bench modules named like product packages: {clashes}"


def test_no_benchmark_patches_the_import_path_when_imported() -> None:
    # The product's packages are installed and bench is a package run with -m: a module-level
    # sys.path patch would only hide a misplaced import. An option that adds a folder while the
    # script runs (dense_runtimes.py's --ort-site, fit_cost.py's arms) is inside a function.
    import ast

    patched = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            text = ast.unparse(node)
            if "sys.path" in text and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                patched.append(f"{path.name}:{node.lineno}: {text.splitlines()[0]}")
    assert not patched, "\n".join(patched)
