"""Spawned worker processes, the one mechanism behind the solver pool (``solver_pool``) and the
service's lower-priority work for itself (``background``).

Both need the same things, and had each grown their own copy of them: a process pool started
lazily at the first call (``spawn``: the server has threads and may hold CUDA, neither of which
survives ``fork``), dropped when a worker dies so that the next call starts a new one, workers
that end when their server is killed outright, every pool of the process ended at the app's
shutdown, and a call in flight ended on demand. What differs is policy, left to the callers:
how many workers, at which ``nice``, and what a broken pool means (the solver pool reruns the
call in a thread; the background worker lets its caller decide, since an abandoned
assessment must not run again).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")
W = TypeVar("W", bound="WorkerProcesses")


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """In a worker process: exit once the process that started it is gone.

    A server killed outright (SIGKILL, the OOM killer) leaves its pool's workers waiting on a
    pipe nobody writes, each holding its imports' memory: a day of test servers killed this
    way left about 60 on this machine, ~150 MB each (2026-11-29). In a container they die
    with it; on a host nothing else would end them. A thread polls the parent's pid (not
    ``PR_SET_PDEATHSIG``, which fires when the starting *thread* ends). ``parent`` is the pid
    the starting process passed, never read here: a parent killed while its worker started
    reads as pid 1, which the watch would then wait on for good (seven such workers were left
    by one `make test`, 2026-11-29).
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _start(nice: int, parent: int) -> None:
    exit_with_parent(parent)
    if nice:
        # The whole worker process: every thread it starts (BLAS's) inherits it. Never above
        # its server's own priority: a server already at a higher nice (a niced `make check`,
        # run as root, which may lower a nice) would otherwise hand its background work the
        # CPU before its requests.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))


class WorkerProcesses:
    """Runs picklable module-level functions in ``size`` spawned processes at ``nice``."""

    def __init__(self, size: int, nice: int = 0) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0..19, got {nice}")
        self.size = size
        self.nice = nice
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.restarts = 0
        """Pools replaced because a worker died (not those ended by ``abandon``)."""

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.size,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start,
                    initargs=(self.nice, os.getpid()),
                )
            return self._pool

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker. If a worker died or was abandoned under the
        call, ``BrokenProcessPool`` is raised and the next call starts a new pool."""
        pool = self._executor()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, functools.partial(fn, *args, **kwargs)
            )
        except BrokenProcessPool:
            self._drop(pool)
            raise

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not pool:
                return  # abandoned, or already replaced by another call
            self._pool = None
            self.restarts += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def abandon(self, *, wait: bool = True) -> None:
        """End the workers and whatever they run (the next call starts new ones); ``wait``:
        until their processes are reaped (``False`` from the event loop, which must not
        block)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor cannot cancel a running call (3.14 adds terminate_workers()):
        # its workers are ended directly, and the executor then reports the pool broken.
        for proc in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(OSError):
                proc.terminate()
        pool.shutdown(wait=wait, cancel_futures=True)

    def close(self) -> None:
        """Let the calls in flight finish, then end the workers."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_shared: dict[tuple[type[WorkerProcesses], int, int], WorkerProcesses] = {}
_shared_lock = threading.Lock()


def shared(kind: type[W], size: int, nice: int = 0) -> W:
    """The process's one ``kind`` of ``size`` workers at ``nice``: every request and every
    learner of the process share it."""
    with _shared_lock:
        key = (kind, size, nice)
        if key not in _shared:
            _shared[key] = kind(size=size, nice=nice)
        found = _shared[key]
    assert isinstance(found, kind)
    return found


def close_shared() -> None:
    """End every shared pool's workers (the app's shutdown). Ended, not waited for: a fit or
    an assessment still running has nobody left to answer."""
    with _shared_lock:
        pools = list(_shared.values())
        _shared.clear()
    for pool in pools:
        pool.abandon()
