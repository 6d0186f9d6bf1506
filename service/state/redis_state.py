"""The state store in Redis (``service.state.state_store``; settings ``state_*``).

Keys, all under ``<state_key_prefix>:``:

- ``profiles``: a hash, one field per profile id holding its whole JSON document. Writing one
  field is atomic: a reader gets the old document or the new one, never half of one.
- ``profiles:version``: a counter bumped in the same transaction as every profile write.
  Each replica GETs it every ``state_refresh_s`` and reads the hash again only when it moved.
- ``runs:<spool>:<key>``: one list per sample key, newest first, trimmed to the spool's
  ``max_runs`` on every push (the latest runs of every replica: oldest out);
  ``runs:<spool>``: the set of its keys, for ``counts``. Each run carries a random id and is
  pushed by a script that first adds the id to ``runs:<spool>:<key>:ids`` (the latest
  ``2 max_runs`` ids): a run already there is not pushed again, so a write Redis applied but
  whose reply was lost, sent again, counts once; readers also drop a repeated id.
  ``runs:<spool>:<key>:n`` counts the runs pushed: a reader that holds the runs up to count
  ``c`` downloads only the ``n - c`` newest (none when it did not move), and ``auto`` reads
  nothing until it moved (``watermark``).
- ``records:<name>:...``: records kept for a time, bounded in count and bytes
  (``service.state.expiring.RedisRecords``: the served requests ``POST /v1/feedback`` needs).
- ``lock:<name>``: ``SET NX PX`` with a random token, released by a compare-and-delete script,
  so a holder whose lock expired never releases the next holder's.

A cache-like dependency: the service is never less available with it than without it.
Requests read profiles from this replica's memory (``RedisProfileStore``: no network call per
request); one background thread writes what is queued and refreshes the memory. Writes
(profiles, runs) go to that queue and return at once; while Redis cannot be reached they stay
queued (runs up to ``state_max_pending_bytes`` of records, then the oldest is dropped and
counted; a profile keeps its latest write) and are retried every ``state_refresh_s``. Redis
down at start: no stored profile is known, so requests take the MoI path; ``/ready`` does
not wait for it. When it is back, the queue is written and the memory refreshed; a Redis
that comes back empty (restarted without persistence) gets this replica's profiles written
back. The health is in ``up``, the failure counts in ``failures``
(``rag_reorder_state_store_*`` metrics) and a log line at each change, with the URL's
password shown as ``***``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.errors import StateUnavailable
from service.state.expiring import Scope, digest, size_of
from service.state.profile_store import (
    ProfileStore,
    StoredProfile,
    dump_profile,
    parse_profile,
    profile_id,
)
from service.state.traffic import (
    Run,
    SampleCount,
    SampleKey,
    SpoolName,
    run_of,
    run_record,
    well_formed,
)

if TYPE_CHECKING:
    from service.config.settings import Settings

log = logging.getLogger(__name__)

Operation = Literal["read", "write", "lock"]
_PUSH_BATCH = 256
# Compare-and-delete: only the token's holder releases the lock (the Redis documentation's
# single-instance lock pattern).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""
# An idempotent push of one run (module docstring): KEYS list, ids, count, key set;
# ARGV record, run id, max_runs, the key's JSON.
_PUSH = """
local n = tonumber(redis.call('get', KEYS[3]) or '0') + 1
if redis.call('zadd', KEYS[2], 'NX', n, ARGV[2]) == 0 then
    return 0
end
redis.call('zremrangebyrank', KEYS[2], 0, -2 * tonumber(ARGV[3]) - 1)
redis.call('lpush', KEYS[1], ARGV[1])
redis.call('ltrim', KEYS[1], 0, tonumber(ARGV[3]) - 1)
redis.call('incr', KEYS[3])
redis.call('sadd', KEYS[4], ARGV[4])
return 1
"""
# Compare-and-expire: only the token's holder extends the lock.
_REFRESH = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def redact(url: str) -> str:
    """``url`` with its password (if any) as ``***``: what log lines show. redis-py also
    reads a password from the query (``?password=``), so that is hidden too; the host is
    kept as written (an IPv6 address keeps its brackets)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in pairs):
            query = "&".join(
                f"{k}=***" if k.lower() == "password" else urlencode({k: v}) for k, v in pairs
            )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


