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
per process and nice level (``service.runtime.processes``, as the solver pool's).
``abandon()`` ends a call in flight by ending the worker, which the next call starts again: a
shutdown does not wait seconds for a bootstrap nobody will read, and no abandoned assessment
keeps burning a core.
"""

from __future__ import annotations

from service.runtime.processes import WorkerProcesses, shared


class BackgroundWorker(WorkerProcesses):
    """One spawned process at ``nice``. A call whose worker died or was abandoned raises
    ``BrokenProcessPool``; whether to try again is the caller's (an abandoned assessment must
    not run again)."""

    def __init__(self, nice: int = 10, size: int = 1) -> None:
        if size != 1:
            raise ValueError(f"a background worker is one process, got {size}")
        super().__init__(1, nice)


def shared_worker(nice: int) -> BackgroundWorker:
    """The process's background worker at ``nice`` (one per level: every learner shares it)."""
    return shared(BackgroundWorker, 1, nice)
