"""State files are replaced in one step and readable by whoever the umask lets read them: a
profile on a shared volume must open for a replica or sidecar running as another user."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.state.files import write_atomic
from service.state.profile_store import ProfileStore


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_stored_profile_takes_the_umask_not_0600(tmp_path: Path, umask_022: None) -> None:
    store = ProfileStore(tmp_path)
    put = {"model": "m", "template": "qa_default", "identification": "full", "runs": 4}
    store.put(coefficients=[0.5, 0.3, 0.2], prompts=20, r2=0.9, source="test", **put)
    (written,) = tmp_path.glob("*.json")
    assert _mode(written) == 0o644
    os.umask(0o077)  # an operator who wants private files says so
    store.put(coefficients=[0.6, 0.3, 0.1], prompts=20, r2=0.9, source="test", **put)
    assert _mode(written) == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "p.json"
    write_atomic(target, "old")

    with pytest.raises(TypeError):  # the write itself fails (not text)
        write_atomic(target, 42)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_every_state_writer_goes_through_write_atomic() -> None:
    # One way to write state files: the stores call write_atomic, never mkstemp (0600).
    service = Path(__file__).resolve().parents[2] / "service"
    for path in sorted(p for p in service.rglob("*.py") if p.name != "files.py"):
        assert "mkstemp" not in path.read_text(), path
