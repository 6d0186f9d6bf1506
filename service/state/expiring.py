"""Records one request leaves for a later one, by key, for a bounded time, count and size.

What a later call needs of an earlier one (``POST /v1/feedback`` needs the served request:
``service.learning.generator_online.ServedRequests``) must reach whichever worker or replica
receives that call, and must not grow with traffic. Each store here holds JSON text records
by key, each for at most ``ttl_s``, at most ``max_records`` of them and ``max_bytes`` in all
(a record counts its key and text as UTF-8 plus ``OVERHEAD``): a put that would pass either
bound first drops the oldest records; a record larger than ``max_bytes`` alone is not kept.

- ``MemoryRecords``: this process's memory; the bounds are per process, and a record reaches
  only the process that put it (no state store: a library or test use).
- ``FolderRecords``: one SQLite file in the state folder (``FolderState.records``); the bounds
  are per folder: every worker of a host (and replicas that share the folder on a volume with
  working POSIX locks) puts into and reads the same records.
- ``service.state.redis_state.RedisRecords``: Redis (``RedisState.records``); the bounds
  are per deployment (key prefix), the time is Redis's own expiry.

Each is safe to call from several threads; every call but ``MemoryRecords``' blocks on I/O, so
callers on the event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, Protocol, cast

from service.errors import StateUnavailable

OVERHEAD = 256
"""Bytes counted per record beyond its key and text: the store's own bookkeeping (a Python
dict entry and its objects, an SQLite row and index entry, Redis's keys), so that many tiny
records cannot pass the byte bound's intent."""

Scope = Literal["process", "folder", "deployment"]


class ExpiringRecords(Protocol):
    """JSON text records by key, bounded in time, count and bytes (module docstring)."""

    scope: Scope
    """Who shares the records and the bounds: this process, the folder, or the deployment."""
    max_records: int
    max_bytes: int
    ttl_s: float

    def put(self, key: str, record: str) -> bool:
        """Keep ``record`` under ``key`` (replacing one held), the oldest going first to make
        room. Returns whether it is kept (``False``: larger than ``max_bytes`` alone, or the
        store cannot be reached; never raises)."""
        ...

    def get(self, key: str) -> str | None:
        """The record held under ``key`` (``None``: never put, expired or evicted).

        Raises:
            StateUnavailable: the store cannot be reached.
        """
        ...

    def take(self, key: str) -> str | None:
        """``get`` and ``forget`` at once: of callers racing for one key, one gets it.

        Raises:
            StateUnavailable: the store cannot be reached.
        """
        ...

    def forget(self, key: str) -> None:
        """Drop the record under ``key`` if held; never raises."""
        ...

    def held(self) -> tuple[int, int]:
        """``(records, bytes)`` held now, as the bounds count them.

        Raises:
            StateUnavailable: the store cannot be reached.
        """
        ...


def size_of(key: str, record: str) -> int:
    """What one record counts against ``max_bytes``."""
    return len(key.encode()) + len(record.encode()) + OVERHEAD


def digest(key: str) -> str:
    """A key as the shared stores name it: fixed length, whatever characters the key has."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class MemoryRecords:
    """``ExpiringRecords`` in this process's memory (module docstring).

    Args:
        max_records, max_bytes, ttl_s: the bounds (module docstring).
        clock: monotonic seconds (tests move it).
    """

    scope: Scope = "process"

    def __init__(
        self,
        max_records: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (put at, record, counted size), oldest first.
        self._kept: OrderedDict[str, tuple[float, str, int]] = OrderedDict()
        self._bytes = 0

    def put(self, key: str, record: str) -> bool:
        size = size_of(key, record)
        with self._lock:
            self._drop(key)
            if size > self.max_bytes or self.max_records <= 0:
                return False
            self._expire()
            while self._kept and (
                len(self._kept) >= self.max_records or self._bytes + size > self.max_bytes
            ):
                self._drop(next(iter(self._kept)))
            self._kept[key] = (self._clock(), record, size)
            self._bytes += size
            return True

    def get(self, key: str) -> str | None:
        with self._lock:
            self._expire()
            held = self._kept.get(key)
            return held[1] if held is not None else None

    def take(self, key: str) -> str | None:
        with self._lock:
            self._expire()
            held = self._kept.get(key)
            self._drop(key)
            return held[1] if held is not None else None

    def forget(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def held(self) -> tuple[int, int]:
        with self._lock:
            self._expire()
            return len(self._kept), self._bytes

    def _drop(self, key: str) -> None:
        held = self._kept.pop(key, None)
        if held is not None:
            self._bytes -= held[2]

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._kept:
            key, (at, _, _) = next(iter(self._kept.items()))
            if at > horizon:
                return
            self._drop(key)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY, at REAL NOT NULL, size INTEGER NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_at ON records (at);
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0), n INTEGER NOT NULL, bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS records_in AFTER INSERT ON records BEGIN
    UPDATE totals SET n = n + 1, bytes = bytes + NEW.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS records_out AFTER DELETE ON records BEGIN
    UPDATE totals SET n = n - 1, bytes = bytes - OLD.size WHERE id = 0;
END;
"""


