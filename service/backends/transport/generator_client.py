"""A generator behind an OpenAI-compatible API: its endpoint, the request body for a prompt
(``/chat/completions`` for chat models, the server applying the chat template; ``/completions``
for base models), the answer read back, a refusal in words, and a client under a hard budget of
HTTP attempts.

It lives here, not in ``offline``, because two callers need it on either side of the layers
contract (``app -> offline -> service``; the server never imports ``offline``): the offline
commands (``profile-generator``, ``eval --generator-url``, through ``offline.generator_api``)
and ``auto``'s online sampler of the generator (``service.learning.generator_online``), which
asks the generator in the server's background.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx

from service.backends.base import ChatMessage
from service.backends.transport.engine_client import EngineClient, EngineHTTPError
from service.errors import InvalidRequest

ApiKind = Literal["chat", "completions"]
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
"""The generator's key variable when the user names none: read for https URLs only."""
HOUR_S = 3600.0


class ApiPrompt(Protocol):
    """What the generator is asked: chat messages, or a completion text
    (``service.prompting.prompts.ApiPrompt``, which sits above the engines' layer)."""

    @property
    def messages(self) -> tuple[ChatMessage, ...] | None: ...

    @property
    def text(self) -> str | None: ...


def public_url(url: str) -> str:
    """``url`` as files, reports and logs show it: credentials (``user:token@``) and every
    query value (``?api-key=...``) replaced by ``***``; unchanged without either."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = parts.query
    if query:
        # A key in the query is as secret as one in the userinfo; the names stay readable.
        query = urlencode([(k, "***") for k, _ in parse_qsl(query, keep_blank_values=True)])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def api_key(url: str, named: str | None, environ: Mapping[str, str]) -> str | None:
    """The key to send to the generator at ``url``: from the variable the user ``named``
    (unset or empty: none), else from ``OPENAI_API_KEY`` only when ``url`` is https, so that a
    key kept for a paid API never travels in clear to a plain-http server."""
    if named is not None:
        return environ.get(named) or None
    if urlsplit(url).scheme.lower() != "https":
        return None
    return environ.get(DEFAULT_KEY_ENV) or None


@dataclass(frozen=True)
class GeneratorEndpoint:
    """The generator's OpenAI-compatible API."""

    base_url: str
    """Up to and including ``/v1`` (``https://api.openai.com/v1``, ``http://vllm:8000/v1``);
    it may hold credentials: show it as ``public_url(base_url)``."""
    model: str
    api: ApiKind = "chat"
    api_key: str | None = None
    max_tokens: int = 32
    logprobs: bool = True
    """Ask for the answer tokens' log-probabilities (recorded beside the accuracy)."""
    timeout_s: float = 120.0
    retries: int = 5
    concurrency: int = 4
    key_hint: str = "the environment variable --api-key-env names"
    """Where the key comes from, for the message of a refused key."""


def request_body(endpoint: GeneratorEndpoint, prompt: ApiPrompt) -> tuple[str, dict[str, Any]]:
    """The route and JSON body that ask ``endpoint`` to answer ``prompt`` (greedy)."""
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": endpoint.max_tokens,
        "temperature": 0.0,
    }
    if prompt.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in prompt.messages]
        if endpoint.logprobs:
            body["logprobs"] = True
        return "/chat/completions", body
    body["prompt"] = prompt.text
    if endpoint.logprobs:
        body["logprobs"] = 1
    return "/completions", body


def parse_answer(data: Any) -> tuple[str, float | None, int | None, int | None]:
    """The answer text, its tokens' summed log-probability (if given) and the usage.

    Raises:
        InvalidRequest: the answer is not an OpenAI completion.
    """
    try:
        choice = data["choices"][0]
        if "message" in choice:
            text = choice["message"].get("content") or ""
            rows = ((choice.get("logprobs") or {}).get("content")) or []
            values = [r.get("logprob") for r in rows]
        else:
            text = choice.get("text") or ""
            values = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise InvalidRequest(
            f"the generator's answer is not an OpenAI completion: {exc!r}", param="base_url"
        ) from exc
    finite = [float(v) for v in values if isinstance(v, int | float)]
    logprob = sum(finite) if values and len(finite) == len(values) else None
    usage = data.get("usage") or {}
    return str(text), logprob, usage.get("prompt_tokens"), usage.get("completion_tokens")