@dataclass(frozen=True)
class _QueuedRun:
    seq: int
    spool: SpoolName
    key: SampleKey
    record: str
    run_id: str
    max_runs: int


@dataclass
class _Pool:
    """One key's runs as this replica last read them: the push count they go up to and the
    parsed records, newest first (``(time, id, run)``)."""

    count: int
    records: list[tuple[float, str | None, Run]]


class RedisState:
    """Profiles, run spools and locks in one Redis (module docstring).

    Args:
        client: a ``redis.Redis`` with short timeouts and no retries of its own
            (``from_settings`` builds it); ``decode_responses=True``.
        where: the URL as log lines show it (password redacted).
        prefix: every key's prefix.
        refresh_s: seconds between version checks, and between retries while down.
        max_pending_bytes: most bytes of run records queued while Redis cannot be reached.
        local_root: the folder of what stays in files (positional profiles).
    """

    kind: Literal["folder", "redis"] = "redis"

    def __init__(
        self,
        client: redis.Redis,
        *,
        where: str,
        prefix: str,
        refresh_s: float,
        max_pending_bytes: int,
        local_root: Path,
        timeout_s: float = 0.5,
    ) -> None:
        self.client = client
        self.where = where
        self.prefix = prefix
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.failures: dict[str, int] = {"read": 0, "write": 0, "lock": 0}
        self.dropped = 0
        self._lock = threading.Lock()
        # Replaced, never mutated: a reader holds a consistent snapshot without a lock.
        self._documents: dict[str, str] = {}
        self._generation = 0
        self._pending_profiles: dict[str, str] = {}
        self._pending_runs: deque[_QueuedRun] = deque()
        self._pending_bytes = 0
        self._pools: dict[tuple[SpoolName, SampleKey], _Pool] = {}
        self._pools_lock = threading.Lock()
        self._seq = itertools.count()
        self._version: str | None = None
        self._epoch: str | None = None
        self._stale = True
        self._up: bool | None = None
        self.loaded = threading.Event()
        """Set once the profiles were read from Redis (not while it has been unreachable)."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._release = client.register_script(_RELEASE)
        self._push_run = client.register_script(_PUSH)
        self._refresh = client.register_script(_REFRESH)
        self._profiles = RedisProfileStore(self, local_root)
        self._locks = RedisLocks(self)

    @classmethod
    def from_settings(cls, settings: Settings) -> RedisState:
        """The store ``settings.state_url`` names (does no I/O)."""
        assert settings.state_url is not None
        url = settings.state_url.get_secret_value()
        password = settings.state_password
        timeout = settings.state_timeout_s
        client = redis.Redis.from_url(
            url,
            # A password in the URL wins over this one (redis-py's rule).
            password=password.get_secret_value() if password is not None else None,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # Retries are ours (the background queue): a call fails fast and is counted.
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            decode_responses=True,
            client_name="rag-reorder",
        )
        return cls(
            client,
            where=redact(url),
            prefix=settings.state_key_prefix,
            refresh_s=settings.state_refresh_s,
            max_pending_bytes=settings.state_max_pending_bytes,
            local_root=settings.profiles_path,
            timeout_s=timeout,
        )

    @property
    def profiles(self) -> ProfileStore:
        return self._profiles

    @property
    def locks(self) -> RedisLocks:
        return self._locks

    # --- health -----------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return bool(self._up)

    @property
    def pending(self) -> int:
        """Writes queued for Redis (runs and profiles)."""
        with self._lock:
            return len(self._pending_runs) + len(self._pending_profiles)

    def _mark(
        self, ok: bool, operation: Operation | None = None, exc: Exception | None = None
    ) -> None:
        if not ok and operation is not None:
            self.failures[operation] += 1
        if ok == self._up:
            return
        was, self._up = self._up, ok
        if ok:
            log.info("state store %s reachable%s", self.where, " again" if was is False else "")
        else:
            log.warning(
                "state store %s unreachable (%s): requests are served from what this replica "
                "holds, writes are queued and retried every %g s",
                self.where, type(exc).__name__ if exc else "error", self.refresh_s,
            )  # fmt: skip

    # --- the background thread --------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="state-redis", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self.flush(timeout=2 * self.timeout_s + 1.0)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.timeout_s + 1.0)
            self._thread = None
        self.client.close()

    def wait_loaded(self, timeout: float) -> bool:
        """Wait until the profiles were first read (or ``timeout``): a restarted replica
        places by them from its first request when Redis answers at once."""
        return self.loaded.wait(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is queued (or ``timeout``); returns whether nothing is."""
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() >= deadline or self._thread is None:
                return False
            self._wake.set()
            time.sleep(0.005)
        return True

    def _run(self) -> None:
        next_pull = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            operation: Operation = "write"
            try:
                # Read before writing: a Redis that lost its data is recognised (``_pull``)
                # before this replica's queued writes make it look written to.
                if time.monotonic() >= next_pull:
                    operation = "read"
                    self._pull()
                    next_pull = time.monotonic() + self.refresh_s
                operation = "write"
                self._push()
                self._mark(True)
                wait = next_pull - time.monotonic()
            except (redis.RedisError, OSError) as exc:
                self._mark(False, operation, exc)
                self._stale = True  # read everything again once it answers
                next_pull = 0.0
                wait = self.refresh_s
            self._wake.wait(max(wait, 0.0))

    def _push(self) -> None:
        """Write the queued profiles (one transaction with the version) and runs."""
        with self._lock:
            profiles = dict(self._pending_profiles)
        if profiles:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self._key("profiles"), mapping=cast("Mapping[Any, Any]", profiles))
            pipe.incr(self._key("profiles:version"))
            pipe.execute()
            with self._lock:
                for pid, doc in profiles.items():
                    if self._pending_profiles.get(pid) is doc:  # not replaced meanwhile
                        del self._pending_profiles[pid]
        while True:
            with self._lock:
                batch = list(itertools.islice(self._pending_runs, _PUSH_BATCH))
            if not batch:
                return
            pipe = self.client.pipeline(transaction=False)
            for q in batch:
                key = self._run_key(q.spool, q.key)
                self._push_run(
                    keys=[key, f"{key}:ids", f"{key}:n", self._key(f"runs:{q.spool}")],
                    args=[q.record, q.run_id, q.max_runs, _key_json(q.key)],
                    client=pipe,
                )
            # Sent again whole if this raises after Redis applied some of it: the script
            # skips a run whose id it already holds.
            pipe.execute()
            with self._lock:  # by sequence: runs dropped meanwhile shifted the queue
                while self._pending_runs and self._pending_runs[0].seq <= batch[-1].seq:
                    self._pending_bytes -= len(self._pending_runs.popleft().record)

    def _pull(self) -> None:
        """Read the profiles again if their version moved (or after being down).

        ``profiles:epoch`` is a random id set once by the first replica that finds it
        missing: another epoch than the one this replica loaded means Redis lost its data
        (restarted without persistence, flushed, failed over to an empty one). Then every
        profile this replica holds that Redis lacks is written back, rather than every
        replica forgetting what was learned.
        """
        epoch_key = self._key("profiles:epoch")
        epoch, version = cast(
            "list[str | None]", self.client.mget(epoch_key, self._key("profiles:version"))
        )
        if epoch is None:
            self.client.set(epoch_key, uuid.uuid4().hex, nx=True)
            epoch = cast("str | None", self.client.get(epoch_key))
        lost = self._epoch is not None and epoch != self._epoch
        if not lost and not self._stale and version == self._version:
            return
        docs = cast("dict[str, str]", self.client.hgetall(self._key("profiles")))
        with self._lock:
            missing = {p: d for p, d in self._documents.items() if p not in docs}
            if lost and missing:
                log.warning(
                    "state store %s lost its data: writing back this replica's %d profile(s)",
                    self.where, len(missing),
                )  # fmt: skip
                for pid, doc in missing.items():
                    self._pending_profiles.setdefault(pid, doc)
            merged = {**docs, **self._pending_profiles}
            if merged != self._documents:
                self._documents = merged
                self._generation += 1
            self._version, self._epoch, self._stale = version, epoch, False
        self.loaded.set()

    # --- profiles ---------------------------------------------------------------------

    def documents(self) -> tuple[int, dict[str, str]]:
        """``(generation, id -> JSON)`` of the profiles this replica holds (memory only)."""
        return self._generation, self._documents

    def put_document(self, pid: str, doc: str) -> None:
        """Hold ``doc`` at once and queue its write (returns without a network call)."""
        with self._lock:
            self._documents = {**self._documents, pid: doc}
            self._generation += 1
            self._pending_profiles[pid] = doc
        self._wake.set()

    # --- runs -------------------------------------------------------------------------

    def append_run(
        self, spool: SpoolName, key: SampleKey, record: str, run_id: str, max_runs: int
    ) -> None:
        """Queue one run's record (returns without a network call). The queue holds at most
        ``max_pending_bytes`` of records: a run is 43 KiB at 100 passages, so a count would
        let a long outage hold gigabytes."""
        with self._lock:
            self._pending_runs.append(
                _QueuedRun(next(self._seq), spool, key, record, run_id, max_runs)
            )
            self._pending_bytes += len(record)
            while self._pending_bytes > self.max_pending_bytes and self._pending_runs:
                self._pending_bytes -= len(self._pending_runs.popleft().record)
                self.dropped += 1
        self._wake.set()

    def run_count(self, spool: SpoolName, key: SampleKey) -> int | None:
        """Runs ever pushed for ``key`` (``None``: none counted; blocks; raises
        ``StateUnavailable``). One GET: the watermark a reader compares before reading."""
        self.flush(timeout=self.timeout_s)  # this replica's queued runs first, if it can
        try:
            n = self.client.get(f"{self._run_key(spool, key)}:n")
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable("read", exc) from None
        self._mark(True)
        return None if n is None else int(cast("str", n))

    def read_runs(
        self, spool: SpoolName, key: SampleKey, max_runs: int
    ) -> list[tuple[float, str | None, Run]]:
        """The latest ``max_runs`` runs of ``key`` as ``(time, id, run)``, newest first, each
        id once (blocks; raises ``StateUnavailable``). Incremental: only runs pushed since
        this replica's last read are downloaded and parsed, none when the count is unmoved."""
        count = self.run_count(spool, key)
        list_key = self._run_key(spool, key)
        with self._pools_lock:
            pool = self._pools.get((spool, key))
        try:
            if pool is not None and count is not None and count == pool.count:
                return pool.records
            new = None if pool is None or count is None else count - pool.count
            if new is not None and 0 < new < max_runs:
                got, lines = self._count_and_range(list_key, new)
                if got == count:  # nothing pushed between the two reads: the delta is exact
                    assert pool is not None
                    records = _unique(_parse(lines) + pool.records)[:max_runs]
                    return self._keep(spool, key, got, records)
            got, lines = self._count_and_range(list_key, max_runs)
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable("read", exc) from None
        self._mark(True)
        return self._keep(spool, key, got, _unique(_parse(lines)))

    def _count_and_range(self, list_key: str, n: int) -> tuple[int | None, list[str]]:
        """The push count and the ``n`` newest records, read in one transaction."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(f"{list_key}:n")
        pipe.lrange(list_key, 0, n - 1)
        got, lines = pipe.execute()
        return (None if got is None else int(got)), cast("list[str]", lines)

    def _keep(
        self,
        spool: SpoolName,
        key: SampleKey,
        count: int | None,
        records: list[tuple[float, str | None, Run]],
    ) -> list[tuple[float, str | None, Run]]:
        if count is not None:  # lists written before the count was kept are read whole
            with self._pools_lock:
                self._pools[(spool, key)] = _Pool(count, records)
        return records

    def run_counts(self, spool: SpoolName, max_runs: int) -> list[SampleCount]:
        """Runs held per key of ``spool`` (blocks; raises ``StateUnavailable``)."""
        self.flush(timeout=self.timeout_s)
        try:
            members = sorted(self.client.smembers(self._key(f"runs:{spool}")))
            keys = [SampleKey(*json.loads(m)) for m in members]
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.llen(self._run_key(spool, k))
            lengths = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable("read", exc) from None
        self._mark(True)
        held = [SampleCount(k, min(int(n), max_runs)) for k, n in zip(keys, lengths, strict=True)]
        return sorted(
            (c for c in held if c.runs),
            key=lambda c: (c.key.model, c.key.template, c.key.design, c.key.slots),
        )

    def _unavailable(self, operation: Operation, exc: Exception) -> StateUnavailable:
        self._mark(False, operation, exc)
        return StateUnavailable(f"the state store cannot be reached ({type(exc).__name__})")

    # --- locks ------------------------------------------------------------------------

    def try_lock(self, name: str, ttl_s: float, token: str) -> bool:
        try:
            got = self.client.set(self._key(f"lock:{name}"), token, nx=True, px=_ms(ttl_s))
        except (redis.RedisError, OSError) as exc:
            self._mark(False, "lock", exc)
            return False
        return bool(got)

    def unlock(self, name: str, token: str) -> None:
        try:
            self._release(keys=[self._key(f"lock:{name}")], args=[token])
        except (redis.RedisError, OSError) as exc:  # it expires on its own
            self._mark(False, "lock", exc)

    def extend(self, name: str, ttl_s: float, token: str) -> bool:
        try:
            got = self._refresh(keys=[self._key(f"lock:{name}")], args=[token, _ms(ttl_s)])
        except (redis.RedisError, OSError) as exc:
            self._mark(False, "lock", exc)
            return False
        return bool(got)

    # --- spools -----------------------------------------------------------------------

    def spool(self, name: SpoolName, max_runs: int, replica: str | None) -> RedisSpool:
        del replica  # one list per key holds every replica's runs
        return RedisSpool(self, name, max_runs)

    def records(self, name: str, *, max_records: int, max_bytes: int, ttl_s: float) -> RedisRecords:
        """The expiring records ``name``, shared by every replica (``service.state.expiring``)."""
        return RedisRecords(self, name, max_records, max_bytes, ttl_s)

    @property
    def down(self) -> bool:
        """Whether the last operation failed and none has succeeded since (``False`` before
        the first): callers on a request's path skip a write rather than wait to fail."""
        return self._up is False

    def count_failure(self, operation: Operation) -> None:
        """Count an operation not tried because the store is down."""
        self.failures[operation] += 1

    def mark_failed(self, operation: Operation, exc: Exception) -> None:
        """Count a failed operation made outside this class, and log the change of health."""
        self._mark(False, operation, exc)

    def key(self, suffix: str) -> str:
        """The full name of the key ``suffix`` (under the prefix)."""
        return self._key(suffix)

    def cache_get(self, name: str) -> str | None:
        """The response cache's value under ``name`` (``service.state.response_cache``), or
        ``None``. Called from a worker thread. Raises ``OSError`` when Redis cannot answer."""
        try:
            value = self.client.get(self._key(f"cache:{name}"))
        except (redis.RedisError, OSError) as exc:
            raise OSError(f"redis cache read failed: {exc}") from exc
        return value if isinstance(value, str) else None

    def cache_set(self, name: str, value: str, ttl_s: float) -> None:
        """Keep ``value`` under ``name`` for ``ttl_s`` seconds (Redis expires it). Called
        from a worker thread. Raises ``OSError`` when Redis cannot answer."""
        try:
            self.client.set(self._key(f"cache:{name}"), value, px=max(1, int(ttl_s * 1000)))
        except (redis.RedisError, OSError) as exc:
            raise OSError(f"redis cache write failed: {exc}") from exc

    def _key(self, suffix: str) -> str:
        return f"{self.prefix}:{suffix}"

    def _run_key(self, spool: SpoolName, key: SampleKey) -> str:
        return self._key(f"runs:{spool}:{_key_json(key)}")


