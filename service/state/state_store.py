"""Where the service keeps what it learns, behind one interface with two implementations.

What is kept: the bias profiles (``ProfileStore``), the sampled runs they are calibrated from
(``RunSpool``: the traffic sample and ``auto``'s learning and explore runs), the lock that
lets one replica at a time assess a learned profile (``Locks``), and records one request
leaves for a later one, bounded in time, count and bytes (``ExpiringRecords``: the served
requests ``POST /v1/feedback`` needs).

- **folder** (the default): files under ``profiles_path`` (and ``traffic_sample_dir``), as
  they always were. Replicas share them only through a volume every one of them mounts.
- **redis** (``state_url``; ``service.state.redis_state``): one Redis every replica reaches, for
  clusters without ReadWriteMany storage. A cache-like dependency: requests read profiles from
  memory and writes are queued and retried in the background, so a Redis that is down or slow
  never fails or holds up a request (docs/operations.md, "State in Redis").

``open_state(settings)`` picks one; both pass the same contract tests
(tests/service/test_state_store.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from service.state.expiring import ExpiringRecords, FolderRecords
from service.state.profile_store import ProfileStore, SnapshotProfileStore, profile_id
from service.state.traffic import RunSpool, SpoolName, TrafficSpool

if TYPE_CHECKING:
    from service.config.settings import Settings

log = logging.getLogger(__name__)


class Locks(Protocol):
    """Named locks with an expiry: a holder that dies does not block the others for longer
    than ``ttl_s``."""

    def acquire(self, name: str, ttl_s: float) -> str | None:
        """Take ``name`` if nobody holds it; returns the token that releases it, or ``None``
        (held elsewhere, or the store cannot be reached). Blocks briefly."""
        ...

    def release(self, name: str, token: str) -> None:
        """Give ``name`` back if ``token`` still holds it; never raises."""
        ...

    def refresh(self, name: str, ttl_s: float, token: str) -> bool:
        """Restart ``name``'s expiry if ``token`` still holds it; whether it does (``False``:
        it expired and another replica may hold it). A holder busy for longer than the
        expiry calls this every fraction of it. Never raises."""
        ...


class StateStore(Protocol):
    """The three things kept (module docstring) and the store's health."""

    kind: Literal["folder", "redis"]

    @property
    def profiles(self) -> ProfileStore:
        """The bias profiles (what requests read: from memory or a local file)."""
        ...

    @property
    def locks(self) -> Locks: ...

    @property
    def failures(self) -> Mapping[str, int]:
        """Operations that failed, by kind (``read``, ``write``, ``lock``)."""
        ...

    @property
    def pending(self) -> int:
        """Writes queued, not yet stored."""
        ...

    @property
    def dropped(self) -> int:
        """Queued writes dropped (the queue was full)."""
        ...

    def spool(self, name: SpoolName, max_runs: int, replica: str | None) -> RunSpool | None:
        """The spool ``name`` (``None``: this store keeps no such spool, e.g. the folder's
        traffic sample without ``traffic_sample_dir``: it then lives in memory only)."""
        ...

    def records(
        self, name: str, *, max_records: int, max_bytes: int, ttl_s: float
    ) -> ExpiringRecords:
        """The expiring records ``name`` (``service.state.expiring``), shared as the store is:
        the folder's by the processes on it, Redis's by every replica."""
        ...

    @property
    def up(self) -> bool:
        """Whether the store answered its last operation."""
        ...

    def start(self) -> None:
        """Begin background work (Redis: connect, load, write what is queued)."""
        ...

    def close(self) -> None:
        """Write what is queued (bounded wait) and stop; later writes are lost."""
        ...

    def wait_loaded(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the stored profiles are loaded; whether they are."""
        ...


class FolderLocks:
    """Locks as files ``<root>/<name>.lock`` holding their holder's token, created
    exclusively (``O_EXCL``); the holder refreshes the file's time while it works, so a file
    older than the expiry belongs to a holder that died (or hung) and is taken over.

    The takeover is atomic: the stale file is renamed to a name of the taker's own (a rename
    of one file succeeds once), then checked to be the very file found stale (same inode and
    time); a file another replica took or refreshed meanwhile is linked back, untouched. Then
    the lock is created exclusively as on a first take, so of replicas racing for an expired
    lock exactly one gets it (unlink-then-create let two both believe they held it).
    """

    def __init__(self, root: Path, replica: str) -> None:
        self.root = root
        self.replica = replica

    def path(self, name: str) -> Path:
        return self.root / f"{name}.lock"

    def acquire(self, name: str, ttl_s: float) -> str | None:
        path = self.path(name)
        token = f"{self.replica}-{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for _ in range(2):  # once more after breaking an expired lock
                if _create(path, token):
                    return token
                try:
                    seen = os.stat(path)
                except FileNotFoundError:
                    continue  # released since: take it
                if time.time() - seen.st_mtime <= ttl_s or not _break(path, seen):
                    return None
        except OSError as exc:
            log.warning("cannot take the lock %s: %s", path, exc)
        return None

    def release(self, name: str, token: str) -> None:
        path = self.path(name)
        with contextlib.suppress(OSError):
            # Not ours any more (it expired and another replica took it): leave it.
            if path.read_text() == token:
                path.unlink(missing_ok=True)

    def refresh(self, name: str, ttl_s: float, token: str) -> bool:
        del ttl_s  # every replica judges the file's age by its own expiry
        path = self.path(name)
        try:
            if path.read_text() != token:
                return False
            os.utime(path)
        except OSError:
            return False
        return True


def _create(path: Path, token: str) -> bool:
    """Create the lock file with ``token`` if none exists (the one atomic test-and-set)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return True


