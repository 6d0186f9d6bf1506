"""The configurable input limits, checked after parsing so each error names param, limit, value.

Prompt-level limits are checked later, once the strategy has chosen its prompts, and before
each is rendered: a prompt's characters against what the model's context can hold
(``service.prompting.prompts``, ``prompt_chars``) and the request's prompts x characters
(``app.admission.AdmittedBackend.tokenizer``, ``max_prompt_chars_x_prompts``); after
tokenising, tokens per prompt against the context (``prompt_tokens``), then prompts and
prompts x tokens per request (``AdmittedBackend``).
"""

from __future__ import annotations

from collections.abc import Sequence

from service.config.settings import Settings
from service.errors import LimitExceeded
from service.passage import Passage
from service.pipeline import DesignSpec


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
