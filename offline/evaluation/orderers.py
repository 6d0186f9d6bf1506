"""Where ``eval --generator-url`` takes its orders from: the variants as reorder requests name
them (``targets``), and the two orderers: a running rag-reorder server through its public API
(``ServerOrderer``: the deployment exactly as callers get it) or the in-process pipeline
(``InProcessOrderer``).

Rules decided here for the server (docs/evaluation.md, "Your generator, your questions"):

- **Retried**: a reorder call changes nothing on the user's own server but its learning
  sample, so, unlike a generator call, it is safe to repeat. 502, 503, 504, 429 and a dropped
  or refused connection are retried with exponential backoff and full jitter, honouring
  ``Retry-After`` (up to ``MAX_WAIT_S``), ``retries`` times; then the question is
  ``OrderFailed`` for that variant with the server's words, and the run goes on. A read
  timeout is not retried (the server is still working on it: another copy would queue behind
  it), nor a 500 (a bug retrying will not fix): both fail the question at once.
- **Refused**: 401, 403 and 404 stop the run (nothing will be served); another 4xx (a
  strategy that cannot serve this request) is ``OrderRefused`` for that variant.
- **Bounded**: at most ``concurrency`` calls in flight, and no more than the server's
  ``/info`` says it admits at once (``limits.max_concurrent_requests``). While ``auto`` has no
  trusted profile for a question's passage count, the calls that learn it (``default`` on a
  server whose default is ``auto``, and ``auto`` itself) go one at a time: a cold ``auto``
  runs MoI on every request, and several at once on a small engine queue past the server's
  deadline (issue 78); the first answer placed by a trusted profile lifts that.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from offline.evaluation.runner import EvalQuestion
from offline.evaluation.variants import select_variants
from offline.generator_api import public_url
from service.errors import InvalidRequest
from service.learning.learner import learning_slots
from service.pipeline import DesignSpec, Reorderer, ReorderRequest

log = logging.getLogger(__name__)

DEFAULT = "default"
"""The variant that names no strategy: the server's default (``RAG_REORDER_STRATEGY``)."""
BASELINES = ("retriever", "shuffle")
"""Always evaluated: what the team has today, and no order at all."""


@dataclass(frozen=True)
class Target:
    """One variant as a reorder request names it: the request's fields beyond the passages."""

    label: str
    body: dict[str, Any]


def targets(spec: Sequence[str] | None) -> list[Target]:
    """The variants named (``default`` for the server's default strategy, else the labels
    ``eval --strategies`` takes), then the baselines; default: ``default`` and the baselines.

    Raises:
        InvalidRequest: a name that is no strategy or variant.
    """
    names = [s.strip() for s in (spec or [DEFAULT]) if s.strip()]
    out: list[Target] = []
    for name in [*names, *BASELINES]:
        if name == DEFAULT:
            found = [Target(DEFAULT, {})]
        else:
            found = []
            for v in select_variants([name]):
                body: dict[str, Any] = {"strategy": v.strategy}
                if v.design is not None:
                    body["design"] = {"kind": v.design}
                if v.placement is not None:
                    body["placement"] = v.placement
                found.append(Target(v.label, body))
        out.extend(t for t in found if t.label not in {o.label for o in out})
    return out


@dataclass(frozen=True)
class Ordered:
    """What the orderer made of one (question, variant)."""

    order: list[int]
    strategy: str
    path: str | None
    """``auto``'s path (``profile``, ``flat``, ``moi``, ``explore``); None for other strategies."""
    prompts: int
    """Model calls the order cost (prompts scored and answers generated)."""
    prompt_tokens: int
    seconds: float


class OrderRefused(Exception):
    """The orderer cannot serve this variant for this question (recorded, the run goes on;
    a rerun asks again)."""

    kind: Literal["refused", "failed"] = "refused"
    """``refused``: the server answered that it will not (a 4xx); ``failed``: it could not
    (5xx, timeouts, connections) after the retries."""


class OrderFailed(OrderRefused):
    """The server could not order this question after the retries (module rules)."""

    kind: Literal["refused", "failed"] = "failed"


class Orderer(Protocol):
    """Where orders come from: a rag-reorder server, or the in-process pipeline."""

    @property
    def describe(self) -> str:
        """Where the orders come from, as reports show it (no credentials)."""
        ...

    @property
    def identity(self) -> dict[str, Any]:
        """What decides the orders, for the run folder's settings check."""
        ...

    @property
    def bound(self) -> str:
        """How calls toward the orderer are bounded, in words ("" when not at all)."""
        ...

    async def order(self, q: EvalQuestion, target: Target) -> Ordered: ...

    async def aclose(self) -> None: ...


