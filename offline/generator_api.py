"""A generator behind an OpenAI-compatible API, as the offline commands call it
(``profile-generator``, ``eval --generator-url``): the endpoint's settings, the request body
for a prompt, the answer read back, a refusal in words and the budgeted client live in
``service.backends.transport.generator_client`` (the server's online sampler of the generator
uses them too, and the server never imports ``offline``); the offline commands' worker runner
is here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from service.backends.transport.generator_client import (
    DEFAULT_KEY_ENV,
    ApiKind,
    BudgetedClient,
    BudgetSpent,
    GeneratorEndpoint,
    api_key,
    parse_answer,
    public_url,
    refusal,
    request_body,
)

__all__ = [
    "DEFAULT_KEY_ENV",
    "ApiKind",
    "BudgetSpent",
    "BudgetedClient",
    "GeneratorEndpoint",
    "api_key",
    "parse_answer",
    "public_url",
    "refusal",
    "request_body",
    "run_workers",
]


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
