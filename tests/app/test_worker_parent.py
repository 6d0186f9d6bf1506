"""The supervisor's children end with it, including one whose supervisor died before the
child armed its parent-death signal (``entrypoints.workers._die_with_parent``); a hung one is
killed by its stopped heartbeat."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from entrypoints.workers import _beating, _Child, _die_with_parent, _kill_if_hung, _start_worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def test_a_child_whose_supervisor_is_already_gone_ends_before_it_runs() -> None:
    # The supervisor's pid as passed before the fork, and the child's parent then differ
    # (here: a pid that is not this process): the child exits instead of serving unwatched.
    proc = subprocess.run(
        [sys.executable, "-c", "print('served')"],
        preexec_fn=functools.partial(_die_with_parent, os.getpid() + 10**6),
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert proc.returncode == 1 and proc.stdout == b""


def test_a_child_of_a_live_supervisor_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "print('served')"],
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout == b"served\n"


def test_a_worker_whose_heartbeat_stops_is_killed_and_one_that_beats_is_not(
    tmp_path: Path,
) -> None:
    # The supervisor's side of the hang check (entrypoints.workers, module docstring), on a real
    # child: checked from its first beat, killed once the counter stands still past the
    # timeout.
    beats = os.open(tmp_path / "heartbeats", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(beats, 8)
    worker = _Child("worker 0", [sys.executable, "-c", "import time; time.sleep(60)"], slot=0)
    _start_worker(worker, dict(os.environ), beats)
    assert worker.proc is not None
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # no beat yet: starting, not hung
            _kill_if_hung(worker, beats, 0.2)
            time.sleep(0.05)
        assert worker.proc.poll() is None
        for n in range(1, 21):  # beating every 0.05 s: alive
            os.pwrite(beats, struct.pack("<Q", n), 0)
            _kill_if_hung(worker, beats, 0.2)
            time.sleep(0.05)
        assert worker.proc.poll() is None
        stopped = time.monotonic()
        while worker.proc.poll() is None and time.monotonic() < stopped + 5:
            _kill_if_hung(worker, beats, 0.2)
            time.sleep(0.05)
        assert worker.proc.returncode == -signal.SIGKILL
        assert 0.2 <= time.monotonic() - stopped < 2.0
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
        os.close(beats)


def test_a_workers_event_loop_beats_while_its_lifespan_runs(tmp_path: Path) -> None:
    path = tmp_path / "heartbeats"
    path.write_bytes(bytes(16))

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield

    async def main() -> tuple[int, int]:
        async with _beating(lifespan, path, 1, 0.02)(None):
            await asyncio.sleep(0.3)
            during = struct.unpack("<Q", path.read_bytes()[8:])[0]
        await asyncio.sleep(0.1)
        return during, struct.unpack("<Q", path.read_bytes()[8:])[0]

    during, after = asyncio.run(main())
    assert during >= 5 and after == during  # slot 1 only; none once the lifespan ended
    assert path.read_bytes()[:8] == bytes(8)