class RedisProfileStore(ProfileStore):
    """``ProfileStore`` on ``RedisState``'s memory: a read is a dictionary lookup (parsed once
    per change), a write is held at once and queued for Redis.

    ``root`` is the local folder of what stays in files (``PositionalStore.beside``).
    """

    def __init__(self, state: RedisState, root: Path) -> None:
        super().__init__(root)
        self._state = state
        self._view: tuple[int, dict[str, StoredProfile]] = (-1, {})
        self._bad: set[str] = set()

    def _profiles(self) -> dict[str, StoredProfile]:
        generation, docs = self._state.documents()
        view = self._view
        if view[0] == generation:
            return view[1]
        parsed: dict[str, StoredProfile] = {}
        for pid, doc in docs.items():
            try:
                parsed[pid] = parse_profile(doc)
            except (ValueError, TypeError, KeyError) as exc:
                if doc not in self._bad:  # once per document, not per request
                    self._bad.add(doc)
                    log.warning("skipping unreadable bias profile %s in Redis: %s", pid, exc)
        self._view = (generation, parsed)
        return parsed

    def get(self, model: str, template: str, slots: int) -> StoredProfile | None:
        return self._profiles().get(profile_id(model, template, slots))

    def list(self) -> list[StoredProfile]:
        return sorted(self._profiles().values(), key=lambda s: (s.model, s.template, s.slots))

    def _write(self, prof: StoredProfile) -> None:
        self._state.put_document(prof.id, dump_profile(prof))

    def stamp(self, model: str, template: str, slots: int) -> object:
        return self._state.documents()[1].get(profile_id(model, template, slots))


