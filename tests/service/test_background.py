"""The background worker (``service.runtime.background``): `auto`'s assessments in their own
process at a lower CPU priority, ended on demand."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import anyio
import numpy as np
import pytest

from service.runtime.background import BackgroundWorker, shared_worker
from solver import trust as trust_rules
from tests.support import slow_fits


def _nice() -> tuple[int, int]:
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)


async def test_calls_run_in_another_process_at_the_configured_priority() -> None:
    worker = BackgroundWorker(7)
    try:
        pid, nice = await worker.run(_nice)
        assert pid != os.getpid() and nice == max(7, os.getpriority(os.PRIO_PROCESS, 0))
        assert await worker.run(_nice) == (pid, nice)  # one process, started once
    finally:
        worker.abandon()


async def test_abandon_ends_a_running_call_and_the_next_call_starts_a_new_worker() -> None:
    worker = BackgroundWorker(10)
    first, _ = await worker.run(_nice)
    t0 = time.monotonic()
    call = asyncio.ensure_future(worker.run(time.sleep, 60))
    await asyncio.sleep(0.5)
    await anyio.to_thread.run_sync(worker.abandon)
    with pytest.raises(BrokenProcessPool):
        await call
    assert time.monotonic() - t0 < 30  # not the 60 s call's end
    second, _ = await worker.run(_nice)
    assert second != first and worker.restarts == 0  # abandoned, not died: no restart counted
    worker.abandon()


def test_nice_outside_unix_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"nice must be 0\.\.19"):
        BackgroundWorker(20)


async def test_one_registry_shares_each_kind_and_the_shutdown_ends_them_all() -> None:
    # The solver pool and the background worker are the same mechanism (processes.py): one
    # of each per process and setting, and the app's shutdown ends every one it started.
    from service.runtime.processes import close_shared
    from service.runtime.solver_pool import SolverPool, shared_pool

    worker, pool = shared_worker(9), shared_pool(1)
    assert worker is shared_worker(9) and worker is not shared_worker(8)
    assert isinstance(pool, SolverPool) and pool is shared_pool(1)
    pids = [(await worker.run(_nice))[0], await pool.run(os.getpid)]
    await anyio.to_thread.run_sync(close_shared)
    assert shared_worker(9) is not worker and shared_pool(1) is not pool
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


async def test_a_cancelled_assessment_does_not_keep_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shutdown or a lost lock cancels the cycle: the bootstrap nobody will read is ended,
    # not left holding the one worker (or a core) for the next assessment.
    from tests.service.test_learning import KEY, MODEL, TEMPLATE, N, bias_shape, learner, run

    lr = learner(tmp_path, auto_explore_rate=0.0, auto_fit_nice=10)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for _ in range(6):
        assert lr.record(d, *run(bias_shape("recency", 5), rng))
    monkeypatch.setattr(trust_rules, "assess", slow_fits.slow_assess)
    worker = shared_worker(10)
    pid, _ = await worker.run(_nice)
    with anyio.move_on_after(0.5):
        await lr.cycle(KEY)
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "moi"  # nothing stored
    assert (await worker.run(_nice))[0] != pid  # the worker running it was ended
    lr.close()


_ORPHAN_PARENT = """
import asyncio, os, sys, time
from service.runtime.background import BackgroundWorker
from service.runtime.solver_pool import SolverPool

async def main():
    background, pool = BackgroundWorker(10), SolverPool(1)
    pids = [await background.run(os.getpid), await pool.run(os.getpid)]
    print(*pids, flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def test_workers_exit_when_their_server_is_killed() -> None:
    # SIGKILL (the OOM killer) runs no shutdown: the workers must end by themselves, not
    # linger holding their imports' memory.
    import signal
    import subprocess
    import sys

    from tests.app.processes import ROOT

    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_worker_whose_parent_died_before_it_started_exits() -> None:
    # The parent's pid comes from the parent: read in the worker, a parent killed while the
    # worker started reads as pid 1, and the watch would wait on pid 1 for good.
    import subprocess
    import sys

    from tests.app.processes import ROOT

    code = (
        "import time; from service.runtime.processes import exit_with_parent; "
        "exit_with_parent(parent=2**22 + 1, poll_s=0.1); time.sleep(60)"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30, check=False)
    assert done.returncode == 0 and time.monotonic() - t0 < 20