RETRY_STATUS = frozenset({429, 502, 503, 504})
"""Answers a reorder call is retried on (module rules)."""
BACKOFF_BASE_S = 1.0
MAX_WAIT_S = 120.0
"""The longest wait between two tries, whatever ``Retry-After`` says."""
_RETRIED_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
"""A connection refused or dropped (a server restarting, a proxy cutting it)."""
_TRUSTED_PATHS = frozenset({"profile", "flat", "explore"})
"""``auto``'s paths that mean a trusted profile for the request's key."""


class ServerOrderer:
    """Orders from a running rag-reorder server (``POST /v1/reorder``), as its callers get
    them; retried and bounded by the module rules."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        retries: int,
        concurrency: int,
        transport: httpx.AsyncBaseTransport | None = None,
        backoff_s: float = BACKOFF_BASE_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        """May hold credentials: shown as ``describe``."""
        self._retries = retries
        self._backoff_s = backoff_s
        bearer = f"Bearer {api_key}" if api_key else None

        def auth(request: httpx.Request) -> httpx.Request:
            # As auth, not a header: httpx would replace a header by the URL's credentials.
            if bearer is not None:
                request.headers["Authorization"] = bearer
            return request

        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            auth=auth if api_key else None,
            timeout=httpx.Timeout(timeout_s, connect=10.0, pool=None),
            limits=httpx.Limits(max_connections=concurrency),
            transport=transport,
        )
        self._concurrency = concurrency
        self._calls: asyncio.Semaphore | None = None
        self._cold = asyncio.Lock()
        self._default_learns = False
        self._trusted: set[int] = set()
        self._bound = ""

    @property
    def describe(self) -> str:
        return f"server {public_url(self.base_url)}"

    @property
    def identity(self) -> dict[str, Any]:
        return {"orderer": self.describe}

    @property
    def bound(self) -> str:
        """Set by the first call, from ``/info``."""
        return self._bound

    async def _start(self) -> asyncio.Semaphore:
        """Read ``/info`` once: the default strategy, what ``auto`` trusts, the server's
        concurrency limit (module rules); a server without one is taken at ``concurrency``."""
        if self._calls is not None:
            return self._calls
        cap = self._concurrency
        try:
            response = await self._http.get("/info")
            info = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            info = {}
        if not isinstance(info, dict):
            info = {}
        limits = info.get("limits") or {}
        admits = limits.get("max_concurrent_requests")
        if isinstance(admits, int) and admits > 0:
            cap = min(cap, admits)
        # Unknown (no /info): taken as auto, the shipped default, until an answer says.
        self._default_learns = info.get("default_strategy", "auto") == "auto"
        for p in (info.get("auto") or {}).get("profiles") or []:
            if p.get("trusted") and isinstance(p.get("slots"), int):
                self._trusted.add(p["slots"])
        if self._calls is None:  # another call may have read it meanwhile
            self._calls = asyncio.Semaphore(cap)
            self._bound = (
                f"at most {cap} reorder calls in flight (--concurrency {self._concurrency}"
                + (f", the server admits {admits}" if isinstance(admits, int) else "")
                + "); calls that teach auto go one at a time until it trusts a profile for "
                "their passage count"
                + (f" (trusted at /info: slots {sorted(self._trusted)})" if self._trusted else "")
            )
            log.info("orders from %s: %s", self.describe, self._bound)
        return self._calls

    def _learns(self, target: Target) -> bool:
        strategy = target.body.get("strategy")
        return strategy == "auto" or (strategy is None and self._default_learns)

    async def order(self, q: EvalQuestion, target: Target) -> Ordered:
        """The server's order of ``q`` for ``target``.

        Raises:
            InvalidRequest: 401, 403 or 404, or an answer that is not a reorder response.
            OrderRefused: another 4xx; OrderFailed: no order after the retries.
        """
        calls = await self._start()
        slots = learning_slots(len(q.passages)) if self._learns(target) else None
        if slots is not None and slots not in self._trusted:
            # The cold lock first: a call waiting for it holds no slot the others could use.
            async with self._cold:
                # The call before may have lifted it (a trusted profile, or no auto at all).
                if self._learns(target) and slots not in self._trusted:
                    async with calls:
                        return await self._order(q, target, slots)
        async with calls:
            return await self._order(q, target, slots)

    async def _order(self, q: EvalQuestion, target: Target, slots: int | None) -> Ordered:
        passages = []
        for p in q.passages:
            item: dict[str, Any] = {"text": p.text}
            if p.title:
                item["title"] = p.title
            if p.score is not None:
                item["score"] = p.score
            passages.append(item)
        body = {"query": q.question, "passages": passages, **target.body}
        headers = {"X-Request-Id": f"eval-{q.id}-{target.label}"}
        start = time.perf_counter()
        data = await self._post(body, headers)
        seconds = time.perf_counter() - start
        try:
            usage = data["usage"]
            order = [int(i) for i in data["order"]]
            auto = data.get("auto") or {}
            got = Ordered(
                order=order,
                strategy=str(data["strategy"]),
                path=auto.get("path"),
                prompts=int(usage["prompts_scored"]) + int(usage["generations"]),
                prompt_tokens=int(usage["prompt_tokens"]),
                seconds=seconds,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"{self.describe}/v1/reorder did not answer a reorder response: {exc!r}",
                param="reorder_url",
            ) from exc
        if slots is not None and target.body.get("strategy") is None and got.strategy != "auto":
            self._default_learns = False  # the server's default learns nothing
        if slots is not None and got.path in _TRUSTED_PATHS and slots not in self._trusted:
            self._trusted.add(slots)
            log.info("auto trusts a profile for %d slots: its calls now run up to the bound", slots)
        return got

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        tries = 0
        while True:
            wait: float | None = None
            try:
                response = await self._http.post("/v1/reorder", json=body, headers=headers)
            except httpx.TimeoutException as exc:
                if not isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    raise OrderFailed(
                        f"no answer within the timeout (--reorder-timeout): {type(exc).__name__}"
                    ) from exc
                why = type(exc).__name__
            except _RETRIED_ERRORS as exc:
                why = f"connection: {type(exc).__name__}"
            except httpx.HTTPError as exc:
                raise OrderFailed(f"{type(exc).__name__}: {exc}") from exc
            else:
                status = response.status_code
                if status == 200:
                    try:
                        data = response.json()
                    except ValueError:
                        data = None
                    if isinstance(data, dict):
                        return data
                    raise InvalidRequest(
                        f"{self.describe}/v1/reorder answered 200 with a body that is not a "
                        "JSON object",
                        param="reorder_url",
                    )
                words = f"HTTP {status}: {_words(response)}"
                if status in (401, 403, 404):
                    why = "has no /v1/reorder" if status == 404 else "refused the API key"
                    raise InvalidRequest(
                        f"the rag-reorder server at {public_url(self.base_url)} {why} (the key "
                        f"is read from the variable --reorder-key-env names): {words}",
                        param="reorder_url",
                    )
                if status not in RETRY_STATUS:
                    raise (OrderRefused if status < 500 else OrderFailed)(words)
                why = words
                wait = _retry_after(response)
            if tries >= self._retries:
                raise OrderFailed(f"{why} (after {tries} retries)")
            tries += 1
            backoff = random.uniform(0, min(MAX_WAIT_S, self._backoff_s * 2**tries))
            delay = min(MAX_WAIT_S, max(backoff, wait or 0.0))
            log.warning(
                "POST %s/v1/reorder: %s; retry %d of %d in %.1f s",
                public_url(self.base_url),
                why,
                tries,
                self._retries,
                delay,
            )
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self._http.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date: the backoff covers it


def _words(response: httpx.Response) -> str:
    """The server's own words: its error envelope's message (and code), else the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict) and "message" in err:
        code = err.get("code")
        return (f"{code}: " if code else "") + str(err["message"])[:300]
    return str(err)[:300]


