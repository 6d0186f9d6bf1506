"""The environment ``bench/server_process.start_server`` gives the server it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.server_process import child_env


def test_child_env_keeps_inherited_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the lent GPU machine the service's packages are reachable only through PYTHONPATH
    # (/tmp/site); a server started with PYTHONPATH=root alone could not import pydantic.
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_inherited_path.py").write_text("VALUE = 41\n")
    root = tmp_path / "root"
    (root / "served_code").mkdir(parents=True)
    (root / "served_code" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    env = child_env(root, {"RAG_REORDER_BACKEND": "transformers"})
    assert env["PYTHONPATH"].split(":") == [str(root), str(site)]
    assert env["RAG_REORDER_BACKEND"] == "transformers"
    # Both import in a real child process: the served code from root, the package from site.
    code = "import served_code, only_on_inherited_path as m; print(m.VALUE)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "41"


def test_child_env_without_pythonpath(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert child_env(tmp_path, {})["PYTHONPATH"] == str(tmp_path)