def refusal(exc: EngineHTTPError, ep: GeneratorEndpoint) -> InvalidRequest:
    """``exc`` (an answer retrying will not change) as the error a user acts on."""
    if exc.status in (401, 403):
        why = f"refused the API key (set it in {ep.key_hint})"
    elif exc.status == 404:
        why = f"has no such route or model ({ep.model!r} at {public_url(ep.base_url)})"
    else:
        why = "refused the call"
    return InvalidRequest(
        f"the generator at {public_url(ep.base_url)} {why}: HTTP {exc.status}: {exc.detail}",
        param="base_url",
    )


class BudgetSpent(Exception):
    """The budget of HTTP attempts is spent: nothing more goes out (``max_calls``: a rerun
    continues; ``per_hour``: the rolling hour frees attempts as it moves on)."""


class CallBudget:
    """A hard bound on HTTP attempts: ``max_calls`` in all, and ``per_hour`` in any rolling
    hour (either ``None``: no such bound). ``take`` counts an attempt or refuses it."""

    def __init__(
        self,
        max_calls: int | None = None,
        per_hour: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_calls = max_calls
        self.per_hour = per_hour
        self._clock = clock
        self._recent: deque[float] = deque()
        self.attempts = 0
        """Attempts sent, retries included."""

    def refused(self) -> str | None:
        """Why the next attempt may not be sent now (``None``: it may)."""
        if self.max_calls is not None and self.attempts >= self.max_calls:
            return f"--max-calls {self.max_calls} spent"
        if self.per_hour is not None:
            horizon = self._clock() - HOUR_S
            while self._recent and self._recent[0] <= horizon:
                self._recent.popleft()
            if len(self._recent) >= self.per_hour:
                return f"{self.per_hour} generator calls in the last hour"
        return None

    def take(self) -> None:
        """Count one attempt.

        Raises:
            BudgetSpent: it would pass a bound (``refused``); it is not counted.
        """
        why = self.refused()
        if why is not None:
            raise BudgetSpent(why)
        self.attempts += 1
        if self.per_hour is not None:
            self._recent.append(self._clock())


class _Counted(httpx.AsyncBaseTransport):
    """The transport under the generator's client: every HTTP attempt passes here, the
    client's own retries included, so the budget is refused at the attempt that would exceed
    it, however many calls are in flight and retrying."""

    def __init__(self, inner: httpx.AsyncBaseTransport, budget: CallBudget) -> None:
        self._inner = inner
        self.budget = budget

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.budget.take()
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class BudgetedClient:
    """The generator's ``EngineClient`` under a ``CallBudget`` (``max_calls``, or a given
    ``budget``): every HTTP attempt counts, retries included, and the attempt that would pass
    it is never sent (the call raises ``BudgetSpent``), so the budget is a hard bound on what
    was sent. A refusal (an answer retrying will not change) is raised as ``refusal``'s
    ``InvalidRequest``.
    """

    def __init__(
        self,
        endpoint: GeneratorEndpoint,
        max_calls: int | None,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        budget: CallBudget | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.budget = budget or CallBudget(max_calls)
        self.max_calls = self.budget.max_calls
        if transport is None:
            # EngineClient's own limits, which a given transport replaces: connections bounded
            # by the concurrency, and idle ones dropped below vLLM's 5 s keep-alive (a call cut
            # on a connection the server is closing is not retried).
            n = endpoint.concurrency
            transport = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(
                    max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0
                )
            )
        self._counted = _Counted(transport, self.budget)
        self._client = EngineClient(
            endpoint.base_url,
            api_key=endpoint.api_key,
            timeout_s=endpoint.timeout_s,
            max_concurrency=endpoint.concurrency,
            retries=endpoint.retries,
            transport=self._counted,
        )

    @property
    def attempts(self) -> int:
        """HTTP attempts sent, retries included."""
        return self.budget.attempts

    @property
    def spent(self) -> bool:
        """No further attempt fits the budget now."""
        return self.budget.refused() is not None

    async def answer(self, prompt: ApiPrompt, **kw: Any) -> dict[str, Any]:
        """The endpoint's answer to ``prompt`` (``kw``: ``EngineClient.post``'s ``tokens``,
        ``request_id``).

        Raises:
            BudgetSpent: the budget was spent before this call (or its retry).
            InvalidRequest: the generator refused the call (``refusal``).
            EngineUnavailable, EngineTimeout: as ``EngineClient.post``.
        """
        path, body = request_body(self.endpoint, prompt)
        try:
            return await self._client.post(path, body, **kw)
        except EngineHTTPError as exc:
            raise refusal(exc, self.endpoint) from exc

    async def aclose(self) -> None:
        await self._client.aclose()
