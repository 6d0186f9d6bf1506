"""MoI's fit in worker processes: the service's CPU work on more than one core (issue 57).

At GPU speed the service, not the engine, bounds throughput: with a small scorer on an H100
the engine waited half the time while one Python process tokenised, fitted and answered
(docs/benchmarks.md, "Keeping a GPU busy"). The fit with its jackknife is the largest share of
that work and is pure numpy/scipy on small arrays: Python-bound, so threads run it one at a
time under the GIL. Worker processes run fits side by side, beside the event loop that
tokenises and answers. Arguments and results are a few kilobytes (a design, its scores, a
``Fit``), so a call costs well under a millisecond of pickling.

Processes are started with ``spawn`` (the server has threads and may hold CUDA, neither of
which survives ``fork``), once, at the first fit. A worker that dies (out of memory, killed)
breaks the pool: that call runs in a thread instead and the next call starts a new pool, so a
request never fails for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import anyio.to_thread

from service.runtime.background import exit_with_parent
from service.runtime.cpus import process_budget

log = logging.getLogger(__name__)

T = TypeVar("T")


def default_workers(cpus: float | None = None) -> int:
    """One process per CPU the process may use beyond the event loop's (``service.runtime.cpus``:
    its affinity and cgroup quota, or ``cpus``), at least one, at most eight."""
    return process_budget(cpus).solver_processes


class SolverPool:
    """Runs picklable module-level functions in ``workers`` spawned processes."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=exit_with_parent,  # not left behind by a killed server
                )
            return self._pool

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker process (a thread if the pool broke)."""
        call = functools.partial(fn, *args, **kwargs)
        pool = self._executor()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
                    self.restarts += 1
            pool.shutdown(wait=False, cancel_futures=True)
            log.warning(
                "a solver worker died: this fit runs in a thread, the next starts a new pool"
            )
            return await anyio.to_thread.run_sync(call)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_shared: dict[int, SolverPool] = {}
_shared_lock = threading.Lock()


def shared_pool(workers: int | None, cpus: float | None = None) -> SolverPool | None:
    """The process's pool of that size (``None``: ``default_workers(cpus)``; 0: no pool, fits
    run in threads). One per process, so every request shares the same workers."""
    n = process_budget(cpus).pool_size(workers)
    if n == 0:
        return None
    with _shared_lock:
        if n not in _shared:
            _shared[n] = SolverPool(n)
        return _shared[n]


def close_shared() -> None:
    """Stop every shared pool's workers (the app's shutdown)."""
    with _shared_lock:
        pools = list(_shared.values())
        _shared.clear()
    for pool in pools:
        pool.close()