class RedisSpool:
    """A ``RunSpool`` in Redis: one capped list per key, shared by every replica."""

    def __init__(self, state: RedisState, name: SpoolName, max_runs: int) -> None:
        self._state = state
        self.name = name
        self.max_runs = max_runs

    @property
    def where(self) -> str:
        return f"{self._state.where} ({self.name})"

    def append(self, key: SampleKey, run: Run, at: float) -> None:
        run_id = uuid.uuid4().hex
        record = run_record(key, run, at, run_id)
        self._state.append_run(self.name, key, record, run_id, self.max_runs)

    def runs(self, key: SampleKey, *, since: float | None = None) -> list[Run]:
        held = self._state.read_runs(self.name, key, self.max_runs)
        # LPUSH order is push order; replicas' clocks decide "oldest first" as in the folder.
        kept = sorted((r for r in held if since is None or r[0] >= since), key=lambda r: r[0])
        return [r[2] for r in kept]

    def watermark(self, key: SampleKey) -> object:
        return self._state.run_count(self.name, key)

    def counts(self) -> list[SampleCount]:
        return self._state.run_counts(self.name, self.max_runs)


class RedisLocks:
    """``Locks`` in Redis (``SET NX PX`` with a random token, compare-and-delete release)."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    def acquire(self, name: str, ttl_s: float) -> str | None:
        token = uuid.uuid4().hex
        return token if self._state.try_lock(name, ttl_s, token) else None

    def release(self, name: str, token: str) -> None:
        self._state.unlock(name, token)

    def refresh(self, name: str, ttl_s: float, token: str) -> bool:
        return self._state.extend(name, ttl_s, token)


def _parse(lines: list[str]) -> list[tuple[float, str | None, Run]]:
    """Stored records as ``(time, id, run)``, in their order; torn or foreign ones skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if well_formed(rec):
            rid = rec.get("id")
            out.append((float(rec["t"]), rid if isinstance(rid, str) else None, run_of(rec)))
    return out


