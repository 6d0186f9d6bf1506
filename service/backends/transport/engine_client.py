"""HTTP client to a remote inference server (vLLM's OpenAI server, SGLang), for ``remote``.

What a platform team expects from a client of their cluster:

- one ``httpx.AsyncClient`` with a bounded connection pool, connect and read timeouts;
- a limit on calls in flight *and* on prompt tokens in flight toward the server: requests with
  prompt log-probs skip vLLM's prefix cache and long batches of them can exhaust its memory;
- a first-come-first-served token budget: a large call queued before small ones goes first,
  instead of waiting behind a stream of them for ever;
- retries only of calls that provably did no work: the connection was never made
  (``ConnectError``, ``ConnectTimeout``, no pooled connection free in time) or the server
  refused it by status (429, 503), with exponential backoff, full jitter and the server's
  ``Retry-After``. A request that may have reached the engine (a 502 or 504 from a gateway, a
  connection read, written or closed mid-call) is not retried, since a retry could run the
  work twice, unless the operator opts in (``retry_unsafe``, ``engine_retry_unsafe``). A read
  timeout is the server still working: it is failed with ``EngineTimeout``, never retried;
- an answer other than a JSON object (an HTML login page from a proxy, answered 200) is the
  engine's fault, not data: ``EngineUnavailable`` (``post_list``: other than a JSON array,
  which SGLang's batch ``/generate`` answers);
- the caller's request id sent along (``X-Request-Id``), so the server's logs can be joined
  with ours;
- credentials in ``base_url`` (``http://user:token@vllm:8000``, sent as Basic auth by httpx)
  kept out of messages and logs (``redacted_url``). Messages of the errors raised here reach
  HTTP clients and say "the engine", never its internal address.

No metrics library here (``service`` speaks no HTTP and no Prometheus): every finished call is
reported to the observers as an ``EngineCall``; ``serving.metrics`` turns them into series.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from service.errors import EngineTimeout, EngineUnavailable

logger = logging.getLogger(__name__)

# Refused before any work: "too many requests" and "not now" (vLLM answers 503 while loading).
_RETRY_STATUS = frozenset({429, 503})
# From a gateway: the engine may have run the call (its answer lost, or still running).
_UNSAFE_RETRY_STATUS = frozenset({502, 504})
# The connection was never made: nothing reached the engine.
_SAFE_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_BACKOFF_BASE_S = 0.25
_BACKOFF_MAX_S = 8.0
_CONNECT_TIMEOUT_S = 5.0
# Below vLLM's HTTP keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a connection it may be
# closing is not reused, since a call cut that way is not retried (it may have reached vLLM).
_KEEPALIVE_EXPIRY_S = 2.0


def redacted_url(url: str) -> str:
    """``url`` with its credentials (``user:token@``) replaced by ``***@``, for logs.

    Args:
        url: an absolute URL, e.g. ``http://user:token@vllm:8000``.

    Returns:
        The same URL without its userinfo (``http://***@vllm:8000``); unchanged without one.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One HTTP call to the engine as it ended (what the engine metrics observe)."""

    path: str
    outcome: str
    """``ok``, ``http_<status>`` (an answer other than 200), ``bad_answer`` (a 200 that is not
    a JSON object), ``timeout``, ``unavailable``."""
    seconds: float
    retries: int
    prompt_tokens: int


EngineObserver = Callable[[EngineCall], None]


class EngineHTTPError(Exception):
    """The engine answered a call with a status that retrying will not change (400, 500...).

    Its message may carry the engine's own words: for logs, not for HTTP clients.
    """

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
        retry_unsafe: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Args:
        base_url: the server's root, e.g. ``http://vllm:8000``; credentials in it
            (``http://user:token@vllm:8000``) are sent as Basic auth, unless ``api_key`` is set.
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: read timeout of one call.
        max_concurrency: calls in flight (also the connection pool's size).
        max_inflight_tokens: prompt tokens in flight; a call larger than this runs alone.
        retries: retries of a refused call.
        retry_unsafe: also retry calls that may have reached the engine (502, 504, a
            connection cut mid-call): the engine may then run them twice.
        transport: for tests (an ``httpx.MockTransport``); default: the network.
        """
        self.base_url = base_url.rstrip("/")
        """The URL connected to, credentials included: never log it (``redacted_url``)."""
        self.redacted_url = redacted_url(self.base_url)
        """``base_url`` without its credentials, for logs."""
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            # An explicit key wins over credentials in the URL (httpx would send those as Basic
            # auth, replacing a Bearer header).
            auth=_Bearer(api_key) if api_key else None,
            timeout=httpx.Timeout(timeout_s, connect=_CONNECT_TIMEOUT_S, pool=timeout_s),
            limits=httpx.Limits(
                max_connections=max_concurrency,
                max_keepalive_connections=max_concurrency,
                keepalive_expiry=_KEEPALIVE_EXPIRY_S,
            ),
            transport=transport,
        )
        self._calls = asyncio.Semaphore(max_concurrency)
        self._max_tokens = max_inflight_tokens
        self._tokens = 0
        # Calls waiting for budget, in arrival order: (tokens, granted when set).
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._retries = retries
        self._retry_unsafe = retry_unsafe
        self._observers: list[EngineObserver] = []
        self.in_flight = 0
        """Calls waiting for or holding an answer from the engine."""

    def add_observer(self, observer: EngineObserver) -> None:
        """Call ``observer`` after every call (from the event loop; keep it cheap)."""
        self._observers.append(observer)

    async def get(self, path: str, *, request_id: str | None = None) -> dict[str, Any]:
        """``GET path`` as a JSON object (retried like ``post``).

        Raises:
            EngineUnavailable, EngineTimeout, EngineHTTPError: as ``post``.
        """
        answer: dict[str, Any] = await self._call("GET", path, None, 0, request_id)
        return answer

    async def post(
        self, path: str, body: Mapping[str, Any], *, tokens: int = 0, request_id: str | None = None
    ) -> dict[str, Any]:
        """``POST path`` with a JSON body, holding ``tokens`` of the in-flight token budget.

        Calls wait for the budget in arrival order; a call of 0 tokens does not wait.

        Returns:
            The decoded JSON answer (an object).

        Raises:
            EngineUnavailable: refused (or unreachable) after every retry; cut off after it may
                have reached the engine, or a gateway's 502/504 (not retried unless
                ``retry_unsafe``); or an answer that is not a JSON object.
            EngineTimeout: no answer within the read timeout (not retried).
            EngineHTTPError: an answer that retrying will not change (400, 404, 500...).
        """
        async with self._budget(tokens):
            answer: dict[str, Any] = await self._call("POST", path, body, tokens, request_id)
        return answer

    async def post_list(
        self, path: str, body: Mapping[str, Any], *, tokens: int = 0, request_id: str | None = None
    ) -> list[Any]:
        """``post`` for a route that answers a JSON array (SGLang's batch ``/generate``).

        Raises:
            EngineUnavailable: as ``post``, or an answer that is not a JSON array.
            EngineTimeout, EngineHTTPError: as ``post``.
        """
        async with self._budget(tokens):
            answer = await self._call("POST", path, body, tokens, request_id, shape=list)
        return list(answer)

    async def read_text(self, path: str, *, timeout_s: float) -> str:
        """``GET path`` as text, once: not retried, outside the call limits and the
        observers (the background's cheap reads of the engine's ``/metrics``).

        Raises:
            EngineHTTPError: an answer other than 200.
            httpx.HTTPError: the engine could not be reached or did not answer in time.
        """
        response = await self._http.get(path, timeout=timeout_s)
        if response.status_code != 200:
            raise EngineHTTPError(response.status_code, _detail(response))
        return response.text

    async def aclose(self) -> None:
        await self._http.aclose()

    @asynccontextmanager
    async def _budget(self, tokens: int) -> AsyncIterator[None]:
        if tokens <= 0:
            yield
            return
        await self._acquire(tokens)
        try:
            yield
        finally:
            self._tokens -= tokens
            self._grant()

    def _fits(self, tokens: int) -> bool:
        # A call over the whole budget still runs, alone (the engine may still take it).
        return self._tokens == 0 or self._tokens + tokens <= self._max_tokens

    async def _acquire(self, tokens: int) -> None:
        if not self._waiters and self._fits(tokens):
            self._tokens += tokens
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (tokens, granted)
        self._waiters.append(entry)
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                # Granted, then cancelled before it ran: hand the tokens on.
                self._tokens -= tokens
            elif entry in self._waiters:
                self._waiters.remove(entry)
            self._grant()
            raise

    def _grant(self) -> None:
        """Let in the waiters at the head of the queue while they fit (first come, first
        served: a call that fits waits behind an earlier one that does not)."""
        while self._waiters:
            tokens, granted = self._waiters[0]
            if granted.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._fits(tokens):
                return
            self._waiters.popleft()
            self._tokens += tokens
            granted.set_result(None)

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        tokens: int,
        request_id: str | None,
        *,
        shape: type[dict[str, Any]] | type[list[Any]] = dict,
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
                            f"the engine did not answer {path} within {self._timeout_s:g} s"
                        ) from exc
                    except (httpx.TransportError, OSError) as exc:
                        reason = type(exc).__name__
                        safe = isinstance(exc, _SAFE_TRANSPORT_ERRORS)
                        cause: BaseException | None = exc
                    else:
                        cause = None
                        status = response.status_code
                        if status == 200:
                            answer = _json_answer(response, shape)
                            if answer is None:
                                outcome = "bad_answer"
                                kind = response.headers.get("content-type", "none")
                                what = "object" if shape is dict else "array"
                                raise EngineUnavailable(
                                    f"the engine answered {path} 200 with a body that is not "
                                    f"a JSON {what} (content-type {kind[:60]})"
                                )
                            outcome = "ok"
                            return answer
                        outcome = f"http_{status}"
                        if status not in _RETRY_STATUS | _UNSAFE_RETRY_STATUS:
                            raise EngineHTTPError(status, _detail(response))
                        reason = f"HTTP {status}"
                        safe = status in _RETRY_STATUS
                        wait_s = _retry_after(response)
                    if not safe and not self._retry_unsafe:
                        logger.warning(
                            "engine %s: %s %s failed (%s) after it may have reached the "
                            "engine: not retried",
                            self.redacted_url,
                            method,
                            path,
                            reason,
                        )
                        raise EngineUnavailable(
                            f"the engine failed {path} ({reason}); not retried, since it may "
                            "have run the call"
                        ) from cause
                    if retries >= self._retries:
                        raise EngineUnavailable(
                            f"the engine refused {path} ({reason}) after {retries} retries"
                        ) from cause
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


class _Bearer(httpx.Auth):
    def __init__(self, key: str) -> None:
        self._header = f"Bearer {key}"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = self._header
        yield request


def _json_answer(response: httpx.Response, shape: type[dict[str, Any]] | type[list[Any]]) -> Any:
    try:
        body = response.json()
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None
    return body if isinstance(body, shape) else None


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
