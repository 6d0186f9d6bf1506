"""One table of requests no backend takes, and the error each must raise, run against every
backend (transformers, paced, remote, vLLM): a caller gets the same answer whichever engine
scores (``service.backends.base.check_scoring`` and ``check_generations``).

The limits differ by engine (vLLM, in process or remote, keeps one token of its context for
the one it must generate); the error class and the parameter it names do not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from service.backends.base import GenerationRequest, SpanRequest
from service.errors import InvalidRequest, LimitExceeded


@dataclass(frozen=True)
class Limits:
    """A backend's limits, as the contract uses them."""

    prompt: int
    """The longest scoring prompt (up to its span's end)."""
    generation: int
    """The longest generation prompt."""
    scored: int
    """The longest generation prompt plus its score ids."""
    vocab: int


GOOD_IDS = tuple(range(100, 130))


def _score(name: str, ids: Sequence[int], start: int, end: int) -> SpanRequest:
    return SpanRequest(name, tuple(ids), start, end)


def _gen(name: str, ids: Sequence[int], new: int = 2, score: Sequence[int] = ()) -> Any:
    return GenerationRequest(name, tuple(ids), new, score_ids=tuple(score))


# name -> (the bad request from the limits, the error, the parameter it names)
SCORING: dict[str, tuple[Callable[[Limits], SpanRequest], type[Exception], str]] = {
    "span starts at 0": (lambda lim: _score("x", GOOD_IDS, 0, 5), InvalidRequest, "span_start"),
    "span past the end": (lambda lim: _score("x", GOOD_IDS, 5, 31), InvalidRequest, "span_start"),
    "empty span": (lambda lim: _score("x", GOOD_IDS, 5, 5), InvalidRequest, "span_start"),
    "id = vocab": (lambda lim: _score("x", (1, 2, lim.vocab), 1, 3), InvalidRequest, "token_ids"),
    "negative id": (lambda lim: _score("x", (1, -1, 2), 1, 3), InvalidRequest, "token_ids"),
    "over the context": (
        lambda lim: _score("x", [5] * (lim.prompt + 1), 1, lim.prompt + 1),
        LimitExceeded,
        "token_ids",
    ),
}
GENERATION: dict[str, tuple[Callable[[Limits], GenerationRequest], type[Exception], str]] = {
    "no new token": (lambda lim: _gen("x", GOOD_IDS, 0), InvalidRequest, "max_new_tokens"),
    "empty prompt": (lambda lim: _gen("x", ()), InvalidRequest, "token_ids"),
    "id = vocab": (lambda lim: _gen("x", (1, lim.vocab)), InvalidRequest, "token_ids"),
    "no room to answer": (
        lambda lim: _gen("x", [5] * (lim.generation + 1)),
        LimitExceeded,
        "token_ids",
    ),
    "score ids over the context": (
        lambda lim: _gen("x", [5] * (lim.scored - 3), score=[5] * 4),
        LimitExceeded,
        "score_ids",
    ),
    "score id = vocab": (
        lambda lim: _gen("x", GOOD_IDS, score=(lim.vocab,)),
        InvalidRequest,
        "score_ids",
    ),
}


async def check_contract(
    score: Callable[[list[SpanRequest]], Awaitable[Any]],
    generate: Callable[[list[GenerationRequest]], Awaitable[Any]],
    limits: Limits,
    sent: Callable[[], int] | None = None,
) -> None:
    """Each bad request, sent beside a good one, fails the whole call with its error and
    parameter before anything is sent (``sent``: what the engine received so far, where the
    test can see it); the limits themselves are taken."""
    good = _score("good", GOOD_IDS, 10, 30)
    before = sent() if sent else 0
    for name, (build, error, param) in SCORING.items():
        with pytest.raises(error) as raised:
            await score([good, build(limits)])
        assert raised.value.param == param, (name, raised.value)  # type: ignore[attr-defined]
    ok_gen = _gen("ok", GOOD_IDS)
    for name, (build_gen, error, param) in GENERATION.items():
        with pytest.raises(error) as raised:
            await generate([ok_gen, build_gen(limits)])
        assert raised.value.param == param, (name, raised.value)  # type: ignore[attr-defined]
    if sent:
        assert sent() == before, "a refused call reached the engine"
    # At the limits, nothing is refused.
    await score([_score("full", [5] * limits.prompt, 1, limits.prompt)])
    await generate([_gen("full", [5] * limits.generation, new=1)])
    await generate([_gen("scored", [5] * (limits.scored - 3), new=1, score=[5] * 3)])
