"""The port to a language model: prompt token ids and spans in, per-token log-probs out.

Prompt building lives outside the backends (``service.prompting.prompts``), so every backend
receives byte-identical token ids and can be cross-checked against the others on the same requests.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from service.errors import InvalidRequest, LimitExceeded


@dataclass(frozen=True, slots=True)
class Encoding:
    """Token ids of a text with the character span ``[start, end)`` each token covers."""

    ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@runtime_checkable
class PromptTokenizer(Protocol):
    """What prompt building needs from a model's tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def line_break_ids(self) -> frozenset[int]:
        """Ids whose text contains a line break: a completion template's answer is one line,
        so its generation stops at the first of them (``service.strategies.work.Work``)."""
        ...

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """The model's chat template applied to ``messages``, as text (not tokenised)."""
        ...

    def render_completion(self, text: str) -> str:
        """``text`` as a plain completion prompt: the model's BOS token (if any), then ``text``."""
        ...

    def encode(self, text: str) -> Encoding:
        """Tokenise ``text`` exactly as the model sees it (no special tokens added)."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """``[encode(t) for t in texts]``, in one call (a fast tokenizer uses every core)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class SpanRequest:
    """Score tokens ``token_ids[span_start:span_end]`` given everything before each of them.

    ``span_start >= 1``: the first token of a prompt has no context and no log-prob.
    """

    request_id: str
    token_ids: tuple[int, ...]
    span_start: int
    span_end: int


@dataclass(frozen=True, slots=True)
class SpanLogprobs:
    """``logprobs[k] = log P(token_ids[span_start + k] | token_ids[:span_start + k])``, nats."""

    request_id: str
    logprobs: tuple[float, ...]

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """Greedy continuation of ``token_ids`` (later strategies generate short answers).

    ``score_ids``, when given, are teacher-forced after the prompt and their log-probs come
    back with the generation (``Generation.score_logprobs``): the greedy answer and the
    likelihood of a known continuation (the gold answer) from one prefill of the prompt,
    instead of a ``generate`` and a ``score`` call that prefill it twice. The prompt plus the
    score ids must fit the model's context.
    """

    request_id: str
    token_ids: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    score_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Generation:
    """Generated ids with the log-prob of each chosen token; ``finish_reason`` is stop|length.

    ``score_logprobs[k] = log P(score_ids[k] | token_ids of the prompt + score_ids[:k])``, nats,
    one per requested score id (the first conditioned on the prompt alone); ``None`` when the
    request asked for none. Checked like a ``SpanLogprobs`` row: a row whose score log-probs
    are not finite comes back as ``PromptFailure``.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    score_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptFailure:
    """One prompt that could not be scored; the caller drops it and degrades, not fails."""

    request_id: str
    reason: str


ScoreResult = SpanLogprobs | PromptFailure
GenerateResult = Generation | PromptFailure


_BACKGROUND: ContextVar[bool] = ContextVar("rag_reorder_background_work", default=False)


@contextlib.contextmanager
def background_work() -> Iterator[None]:
    """Mark the engine calls made inside (and in the tasks and threads started from it) as the
    service's own work: ``auto``'s background learning and explore runs. The scheduler
    (``service.backends.scheduling.scheduler``) serves callers' calls before them and keeps a
    forward of them alone short, so a caller arriving while one runs waits a fraction of a
    second, not a full forward batch (about 10 s on a 2-core CPU), and admission's progress
    check does not read that wait as a slow engine. Not the rate canary: it measures the
    engine's rate, so its forwards must be packed as callers' are (they are short: about 600
    tokens)."""
    token = _BACKGROUND.set(True)
    try:
        yield
    finally:
        _BACKGROUND.reset(token)


def in_background() -> bool:
    """Whether the running code is the service's own work (``background_work``)."""
    return _BACKGROUND.get()


def prompt_tokens(requests: Sequence[SpanRequest]) -> int:
    """A scoring call's prompt tokens, as admission and the engine's meter count them."""
    return sum(len(r.token_ids) for r in requests)


def generation_tokens(requests: Sequence[GenerationRequest]) -> tuple[int, int]:
    """A generation call's prefilled tokens (a prompt's score ids are prefilled with it) and
    its answer budget, as admission and the engine's meter count them."""
    prefilled = sum(len(r.token_ids) + len(r.score_ids) for r in requests)
    return prefilled, sum(r.max_new_tokens for r in requests)


# logit - logsumexp(logits) <= 0 holds exactly in exact arithmetic; kernels may round a
# near-certain token a hair above 0. Anything larger is a broken row, not rounding.
POSITIVE_TOLERANCE = 1e-5


def checked_span(request_id: str, values: Sequence[float]) -> ScoreResult:
    """The one validation every backend applies to a row of log-probs.

    Returns:
        ``SpanLogprobs`` (values clipped to <= 0) if every value is finite and at most
        ``POSITIVE_TOLERANCE``; otherwise a ``PromptFailure`` saying why.
    """
    if not all(math.isfinite(v) for v in values):
        return PromptFailure(request_id, "non-finite log-prob")
    if any(v > POSITIVE_TOLERANCE for v in values):
        return PromptFailure(request_id, "positive log-prob")
    return SpanLogprobs(request_id, tuple(min(float(v), 0.0) for v in values))


