"""MoI's fit in worker processes: the service's CPU work on more than one core (issue 57).

At GPU speed the service, not the engine, bounds throughput: with a small scorer on an H100
the engine waited half the time while one Python process tokenised, fitted and answered
(docs/benchmarks.md, "Keeping a GPU busy"). The fit with its jackknife is the largest share of
that work and is pure numpy/scipy on small arrays: Python-bound, so threads run it one at a
time under the GIL. Worker processes run fits side by side, beside the event loop that
tokenises and answers. Arguments and results are a few kilobytes (a design, its scores, a
``Fit``), so a call costs well under a millisecond of pickling.

Processes are started with ``spawn``, once, at the first fit (``service.runtime.processes``,
shared with the background worker). A worker that dies (out of memory, killed)
breaks the pool: that call runs in a thread instead and the next call starts a new pool, so a
request never fails for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import anyio.to_thread

from service.runtime.cpus import process_budget
from service.runtime.processes import WorkerProcesses, shared

log = logging.getLogger(__name__)

T = TypeVar("T")


def default_workers(cpus: float | None = None) -> int:
    """One process per CPU the process may use beyond the event loop's (``service.runtime.cpus``:
    its affinity and cgroup quota, or ``cpus``), at least one, at most eight."""
    return process_budget(cpus).solver_processes


class SolverPool(WorkerProcesses):
    """Runs picklable module-level functions in ``size`` spawned processes; a call whose worker
    died runs in a thread instead."""

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker process (a thread if the pool broke)."""
        try:
            return await super().run(fn, *args, **kwargs)
        except BrokenProcessPool:
            log.warning(
                "a solver worker died: this fit runs in a thread, the next starts a new pool"
            )
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def shared_pool(workers: int | None, cpus: float | None = None) -> SolverPool | None:
    """The process's pool of that size (``None``: ``default_workers(cpus)``; 0: no pool, fits
    run in threads). One per process, so every request shares the same workers."""
    n = process_budget(cpus).pool_size(workers)
    return None if n == 0 else shared(SolverPool, n)
