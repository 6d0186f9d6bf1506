"""The configurable input limits, checked after parsing so each error names param, limit, value.

Prompt-level limits are checked later, once the strategy has chosen its prompts, and before
each is rendered: a prompt's characters against what the model's context can hold
(``service.prompting.prompts``, ``prompt_chars``) and the request's prompts x characters
(``serving.admission.backends.AdmittedBackend.tokenizer``, ``max_prompt_chars_x_prompts``);
after tokenising, tokens per prompt against the context (``prompt_tokens``), then prompts and
prompts x tokens per request (``AdmittedBackend``).

The per-passage token limit (``passage_token_limit``: the server's ``max_passage_tokens`` or a
lower one of the request's) needs the model's tokenizer, so it is held inside the request's
work (``fit_to_limit``): a passage over it is a 422, or, with the request's ``truncate``
``end``, cut (``service.prompting.truncation``) and reported in the response's ``truncated``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import anyio.to_thread

from service.backends.base import PromptTokenizer
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage
from service.pipeline import DesignSpec
from service.prompting.truncation import Cut, fit_passages


def check_inputs(
    settings: Settings,
    query: str,
    passages: Sequence[Passage],
    design: DesignSpec,
    *,
    passages_param: str = "passages",
) -> None:
    """Raise ``LimitExceeded`` for the first input over a configured limit (never truncate).

    Args:
        settings: the limits.
        query: the request's query.
        passages: the request's passages (or rerank documents).
        design: the requested design (an explicit ``num_prompts`` is checked here).
        passages_param: the wire name of the passage list, for error messages.
    """
    if len(passages) > settings.max_passages:
        raise LimitExceeded(passages_param, settings.max_passages, len(passages), what="items")
    if len(query) > settings.max_query_chars:
        raise LimitExceeded("query", settings.max_query_chars, len(query), what="characters")
    for i, p in enumerate(passages):
        chars = len(p.text) + len(p.title or "")
        if chars > settings.max_passage_chars:
            raise LimitExceeded(
                f"{passages_param}[{i}]",
                settings.max_passage_chars,
                chars,
                what="characters of text and title",
            )
    if design.num_prompts is not None and design.num_prompts > settings.max_prompts_per_request:
        raise LimitExceeded(
            "design.num_prompts", settings.max_prompts_per_request, design.num_prompts
        )


@dataclass(frozen=True, slots=True)
class TokenLimit:
    """The per-passage token limit a request is held to."""

    tokens: int
    name: str
    """What sets it, for the refusal's message (the request's field or the server's setting)."""
    truncate: bool
    """Cut a passage over it (``truncate: "end"``) instead of refusing it."""


def passage_token_limit(
    settings: Settings,
    requested: int | None,
    truncate: Literal["none", "end"],
    *,
    requested_name: str,
) -> TokenLimit | None:
    """The per-passage token limit of a request: the lower of the server's
    ``max_passage_tokens`` and the request's own (``requested``); ``None`` where neither is set.

    Raises:
        InvalidRequest: ``truncate`` is ``end`` and no limit is set, so there is nothing to cut
            to (a silent no-op would leave the caller believing its passages were bounded).
    """
    server = "the server's max_passage_tokens (RAG_REORDER_MAX_PASSAGE_TOKENS)"
    limits = [
        (tokens, name)
        for tokens, name in ((requested, requested_name), (settings.max_passage_tokens, server))
        if tokens is not None
    ]
    if not limits:
        if truncate == "end":
            raise InvalidRequest(
                f'truncate "end" needs a per-passage token limit to cut to: set '
                f"{requested_name} (this server sets no max_passage_tokens)",
                param="truncate",
            )
        return None
    tokens, name = min(limits, key=lambda limit: limit[0])
    return TokenLimit(tokens, name, truncate == "end")


async def fit_to_limit(
    tokenizer: PromptTokenizer,
    passages: Sequence[Passage],
    limit: TokenLimit | None,
    *,
    passages_param: str = "passages",
) -> tuple[Sequence[Passage], list[Cut]]:
    """``passages`` held to ``limit`` (``fit_passages``, off the event loop): as they are
    without a limit, else cut where the limit says to truncate, with one ``Cut`` each.

    Raises:
        LimitExceeded: a passage over a limit that does not truncate (422).
        InvalidRequest: a passage that cannot be cut at a token boundary (422).
    """
    if limit is None:
        return passages, []
    fit = partial(
        fit_passages,
        tokenizer,
        passages,
        limit.tokens,
        truncate=limit.truncate,
        param=passages_param,
        limit_name=limit.name,
    )
    return await anyio.to_thread.run_sync(fit)