def out_of_vocab(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """An id of ``token_ids`` outside ``[0, vocab_size)`` (the lowest if one is negative,
    else the highest), or ``None`` when all are in range. Every backend checks prompt and
    score ids with it before a forward."""
    low, high = min(token_ids), max(token_ids)
    if low < 0:
        return low
    return high if high >= vocab_size else None


def check_prompt(request_id: str, token_ids: Sequence[int], *, limit: int, vocab_size: int) -> None:
    """A prompt a backend can take: not empty, at most ``limit`` tokens, every id in
    ``[0, vocab_size)``. Checked before any forward: an out-of-range id is an index error on
    CPU and a device-side assert on CUDA, which poisons the context for every later request.

    Raises:
        InvalidRequest: an empty prompt or an id outside the vocabulary.
        LimitExceeded: more than ``limit`` tokens.
    """
    if not token_ids:
        raise InvalidRequest(f"request {request_id!r}: empty prompt", param="token_ids")
    if len(token_ids) > limit:
        raise LimitExceeded("token_ids", limit, len(token_ids), what="prompt tokens")
    bad = out_of_vocab(token_ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(
            f"request {request_id!r}: token ids must be in [0, {vocab_size}), got {bad}",
            param="token_ids",
        )


def check_new_tokens(req: GenerationRequest) -> None:
    """A generation asks for at least one token.

    Raises:
        InvalidRequest: ``max_new_tokens < 1``.
    """
    if req.max_new_tokens < 1:
        raise InvalidRequest(
            f"request {req.request_id!r}: max_new_tokens must be >= 1, got {req.max_new_tokens}",
            param="max_new_tokens",
        )


def check_span(req: SpanRequest) -> None:
    """``1 <= span_start < span_end <= len(token_ids)``: the first token has no log-prob.

    Raises:
        InvalidRequest: the span is out of range (``param="span_start"``).
    """
    n = len(req.token_ids)
    if not 1 <= req.span_start < req.span_end <= n:
        raise InvalidRequest(
            f"request {req.request_id!r}: span [{req.span_start}, {req.span_end}) must satisfy "
            f"1 <= span_start < span_end <= {n} (the first token has no log-prob)",
            param="span_start",
        )


def check_scoring(requests: Sequence[SpanRequest], *, limit: int, vocab_size: int) -> None:
    """The one contract for scoring requests, the same in every backend (transformers, vLLM,
    remote, paced): each span in range, and the tokens up to its end (all a backend forwards:
    later ones cannot change a causal model's span log-probs) a prompt ``check_prompt`` takes.
    Checked for the whole call before any forward, so a request a backend cannot take is a
    client error of the request (422), whichever engine scores it, never a per-prompt failure.

    Args:
        limit: the longest prompt the engine takes (vLLM: its context less the one token it
            must generate).

    Raises:
        InvalidRequest: a span out of range, an empty prompt or an id outside the vocabulary.
        LimitExceeded: a prompt over ``limit`` tokens.
    """
    for req in requests:
        check_span(req)
        check_prompt(
            req.request_id, req.token_ids[: req.span_end], limit=limit, vocab_size=vocab_size
        )


def check_generations(
    requests: Sequence[GenerationRequest], *, limit: int, scored_limit: int, vocab_size: int
) -> None:
    """The one contract for generation requests, the same in every backend: at least one new
    token, a prompt ``check_prompt`` takes within ``limit`` (room left for the first answer
    token), and score ids in the vocabulary that fit after the prompt within ``scored_limit``.
    Checked for the whole call before any forward (``check_scoring``).

    Raises:
        InvalidRequest: ``max_new_tokens < 1``, an empty prompt, or a prompt or score id
            outside the vocabulary.
        LimitExceeded: a prompt over ``limit``, or prompt plus score ids over ``scored_limit``.
    """
    for req in requests:
        check_new_tokens(req)
        check_prompt(req.request_id, req.token_ids, limit=limit, vocab_size=vocab_size)
        if not req.score_ids:
            continue
        n, m = len(req.token_ids), len(req.score_ids)
        if n + m > scored_limit:
            raise LimitExceeded(
                "score_ids",
                scored_limit - n,
                m,
                what=f"score tokens after a {n}-token prompt, {scored_limit} tokens at most",
            )
        bad = out_of_vocab(req.score_ids, vocab_size)
        if bad is not None:
            raise InvalidRequest(
                f"request {req.request_id!r}: score ids must be in [0, {vocab_size}), got {bad}",
                param="score_ids",
            )


@runtime_checkable
class LogprobBackend(Protocol):
    """Port to a language model. Implementations: vLLM, transformers, and a deterministic fake.

    ``score`` and ``generate`` return one result per request, in request order. A prompt that
    fails (engine error, non-finite output) comes back as ``PromptFailure``; an exception means
    the whole backend is unusable.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]: ...

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]: ...

    async def aclose(self) -> None: ...