class FolderRecords:
    """``ExpiringRecords`` in one SQLite file that every process on the folder opens (module
    docstring). SQLite's file locks serialise the processes' writes, so the bounds hold for
    the folder, not per process: the totals are kept in the file by triggers, and a put
    evicts the oldest rows in the same transaction as its insert. Times are wall-clock (the
    processes share no monotonic clock). A file SQLite cannot open or lock (a read-only or
    lock-less volume) counts as unreachable.

    Args:
        path: the SQLite file (created with its folder).
        max_records, max_bytes, ttl_s: the bounds (module docstring).
        clock: wall-clock seconds (tests move it).
    """

    scope: Scope = "folder"

    def __init__(
        self,
        path: Path,
        max_records: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, the file locked from its start (``IMMEDIATE``): a put's
        totals read and its insert see no other process's write between them."""
        with self._lock:
            db = self._open()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM records WHERE at <= ?", (self._clock() - self.ttl_s,))
                yield db
            except BaseException:
                db.rollback()
                raise
            db.commit()

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: transactions are begun explicitly (_write); the lock is
            # ours, so one connection serves every thread of this process.
            db = sqlite3.connect(
                self.path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
            # Records a later call may use, not data of record: a crash may lose the last
            # ones rather than every put wait for the disk.
            db.execute("PRAGMA synchronous = OFF")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def put(self, key: str, record: str) -> bool:
        size = size_of(key, record)
        try:
            with self._write() as db:
                db.execute("DELETE FROM records WHERE key = ?", (key,))
                if size > self.max_bytes or self.max_records <= 0:
                    return False
                while True:
                    n, held = db.execute("SELECT n, bytes FROM totals").fetchone()
                    if n == 0 or (n < self.max_records and held + size <= self.max_bytes):
                        break
                    db.execute(
                        "DELETE FROM records WHERE key = "
                        "(SELECT key FROM records ORDER BY at, rowid LIMIT 1)"
                    )
                db.execute(
                    "INSERT INTO records VALUES (?, ?, ?, ?)", (key, self._clock(), size, record)
                )
        except (sqlite3.Error, OSError):
            return False
        return True

    def get(self, key: str) -> str | None:
        try:
            with self._lock:
                row = (
                    self._open()
                    .execute(
                        "SELECT body FROM records WHERE key = ? AND at > ?",
                        (key, self._clock() - self.ttl_s),
                    )
                    .fetchone()
                )
        except (sqlite3.Error, OSError) as exc:
            raise _unreachable(self.path, exc) from None
        return cast("str", row[0]) if row is not None else None

    def take(self, key: str) -> str | None:
        try:
            with self._write() as db:
                row = db.execute("SELECT body FROM records WHERE key = ?", (key,)).fetchone()
                db.execute("DELETE FROM records WHERE key = ?", (key,))
        except (sqlite3.Error, OSError) as exc:
            raise _unreachable(self.path, exc) from None
        return cast("str", row[0]) if row is not None else None

    def forget(self, key: str) -> None:
        with contextlib.suppress(sqlite3.Error, OSError), self._write() as db:
            db.execute("DELETE FROM records WHERE key = ?", (key,))

    def held(self) -> tuple[int, int]:
        try:
            with self._write() as db:
                n, held = db.execute("SELECT n, bytes FROM totals").fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise _unreachable(self.path, exc) from None
        return int(n), int(held)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _unreachable(path: Path, exc: Exception) -> StateUnavailable:
    return StateUnavailable(f"the records in {path.name} cannot be read ({type(exc).__name__})")