def _unique(records: list[tuple[float, str | None, Run]]) -> list[tuple[float, str | None, Run]]:
    """``records`` with each run id once (the first, i.e. newest, kept): a run pushed twice
    must not count as two independent runs, which would narrow the trust intervals."""
    seen: set[str] = set()
    out = []
    for r in records:
        if r[1] is not None:
            if r[1] in seen:
                continue
            seen.add(r[1])
        out.append(r)
    return out


def _key_json(key: SampleKey) -> str:
    return json.dumps([key.model, key.template, key.design, key.slots])


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


# Every script takes KEYS: the index (a sorted set of members by time in microseconds), the
# sizes (a hash), the byte total; ARGV[1]: the prefix of the records' own keys, ARGV[2] the
# expiry in milliseconds. The time is Redis's (TIME), so replicas' clocks do not matter.
# Expired members are dropped first: their records are gone already (PX), their sizes must
# go too.
_DROP = """
local function drop(m)
    local s = redis.call('hget', KEYS[2], m)
    if s then
        redis.call('hdel', KEYS[2], m)
        redis.call('decrby', KEYS[3], s)
    end
    redis.call('zrem', KEYS[1], m)
    redis.call('del', ARGV[1] .. m)
end
local t = redis.call('time')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2]) * 1000
for _, m in ipairs(redis.call('zrangebyscore', KEYS[1], '-inf', now - ttl)) do drop(m) end
"""
# ARGV: prefix, ttl ms, member, record, size, max records, max bytes.
_PUT = (
    _DROP
    + """
drop(ARGV[3])
local size = tonumber(ARGV[5])
if size > tonumber(ARGV[7]) or tonumber(ARGV[6]) <= 0 then return 0 end
while redis.call('zcard', KEYS[1]) > 0 and (
        redis.call('zcard', KEYS[1]) >= tonumber(ARGV[6])
        or tonumber(redis.call('get', KEYS[3]) or '0') + size > tonumber(ARGV[7])) do
    drop(redis.call('zrange', KEYS[1], 0, 0)[1])
end
redis.call('set', ARGV[1] .. ARGV[3], ARGV[4], 'PX', ARGV[2])
-- Puts within one microsecond still go out in the order they came (a tie would be
-- ordered by member, i.e. by digest): each score is above the newest one's.
local newest = redis.call('zrange', KEYS[1], -1, -1, 'WITHSCORES')[2]
if newest and tonumber(newest) >= now then now = tonumber(newest) + 1 end
redis.call('zadd', KEYS[1], now, ARGV[3])
redis.call('hset', KEYS[2], ARGV[3], size)
redis.call('incrby', KEYS[3], size)
for i = 1, 3 do redis.call('pexpire', KEYS[i], ARGV[2]) end
return 1
"""
)
# ARGV: prefix, ttl ms, member.
_TAKE = (
    _DROP
    + """
local v = redis.call('get', ARGV[1] .. ARGV[3])
drop(ARGV[3])
return v
"""
)
# ARGV: prefix, ttl ms.
_HELD = (
    _DROP
    + """
return {redis.call('zcard', KEYS[1]), tonumber(redis.call('get', KEYS[3]) or '0')}
"""
)


