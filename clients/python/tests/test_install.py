"""The client's wheel installs light: in its own virtualenv (scripts/client-venv.sh, which
these tests run in) the adapters import, and neither the server nor its heavy dependencies
can be imported."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from servers import SERVER_PYTHON


def test_the_tests_import_the_installed_wheel_not_the_checkout() -> None:
    import rag_reorder

    installed = Path(rag_reorder.__file__).resolve()
    assert installed.is_relative_to(Path(sys.prefix).resolve()), installed
    dist = importlib.metadata.distribution("rag-reorder-client")
    # An editable install records its source folder; a wheel install has no such entry.
    assert "editable" not in (dist.read_text("direct_url.json") or "")


def test_only_httpx_at_run_time_and_the_frameworks_behind_extras() -> None:
    requires = importlib.metadata.requires("rag-reorder-client") or []
    base = [r for r in requires if "extra ==" not in r]
    assert [r.split(">")[0].split("<")[0].strip() for r in base] == ["httpx"]
    extras = importlib.metadata.metadata("rag-reorder-client").get_all("Provides-Extra") or []
    assert {"langchain", "llamaindex", "haystack"} <= set(extras)


def test_the_server_and_its_dependencies_are_not_importable_here(tmp_path: Path) -> None:
    # -I: isolated from the working directory and PYTHON* variables, as an application is.
    probe = (
        "import importlib.util as u\n"
        "import rag_reorder, rag_reorder.langchain, rag_reorder.llama_index, rag_reorder.haystack\n"
        "print(','.join(m for m in ('torch', 'fastapi', 'transformers', 'uvicorn', 'app',"
        " 'service', 'solver') if u.find_spec(m) is not None))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "", f"importable beside the client: {out.stdout}"


def test_the_client_and_the_server_have_one_version() -> None:
    import rag_reorder

    server = subprocess.run(
        [
            SERVER_PYTHON,
            "-c",
            "import importlib.metadata as m; print(m.version('rag-reorder'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    client = importlib.metadata.version("rag-reorder-client")
    assert rag_reorder.__version__ == client == server