class InProcessOrderer:
    """Orders from the in-process pipeline (the scorer this command loads). ``default`` is the
    configured strategy; ``auto`` here reads the stored profiles but learns none (learning runs
    in a server, beside its traffic)."""

    def __init__(self, reorderer: Reorderer) -> None:
        self._reorderer = reorderer

    @property
    def describe(self) -> str:
        return f"in-process {self._reorderer.settings.model}"

    @property
    def identity(self) -> dict[str, Any]:
        # The settings that decide ``default``'s order here (a server's are its own).
        s = self._reorderer.settings
        return {
            "orderer": self.describe,
            "strategy": s.strategy,
            "placement": s.placement,
            "placement_profile": s.placement_profile,
            "template": s.chat_template,
        }

    @property
    def bound(self) -> str:
        return ""

    async def order(self, q: EvalQuestion, target: Target) -> Ordered:
        from service.errors import ClientError

        body = target.body
        design = body.get("design")
        req = ReorderRequest(
            query=q.question,
            passages=q.passages,
            strategy=body.get("strategy", self._reorderer.settings.strategy),
            design=DesignSpec(kind=design["kind"]) if design else DesignSpec(),
            placement=body.get("placement"),
            request_id=f"eval-{q.id}-{target.label}",
        )
        start = time.perf_counter()
        try:
            result = await self._reorderer.reorder(req)
        except ClientError as exc:
            raise OrderRefused(f"{exc.code}: {exc}") from exc
        return Ordered(
            order=list(result.order),
            strategy=result.strategy,
            path=result.auto.path if result.auto is not None else None,
            prompts=result.usage.prompts_scored + result.usage.generations,
            prompt_tokens=result.usage.prompt_tokens,
            seconds=time.perf_counter() - start,
        )

    async def aclose(self) -> None:
        return None
