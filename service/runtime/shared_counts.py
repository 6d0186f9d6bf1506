"""Admission's in-flight counts of every worker process of one server, in one shared file.

With ``workers`` > 1 (``entrypoints.workers``) several HTTP processes feed one engine process. Each
worker's admission must see the engine's whole queue, not its own share of it: a worker that
counted only its own requests would admit N times the work the budgets and deadlines allow.
Each worker writes its own counts (requests, prompt tokens, of which answer budget) to its
slot of a small memory-mapped file; every check reads the sum of all slots. One writer per
slot, so no lock: an aligned 8-byte store is atomic on every platform CPython runs on, and a
reader sees each slot either before or after a change. Two workers may still admit at the
same instant against the same sum (the check and the add are not one step across
processes): the overshoot is bounded by one request per worker. A restarted worker clears
its slot at start, so the requests its predecessor held leave the queue with it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

FIELDS = 3
"""Per slot: requests, prompt tokens (answer budget included), answer-budget tokens."""
_CELL = 8  # bytes of one int64 count


def create(path: Path, slots: int) -> None:
    """Create (or zero) the counts file for ``slots`` workers.

    Raises:
        ValueError: ``slots`` < 1.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    path.write_bytes(bytes(slots * FIELDS * _CELL))


class SharedCounts:
    """One worker's view of the counts file: its own slot to write, every slot to read."""

    def __init__(self, path: Path, slot: int) -> None:
        """Map ``path`` (made by ``create``) and clear ``slot``.

        Raises:
            ValueError: ``slot`` is outside the file's slots.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._counts = np.frombuffer(self._map, dtype=np.int64).reshape(-1, FIELDS)
        if not 0 <= slot < self._counts.shape[0]:
            raise ValueError(f"slot {slot} outside the {self._counts.shape[0]} slots of {path}")
        self.slot = slot
        self.set(0, 0, 0)

    @property
    def slots(self) -> int:
        return int(self._counts.shape[0])

    def set(self, requests: int, tokens: int, new_tokens: int) -> None:
        """This worker's counts now (it alone writes its slot)."""
        row = self._counts[self.slot]
        row[0], row[1], row[2] = requests, tokens, new_tokens

    def totals(self) -> tuple[int, int, int]:
        """Requests, tokens and answer-budget tokens in flight in every worker together."""
        sums = self._counts.sum(axis=0)
        return int(sums[0]), int(sums[1]), int(sums[2])