def _break(path: Path, seen: os.stat_result) -> bool:
    """Remove the expired lock file ``seen`` if it is still the one at ``path``; whether it
    was (``False``: another replica broke, took or refreshed it first)."""
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}.broken")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another replica broke it first
    try:
        now = os.stat(aside)
        if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            # Taken or refreshed since it was found expired: not ours to break. Put it back
            # (a link fails rather than replace a lock created in the gap).
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            return False
        return True
    finally:
        aside.unlink(missing_ok=True)


class FolderState:
    """The folder implementation: files, and once started, the profiles in memory.

    ``start`` reads the profile folder into memory and re-reads what changed every
    ``refresh_s`` on a thread of its own (``SnapshotProfileStore``): requests then look
    profiles up without touching the disk, which on a network volume can block the event
    loop for as long as the volume takes. Not started (the command line, tests), every read
    goes to the files.

    Args:
        profiles: the profile folder (``settings.profiles_path``).
        sample_dir: the traffic sample's shared folder (``traffic_sample_dir``), if any.
        auto_root: ``auto``'s runs and locks (default ``<profiles>/auto``).
        refresh_s: seconds between two reads of the profile folder once started.
    """

    kind: Literal["folder", "redis"] = "folder"

    def __init__(
        self,
        profiles: Path,
        sample_dir: Path | None = None,
        auto_root: Path | None = None,
        refresh_s: float = 2.0,
    ) -> None:
        self._profiles = SnapshotProfileStore(profiles)
        self.sample_dir = sample_dir
        self.auto_root = auto_root or profiles / "auto"
        self._locks = FolderLocks(self.auto_root, f"pid{os.getpid()}")
        self.refresh_s = refresh_s
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def profiles(self) -> ProfileStore:
        return self._profiles

    @property
    def locks(self) -> Locks:
        return self._locks

    def spool(self, name: SpoolName, max_runs: int, replica: str | None) -> RunSpool | None:
        if name == "sample":
            if self.sample_dir is None:
                return None
            return TrafficSpool(self.sample_dir, max_runs, replica)
        return TrafficSpool(self.auto_root / name.removeprefix("auto/"), max_runs, replica)

    def records(
        self, name: str, *, max_records: int, max_bytes: int, ttl_s: float
    ) -> FolderRecords:
        # Beside auto's runs: the folder every worker of the host (and a volume's replicas)
        # already shares.
        return FolderRecords(
            self.auto_root / "records" / f"{name}.sqlite3", max_records, max_bytes, ttl_s
        )

    @property
    def up(self) -> bool:
        return True

    @property
    def failures(self) -> Mapping[str, int]:
        return {}  # a failed file operation raises where it happens, as it always did

    @property
    def pending(self) -> int:
        return 0

    @property
    def dropped(self) -> int:
        return 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="state-folder", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def wait_loaded(self, timeout: float) -> bool:
        """Wait until the profiles are in memory (or ``timeout``); not started, every read
        goes to the files, so they are loaded."""
        if self._thread is None:
            return True
        return self._loaded.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._profiles.refresh()
                self._loaded.set()
            except OSError as exc:  # an unreachable volume: keep what is held, try again
                log.warning("cannot read the bias profiles in %s: %s", self._profiles.root, exc)
            self._stop.wait(self.refresh_s)


def lock_name(model: str, template: str, slots: int) -> str:
    """The assessment lock of one learned profile's key."""
    return profile_id(model, template, slots)


@contextlib.contextmanager
def held(locks: Locks, name: str, ttl_s: float) -> Iterator[bool]:
    """``with held(locks, name, ttl) as ok``: hold ``name`` for the block if it could be
    taken (blocks briefly: not for the event loop thread with a network store)."""
    token = locks.acquire(name, ttl_s)
    try:
        yield token is not None
    finally:
        if token is not None:
            locks.release(name, token)


def open_state(settings: Settings) -> StateStore:
    """The store ``settings`` name: Redis with ``state_url``, else the folder. Does no I/O
    (``start`` connects)."""
    if settings.state_url is None:
        return FolderState(
            settings.profiles_path, settings.traffic_sample_dir, refresh_s=settings.state_refresh_s
        )
    from service.state.redis_state import RedisState

    return RedisState.from_settings(settings)