class RedisRecords:
    """``ExpiringRecords`` in Redis, shared by every replica on the key prefix (module
    docstring). Keys under ``<prefix>:records:<name>:``: ``r:<digest>`` each record (with
    Redis's expiry), ``index`` (a sorted set of digests by time), ``sizes`` and ``bytes``
    (their counted sizes and total). A put is one script: expired and oldest records out,
    the new one in, the totals moved, atomically for every replica.

    Calls are made on the caller's thread with the store's short timeout. While the store is
    down (``RedisState.down``: its last operation failed and it has not answered since) no
    call is even tried, so a request does not wait for each one's timeout: a put returns
    ``False``, the others raise ``StateUnavailable``; each is counted as a failure.
    """

    scope: Scope = "deployment"

    def __init__(
        self, state: RedisState, name: str, max_records: int, max_bytes: int, ttl_s: float
    ) -> None:
        self._state = state
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        base = state.key(f"records:{name}")
        self._keys = [f"{base}:index", f"{base}:sizes", f"{base}:bytes"]
        self._prefix = f"{base}:r:"
        client = state.client
        self._put = client.register_script(_PUT)
        self._take = client.register_script(_TAKE)
        self._held = client.register_script(_HELD)

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    def put(self, key: str, record: str) -> bool:
        if self._state.down:
            self._state.count_failure("write")
            return False
        size = size_of(key, record)
        args: list[str | int] = [self._prefix, self._ttl_ms, digest(key), record, size]
        try:
            kept = self._put(keys=self._keys, args=[*args, self.max_records, self.max_bytes])
        except (redis.RedisError, OSError) as exc:
            self._state.mark_failed("write", exc)
            return False
        return bool(kept)

    def get(self, key: str) -> str | None:
        self._check()
        try:
            got = self._state.client.get(self._prefix + digest(key))
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return cast("str | None", got)

    def take(self, key: str) -> str | None:
        self._check()
        try:
            got = self._take(keys=self._keys, args=[self._prefix, self._ttl_ms, digest(key)])
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return cast("str | None", got)

    def forget(self, key: str) -> None:
        with contextlib.suppress(StateUnavailable):
            self.take(key)

    def held(self) -> tuple[int, int]:
        self._check()
        try:
            n, held = cast(
                "list[int]", self._held(keys=self._keys, args=[self._prefix, self._ttl_ms])
            )
        except (redis.RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return int(n), int(held)

    def _check(self) -> None:
        # Down: answer at once (/info, feedback) rather than wait for each call's timeout.
        if self._state.down:
            self._state.count_failure("read")
            raise StateUnavailable("the state store cannot be reached (down)")

    def _unavailable(self, exc: Exception) -> StateUnavailable:
        self._state.mark_failed("read", exc)
        return StateUnavailable(f"the state store cannot be reached ({type(exc).__name__})")
