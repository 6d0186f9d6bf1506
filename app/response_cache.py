"""The response cache of ``/v1/reorder`` and the rerank routes: what the key covers, what may
be stored, and how a hit is answered (docs/cache.md; the store is
``service.state.response_cache``).

The key is a SHA-256 of one canonical JSON document:

- the validated body (``model_dump``): every field the body model has, defaults filled in,
  so a field added to the model is in the key without a change here; unknown fields the
  lenient rerank body ignores are not (they change nothing);
- the route template (``/v1/reorder``, ``/v1/rerank``, ...), the served model's id;
- a digest of the settings (default strategy, placement, seed, template, ...: everything a
  request may leave to the server), so replicas sharing Redis with other settings never
  share answers;
- the profile version: every stored bias profile's id and ``created_at`` (``auto``'s trusted
  profile, a generator profile, an operator's). Every change of a profile, a trust verdict
  reached or withdrawn after a drift included, stores it again with a new ``created_at``,
  so the next request looks under a new key and the old placement is never served.

What is stored: a 200 whose answer is a function of that key alone. Every strategy draws its
random orders from the request's seed (the caller's, else the configured one mixed with the
query: ``service.strategies.request.rng_for``), so without the cache a re-fire gets the same
answer, and caching it defeats no randomisation. Not stored: ``auto``'s paths other than
``profile`` and ``flat`` (``moi``, ``explore``, ``cold``: a server-side draw or a learning
run) and any drawn into ``auto``'s randomized holdout (its arm is drawn per request), an
answer with a failed prompt (transient), one placed by a positional profile (its folder is
not versioned here), or one placed by a profile that is no longer the stored one
(the version is read again after the work: a profile that moved during it is not pinned).
Errors are never stored: only a result reaches ``store``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import anyio.to_thread
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from app.schemas.reorder import ReorderMeta, TimingOut, UsageOut
from service.config.settings import Settings
from service.pipeline import ReorderResult
from service.state.profile_store import ProfileStore, StoredProfile
from service.state.response_cache import ResponseCache, SharedTier
from service.state.state_store import StateStore
from serving.context import AppContext
from serving.metrics import ServiceMetrics

CACHE_HEADER = "X-Cache"
_AUTO_CACHEABLE = frozenset({"profile", "flat"})


class ResponseCaching:
    """The cache with what its keys need: the settings' digest and the profile store."""

    def __init__(self, cache: ResponseCache, settings: Settings, profiles: ProfileStore) -> None:
        self.cache = cache
        self.profiles = profiles
        self.settings_digest = hashlib.sha256(
            settings.model_dump_json().encode("utf-8")
        ).hexdigest()

    async def profile_version(self) -> dict[str, float]:
        """Every stored profile's id and ``created_at`` (read off the event loop: the folder
        store reads files)."""
        listed = await anyio.to_thread.run_sync(self.profiles.list)
        return {p.id: p.created_at for p in listed}

    def key(self, route: str, body: BaseModel, model: str, version: dict[str, float]) -> str:
        doc = {
            "v": 1,
            "route": route,
            "model": model,
            "settings": self.settings_digest,
            "profiles": sorted(version.items()),
            "body": body.model_dump(mode="json"),
        }
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Lookup:
    """One request's cache lookup: its key, and the stored response when it was a hit."""

    caching: ResponseCaching
    key: str
    version: dict[str, float]
    hit: str | None
    started: float

    async def store(self, result: ReorderResult, response: BaseModel) -> bool:
        """Keep ``response`` for this key when ``result`` is cacheable (module docstring)
        and the profiles are still those it was looked up under."""
        if not cacheable(result):
            return False
        now = await self.caching.profile_version()
        if now != self.version or not all(_current(p, now) for p in _profiles_of(result)):
            return False
        return await self.caching.cache.put(self.key, response.model_dump_json())


async def lookup(
    ctx: AppContext, request: Request, body: BaseModel, response: Response
) -> Lookup | None:
    """This request's lookup (``None`` without a cache), ``X-Cache`` set on ``response``.

    Raises:
        NotReady: as ``AppContext.check_serving`` (a hit is served only when a miss would
            be: a draining or loading server answers 503 either way).
    """
    caching: ResponseCaching | None = getattr(request.app.state, "response_cache", None)
    if caching is None:
        return None
    started = time.perf_counter()
    await ctx.check_serving()
    model = ctx.engine.require().model_id
    route = getattr(request.scope.get("route"), "path", request.url.path)
    version = await caching.profile_version()
    key = caching.key(route, body, model, version)
    found = await caching.cache.get(key)
    response.headers[CACHE_HEADER] = "miss" if found is None else "hit"
    return Lookup(caching, key, version, None if found is None else found[0], started)


def as_hit(meta: ReorderMeta, started: float) -> None:
    """Mark a cached response as served now: ``cached``, no model work, the lookup's time."""
    meta.cached = True
    meta.usage = UsageOut(
        prompt_tokens=0, scored_tokens=0, prompts_scored=0, generations=0, generated_tokens=0
    )
    meta.timing = TimingOut(
        tokenize_s=0.0, scoring_s=0.0, solver_s=0.0, total_s=time.perf_counter() - started
    )


def cacheable(result: ReorderResult) -> bool:
    """Whether ``result`` is a function of its key alone (module docstring)."""
    if result.usage.prompts_failed > 0 or result.positional_profile is not None:
        return False
    auto = result.auto
    # An arm of the randomized holdout is drawn per request (docs/outcomes.md): a cached
    # placement would skip the draw for every later identical request.
    return auto is None or (auto.path in _AUTO_CACHEABLE and not auto.recorded and auto.arm is None)


def _profiles_of(result: ReorderResult) -> list[StoredProfile]:
    found = [result.profile] if result.profile is not None else []
    if result.auto is not None and result.auto.profile is not None:
        found.append(result.auto.profile)
    return found


def _current(profile: StoredProfile, version: dict[str, float]) -> bool:
    # A profile placed by must be the stored one now; one resampled from another slot count
    # or a prior is under its own id, and so must match too.
    return version.get(profile.id) == profile.created_at


def build(settings: Settings, state: StateStore, metrics: ServiceMetrics) -> ResponseCaching | None:
    """The cache ``settings`` ask for (``None``: ``cache_max_bytes`` 0), its metrics tracked,
    sharing through ``state``'s Redis with ``cache_redis``."""
    if settings.cache_max_bytes == 0:
        return None
    shared: SharedTier | None = None
    if settings.cache_redis:
        from service.state.redis_state import RedisState

        assert isinstance(state, RedisState)  # the settings refuse cache_redis without it
        shared = state
    cache = ResponseCache(
        max_bytes=settings.cache_max_bytes,
        ttl_s=settings.cache_ttl_s,
        max_entry_bytes=settings.cache_max_entry_bytes,
        shared=shared,
        retry_s=settings.state_refresh_s,
    )
    cache.on_change = metrics.track_cache(cache)
    return ResponseCaching(cache, settings, state.profiles)
