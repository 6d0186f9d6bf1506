"""HTTP client to a remote inference server (vLLM's OpenAI-compatible server), for ``remote``.

What a platform team expects from a client of their cluster:

- one ``httpx.AsyncClient`` with a bounded connection pool, connect and read timeouts;
- a limit on calls in flight *and* on prompt tokens in flight toward the server: requests with
  prompt log-probs skip vLLM's prefix cache and long batches of them can exhaust its memory;
- retries only of calls the server refused before doing any work (connection refused or
  reset before an answer, 429, 502, 503, 504), with exponential backoff, full jitter and the
  server's ``Retry-After``; a read timeout is the server still working: it is failed with
  ``EngineTimeout``, never retried blindly;
- the caller's request id sent along (``X-Request-Id``), so the server's logs can be joined
  with ours.

No metrics library here (``service`` speaks no HTTP and no Prometheus): every finished call is
reported to the observers as an ``EngineCall``; ``app.metrics`` turns them into series.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from service.errors import EngineTimeout, EngineUnavailable

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({429, 502, 503, 504})
_BACKOFF_BASE_S = 0.25
_BACKOFF_MAX_S = 8.0
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One HTTP call to the engine as it ended (what the engine metrics observe)."""

    path: str
    outcome: str
    """``ok``, ``http_<status>`` (an answer other than 200), ``timeout``, ``unavailable``."""
    seconds: float
    retries: int
    prompt_tokens: int


EngineObserver = Callable[[EngineCall], None]


class EngineHTTPError(Exception):
    """The engine answered a call with a status that retrying will not change (400, 500...)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"engine answered {status}: {detail}")
        self.status = status
        self.detail = detail


class EngineClient:
    """Bounded, retrying JSON-over-HTTP calls to one engine (module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_concurrency: int = 16,
        max_inflight_tokens: int = 262_144,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Args:
        base_url: the server's root, e.g. ``http://vllm:8000``.
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: read timeout of one call.
        max_concurrency: calls in flight (also the connection pool's size).
        max_inflight_tokens: prompt tokens in flight; a call larger than this runs alone.
        retries: retries of a refused call.
        transport: for tests (an ``httpx.MockTransport``); default: the network.
        """
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=_CONNECT_TIMEOUT_S, pool=timeout_s),
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency
            ),
            transport=transport,
        )
        self._calls = asyncio.Semaphore(max_concurrency)
        self._max_tokens = max_inflight_tokens
        self._tokens = 0
        self._tokens_freed: asyncio.Condition | None = None
        self._retries = retries
        self._observers: list[EngineObserver] = []
        self.in_flight = 0
        """Calls waiting for or holding an answer from the engine."""

    def add_observer(self, observer: EngineObserver) -> None:
        """Call ``observer`` after every call (from the event loop; keep it cheap)."""
        self._observers.append(observer)

    async def get(self, path: str, *, request_id: str | None = None) -> Any:
        """``GET path`` as JSON (retried like ``post``).

        Raises:
            EngineUnavailable, EngineTimeout, EngineHTTPError: as ``post``.
        """
        return await self._call("GET", path, None, 0, request_id)

    async def post(
        self, path: str, body: Mapping[str, Any], *, tokens: int = 0, request_id: str | None = None
    ) -> Any:
        """``POST path`` with a JSON body, holding ``tokens`` of the in-flight token budget.

        Returns:
            The decoded JSON answer.

        Raises:
            EngineUnavailable: refused (or unreachable) after every retry.
            EngineTimeout: no answer within the read timeout (not retried).
            EngineHTTPError: an answer that retrying will not change (400, 404, 500...).
        """
        async with self._budget(tokens):
            return await self._call("POST", path, body, tokens, request_id)

    async def aclose(self) -> None:
        await self._http.aclose()

    @asynccontextmanager
    async def _budget(self, tokens: int) -> AsyncIterator[None]:
        if self._tokens_freed is None:
            self._tokens_freed = asyncio.Condition()
        freed = self._tokens_freed
        async with freed:
            # A call over the whole budget still runs, alone (the engine may still take it).
            await freed.wait_for(
                lambda: self._tokens == 0 or self._tokens + tokens <= self._max_tokens
            )
            self._tokens += tokens
        try:
            yield
        finally:
            async with freed:
                self._tokens -= tokens
                freed.notify_all()

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        tokens: int,
        request_id: str | None,
    ) -> Any:
        headers = {"X-Request-Id": request_id} if request_id else {}
        started = time.perf_counter()
        retries = 0
        self.in_flight += 1
        outcome = "unavailable"
        try:
            async with self._calls:
                while True:
                    wait_s: float | None = None
                    try:
                        response = await self._http.request(
                            method, path, json=body, headers=headers
                        )
                    except httpx.ReadTimeout as exc:
                        outcome = "timeout"
                        raise EngineTimeout(
                            f"the engine at {self.base_url} did not answer {path} within "
                            f"{self._timeout_s:g} s"
                        ) from exc
                    except (httpx.TransportError, OSError) as exc:
                        # Connection refused, reset or closed before an answer: the server did
                        # no work we could use, and scoring is idempotent.
                        reason = f"{type(exc).__name__}"
                    else:
                        if response.status_code == 200:
                            outcome = "ok"
                            return response.json()
                        outcome = f"http_{response.status_code}"
                        if response.status_code not in _RETRY_STATUS:
                            raise EngineHTTPError(response.status_code, _detail(response))
                        reason = f"HTTP {response.status_code}"
                        wait_s = _retry_after(response)
                    if retries >= self._retries:
                        raise EngineUnavailable(
                            f"the engine at {self.base_url} refused {path} ({reason}) after "
                            f"{retries} retries"
                        )
                    retries += 1
                    backoff = random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2**retries))
                    await asyncio.sleep(max(backoff, wait_s or 0.0))
        finally:
            self.in_flight -= 1
            call = EngineCall(path, outcome, time.perf_counter() - started, retries, tokens)
            for observer in self._observers:
                try:
                    observer(call)
                except Exception:  # a metrics bug must not fail a call
                    logger.exception("engine observer failed")


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return min(_BACKOFF_MAX_S * 4, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from inference servers, and the backoff covers it


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(body)[:300]
