"""A generator behind an OpenAI-compatible API, as the offline commands call it
(``profile-generator``, ``eval --generator-url``): the endpoint's settings, the request body
for a prompt (``/chat/completions`` for chat models, the server applying the chat template;
``/completions`` for base models), the answer read back, and a refusal in words.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from service.backends.engine_client import EngineCall, EngineClient, EngineHTTPError
from service.errors import InvalidRequest
from service.prompts import ApiPrompt

ApiKind = Literal["chat", "completions"]


@dataclass(frozen=True)
class GeneratorEndpoint:
    """The generator's OpenAI-compatible API."""

    base_url: str
    """Up to and including ``/v1`` (``https://api.openai.com/v1``, ``http://vllm:8000/v1``)."""
    model: str
    api: ApiKind = "chat"
    api_key: str | None = None
    max_tokens: int = 32
    logprobs: bool = True
    """Ask for the answer tokens' log-probabilities (recorded beside the accuracy)."""
    timeout_s: float = 120.0
    retries: int = 5
    concurrency: int = 4


def request_body(endpoint: GeneratorEndpoint, prompt: ApiPrompt) -> tuple[str, dict[str, Any]]:
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
    if exc.status in (401, 403):
        why = "refused the API key (set it in the environment variable --api-key-env names)"
    elif exc.status == 404:
        why = f"has no such route or model ({ep.model!r} at {ep.base_url})"
    else:
        why = "refused the call"
    return InvalidRequest(
        f"the generator at {ep.base_url} {why}: HTTP {exc.status}: {exc.detail}",
        param="base_url",
    )


class BudgetedClient:
    """The generator's ``EngineClient`` under ``max_calls``: every HTTP attempt counts,
    retries included (the observer sees each call as it ends with its retries; a call in
    flight counts as one until then), so the budget is what was sent. A refusal (an answer
    retrying will not change) is raised as ``refusal``'s ``InvalidRequest``.
    """

    def __init__(
        self, endpoint: GeneratorEndpoint, max_calls: int | None, transport: Any = None
    ) -> None:
        self.endpoint = endpoint
        self.max_calls = max_calls
        self.attempts = 0
        self._in_flight = 0
        self._client = EngineClient(
            endpoint.base_url,
            api_key=endpoint.api_key,
            timeout_s=endpoint.timeout_s,
            max_concurrency=endpoint.concurrency,
            retries=endpoint.retries,
            transport=transport,
        )
        self._client.add_observer(self._count)

    def _count(self, call: EngineCall) -> None:
        self.attempts += 1 + call.retries

    @property
    def spent(self) -> bool:
        """No further call fits ``max_calls`` (a rerun continues)."""
        return self.max_calls is not None and self.attempts + self._in_flight >= self.max_calls

    async def answer(self, prompt: ApiPrompt, **kw: Any) -> dict[str, Any]:
        """The endpoint's answer to ``prompt`` (``kw``: ``EngineClient.post``'s ``tokens``,
        ``request_id``)."""
        path, body = request_body(self.endpoint, prompt)
        self._in_flight += 1
        try:
            return await self._client.post(path, body, **kw)
        except EngineHTTPError as exc:
            raise refusal(exc, self.endpoint) from exc
        finally:
            self._in_flight -= 1

    async def aclose(self) -> None:
        await self._client.aclose()


async def run_workers(count: int, worker: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``count`` copies of ``worker`` (at least one); the first failure cancels the rest
    and is raised once they have stopped."""
    tasks = [asyncio.create_task(worker()) for _ in range(max(1, count))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
