"""A response cache for byte-identical requests: an LRU bounded in bytes, with a TTL, in each
process, optionally shared through the state store's Redis (docs/cache.md).

The cache knows nothing of HTTP or of what a key means: ``app.response_cache`` derives the key
(the request body, the route, the served model, the settings and the stored profiles'
versions) and decides what may be stored. Here a value is an opaque string.

Redis is a second tier: a local miss asks Redis, a store writes both. Redis calls run in a
worker thread under the state store's short timeouts; a failed call is counted and Redis is
left alone for ``retry_s`` (so an outage costs at most one timeout per ``retry_s`` per
process, never a failed request): the local tier goes on serving.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import anyio.to_thread

log = logging.getLogger(__name__)

Tier = Literal["local", "redis"]
EvictionReason = Literal["bytes", "ttl"]


class SharedTier(Protocol):
    """What the cache needs of Redis (``RedisState.cache_get`` / ``cache_set``); both raise
    ``OSError`` when Redis cannot answer."""

    def cache_get(self, name: str) -> str | None: ...

    def cache_set(self, name: str, value: str, ttl_s: float) -> None: ...


@dataclass
class CacheCounters:
    """Monotonic totals since start (the app's metrics mirror them), and the bytes held."""

    hits: dict[Tier, int] = field(default_factory=lambda: {"local": 0, "redis": 0})
    misses: int = 0
    evictions: dict[EvictionReason, int] = field(default_factory=lambda: {"bytes": 0, "ttl": 0})
    stores: int = 0
    too_large: int = 0
    redis_failures: int = 0


def entry_size(key: str, value: str) -> int:
    """Bytes an entry is charged: its key and value as UTF-8 (Python's object overhead is a
    small constant per entry, left out)."""
    return len(key.encode()) + len(value.encode())


class ResponseCache:
    """Values by key, at most ``max_bytes`` in this process (least recently used evicted
    first), each for at most ``ttl_s`` seconds, and no entry over ``max_entry_bytes``.

    Args:
        max_bytes: the local tier's bound, per process.
        ttl_s: how long an entry may be served after it was stored (both tiers).
        max_entry_bytes: larger values are never stored (a rare 100-passage response with
            every diagnostic should not flush the rest).
        shared: the Redis tier, or ``None``.
        retry_s: after a Redis failure, how long only the local tier is used.
        clock: seconds, monotonic (tests pass their own).
        on_change: called after every change of the counters or the bytes held.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        ttl_s: float,
        max_entry_bytes: int,
        shared: SharedTier | None = None,
        retry_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.shared = shared
        self.retry_s = retry_s
        self.counters = CacheCounters()
        self._clock = clock
        self.on_change = on_change
        self._entries: OrderedDict[str, tuple[float, str, int]] = OrderedDict()
        self.bytes_held = 0
        self._redis_down_until = float("-inf")

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> tuple[str, Tier] | None:
        """The value and the tier it came from, or ``None`` (counted as a miss)."""
        found = self._get_local(key)
        if found is not None:
            self.counters.hits["local"] += 1
            self._changed()
            return found, "local"
        if self._redis_usable():
            assert self.shared is not None
            shared = self.shared
            try:
                value = await anyio.to_thread.run_sync(shared.cache_get, key)
            except OSError as exc:
                self._redis_failed(exc)
                value = None
            if value is not None:
                self._put_local(key, value)
                self.counters.hits["redis"] += 1
                self._changed()
                return value, "redis"
        self.counters.misses += 1
        self._changed()
        return None

    async def put(self, key: str, value: str) -> bool:
        """Store ``value`` (both tiers); ``False`` when it is over ``max_entry_bytes``."""
        if entry_size(key, value) > min(self.max_entry_bytes, self.max_bytes):
            self.counters.too_large += 1
            self._changed()
            return False
        self._put_local(key, value)
        self.counters.stores += 1
        if self._redis_usable():
            assert self.shared is not None
            shared = self.shared
            try:
                await anyio.to_thread.run_sync(shared.cache_set, key, value, self.ttl_s)
            except OSError as exc:
                self._redis_failed(exc)
        self._changed()
        return True

    def _get_local(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value, size = entry
        if self._clock() >= expires:
            self._drop(key, size, "ttl")
            return None
        self._entries.move_to_end(key)
        return value

    def _put_local(self, key: str, value: str) -> None:
        size = entry_size(key, value)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_held -= old[2]
        now = self._clock()
        # The least recently used go first until the new one fits: expired ones counted as
        # such (nothing servable lost), the rest as evicted for bytes. The front is also
        # swept of expired entries (O(1) each; one deeper in expires when next looked up).
        while self._entries:
            k, (exp, _, s) = next(iter(self._entries.items()))
            if exp <= now:
                self._drop(k, s, "ttl")
            elif self.bytes_held + size > self.max_bytes:
                self._drop(k, s, "bytes")
            else:
                break
        self._entries[key] = (now + self.ttl_s, value, size)
        self.bytes_held += size

    def _drop(self, key: str, size: int, reason: EvictionReason) -> None:
        del self._entries[key]
        self.bytes_held -= size
        self.counters.evictions[reason] += 1

    def _redis_usable(self) -> bool:
        return self.shared is not None and self._clock() >= self._redis_down_until

    def _redis_failed(self, exc: OSError) -> None:
        self.counters.redis_failures += 1
        self._redis_down_until = self._clock() + self.retry_s
        log.warning(
            "response cache: Redis failed (%s); local tier only for %.1f s", exc, self.retry_s
        )

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
