"""scripts/device/gpu_leave_check.py, the evidence that the GPU bundle may leave a package behind,
on a wheel built here: what runs at import is followed, what a function or a guard hides is
not, and an entry that would import a left-behind module fails the check."""

from __future__ import annotations

import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

MODULES = {
    "eng/__init__.py": "from . import core\n",
    # Everything here runs at import but the guarded, the type-only and the function's.
    "eng/core.py": (
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from eng import util\n"
        "try:\n"
        "    import cutlass\n"
        "except ImportError:\n"
        "    cutlass = None\n"
        "if TYPE_CHECKING:\n"
        "    import cutlass.cute\n"
        "class Runner:\n"
        "    def warm(self):\n"
        "        import cutlass\n"
        "def moe():\n"
        "    from eng.kernels import router\n"
    ),
    "eng/util.py": "X = 1\n",
    "eng/kernels/__init__.py": "",
    # Reached only through moe()'s import: a lazy path, listed, not fatal.
    "eng/kernels/router.py": "import cutlass\n",
    # Reached at import from its entry: the bundle would break.
    "eng/fa4.py": "if True:\n    from .kernels import router\n",
    "eng-0.1.dist-info/METADATA": "Name: eng\n",
}


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(ROOT / "scripts" / "device" / "gpu_leave_check.py", "gpu_leave_check")


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    with zipfile.ZipFile(tmp_path / "eng-0.1-py3-none-any.whl", "w") as zf:
        for name, text in MODULES.items():
            zf.writestr(name, text)
    return tmp_path


def test_guarded_type_only_and_function_imports_do_not_count(
    check: ModuleType, wheels: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources = check.read_sources(sorted(wheels.glob("*.whl")))
    assert "eng.kernels" in sources and not any("dist-info" in m for m in sources)
    report = check.walk(sources, ["eng.core"], ["cutlass"], ["eng"])
    assert report.unguarded == []
    assert set(report.reached) == {"eng", "eng.core", "eng.util"}
    listed = {(m, imp.line, imp.function, path) for m, imp, path in report.in_functions}
    assert listed == {
        ("eng.core", 12, "warm", ()),
        ("eng.core", 14, "moe", ("eng.kernels.router", "cutlass")),
    }
    assert check.main(["--wheels", str(wheels), "--entry", "eng.core", "--packages", "eng"]) == 0
    out = capsys.readouterr().out
    assert (
        "the entries reach 3" in out and "eng.core:14 in moe(): eng.kernels.router > cutlass" in out
    )


def test_an_entry_that_imports_a_left_module_at_import_time_fails(
    check: ModuleType, wheels: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Through a relative import inside a module-level `if`, and a package's __init__ first.
    argv = ["--wheels", str(wheels), "--entry", "eng.fa4", "--leave", "cutlass"]
    assert check.main(argv) == 1
    out = capsys.readouterr().out
    assert "UNGUARDED eng.kernels.router:1 imports cutlass, via eng.fa4 > eng.kernels.router" in out


def test_no_wheels_is_an_error_that_says_how_to_build_them(
    check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check.main(["--wheels", str(tmp_path)]) == 2
    assert "scripts/device/gpu-bundle.sh" in capsys.readouterr().err
