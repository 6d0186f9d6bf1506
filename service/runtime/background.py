"""The service's work for itself (`auto`'s trust and drift assessments) in one spawned process
at a lower CPU priority.

It used to run on a thread of this process at nice 19. Two things were wrong with that, both
measured beside busy processes on a 2-core machine (``bench/background_priority.py``,
docs/operations.md, "Work the service does for itself"):

- **Priority inversion through the GIL.** The thread held the interpreter lock while it ran
  Python (the bootstrap's optimiser loop); preempted by any busier task, it kept the lock,
  and the event loop serving requests waited for a thread the OS ran last.
- **Starved by neighbours.** Nice 19 yields to every process of the node, not only to this
  service's request work: beside two busy neighbours an assessment of one second took over two
  minutes, so a shared node kept `auto` learning, and its drift watch idle, for good.

A process has its own interpreter lock, so the event loop never waits for it, and ``nice``
(``RAG_REORDER_AUTO_FIT_NICE``, 10 by default) still gives request work the CPU first while
leaving the assessment a share no neighbour can take. Started with ``spawn`` (the server has
threads and may hold CUDA, neither of which survives ``fork``), once, at the first call, one
per process and nice level. ``abandon()`` ends a call in flight by ending the worker, which the
next call starts again: a shutdown does not wait seconds for a bootstrap nobody will read, and
no abandoned assessment keeps burning a core.
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


def exit_with_parent(poll_s: float = 1.0) -> None:
    """In a worker process: exit once the process that started it is gone.

    A server killed outright (SIGKILL, the OOM killer) leaves its pool's workers waiting on a
    pipe nobody writes, each holding its imports' memory: a day of test servers killed this
    way left about 60 on this machine, ~150 MB each (2026-11-29). In a container they die
    with it; on a host nothing else would end them. A thread polls the parent's pid (not
    ``PR_SET_PDEATHSIG``, which fires when the starting *thread* ends).
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _start(nice: int) -> None:
    exit_with_parent()
    # The whole worker process: every thread it starts (BLAS's) inherits it.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


class BackgroundWorker:
    """Runs picklable module-level functions in one spawned process at ``nice``."""

    def __init__(self, nice: int) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0..19, got {nice}")
        self.nice = nice
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start,
                    initargs=(self.nice,),
                )
            return self._pool

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the worker. If the worker died or was abandoned under
        the call, ``BrokenProcessPool`` is raised and the next call starts a new one (whether
        to try again is the caller's: an abandoned call must not run again)."""
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
                return
            self._pool = None
            self.restarts += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def abandon(self, *, wait: bool = True) -> None:
        """End the worker and whatever it runs (the next call starts a new one); ``wait``:
        until its process is reaped (``False`` from the event loop, which must not block)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor cannot cancel a running call (3.14 adds terminate_workers()):
        # its worker is ended directly, and the executor then reports the pool broken.
        for proc in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(OSError):
                proc.terminate()
        pool.shutdown(wait=wait, cancel_futures=True)


_shared: dict[int, BackgroundWorker] = {}
_shared_lock = threading.Lock()


def shared_worker(nice: int) -> BackgroundWorker:
    """The process's background worker at ``nice`` (one per level: every learner shares it)."""
    with _shared_lock:
        if nice not in _shared:
            _shared[nice] = BackgroundWorker(nice)
        return _shared[nice]


def close_shared() -> None:
    """End every shared background worker (the app's shutdown)."""
    with _shared_lock:
        workers = list(_shared.values())
        _shared.clear()
    for worker in workers:
        worker.abandon()
