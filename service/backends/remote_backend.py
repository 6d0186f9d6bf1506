"""``LogprobBackend`` on an inference server that already runs: vLLM's OpenAI-compatible server.

Production RAG teams serve their generator elsewhere, often sharded over several GPUs; the
gain measured here comes from fitting *that* generator's position bias, so rag-reorder scores
with it instead of loading a second copy (issue 39). Prompts are still built here
(``service.prompts``) with the served model's own tokenizer (``model``'s folder), and the
server gets token ids, so every backend scores byte-identical prompts:

- scoring: ``POST /v1/completions`` with ``prompt`` a list of token-id lists (each cut at its
  span's end), ``max_tokens: 1`` (the least vLLM takes), ``prompt_logprobs: 0``; the answer has
  one ``prompt_logprobs`` row per prompt token (the first ``null``), each keyed by the token id's
  string, holding the prompt's own token;
- generation: the same route with ``max_tokens``, ``temperature: 0``, ``stop_token_ids``,
  ``logprobs: 1`` and ``return_token_ids``; a generation's score ids are scored as one more
  prompt (``prompt + score_ids``), since a completion cannot teacher-force them.

``connect`` (run by the app before warm-up, and again while the engine is unreachable) checks
the server: it is up, it serves the configured model (``/v1/models``), it tokenises a probe text
to our ids (``/tokenize``), and a probe scored as text and as our ids gives the same log-probs.
A server that is down raises ``EngineUnavailable`` (the app keeps ``/ready`` 503 and retries);
a wrong model or tokenizer raises ``EngineMismatch`` (the service refuses to start): never
silently wrong scores.

Servers that give no prompt log-probs (llama.cpp, Ollama, OpenAI, Anthropic: log-probs of
generated tokens only) cannot score; TGI is archived. SGLang's native ``/generate`` is not
spoken: no SGLang server runs where this is tested (docs/remote-engine.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    checked_span,
    out_of_vocab,
)
from service.backends.engine_client import EngineClient, EngineHTTPError
from service.backends.hf_tokenizer import HFPromptTokenizer
from service.errors import (
    BackendUnavailable,
    EngineMismatch,
    EngineUnavailable,
    InvalidRequest,
    LimitExceeded,
)
from service.settings import Settings

logger = logging.getLogger(__name__)

# Words, digits, punctuation, accents, a line break and a chat marker: where tokenizers of
# one family but different versions or settings part ways.
PROBE_TEXT = (
    "<|im_start|>user\nThe Eiffel Tower (Paris) opened on 31 March 1889; "
    "Gödel, Escher & Bach cost $12.50.<|im_end|>\n"
)
# The same server scoring the same ids twice: anything above rounding is another model.
_PROBE_TOLERANCE = 1e-3


class RemoteBackend:
    """Scores and generates through a vLLM OpenAI-compatible server (module docstring)."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: HFPromptTokenizer,
        *,
        model_id: str,
        served_model: str | None = None,
        max_model_len: int | None = None,
        prompts_per_call: int = 8,
    ) -> None:
        """Args:
        client: the HTTP client to the server.
        tokenizer: the served model's tokenizer, loaded here.
        model_id: the name reported by ``model_id`` (the configured ``model``).
        served_model: the name the server serves; ``None``: its only model.
        max_model_len: a cap below the server's own context length.
        prompts_per_call: prompts sent in one HTTP call.
        """
        self._client = client
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._served = served_model
        self._cap = max_model_len
        self._max_model_len = max_model_len or 0
        self._per_call = prompts_per_call
        self._vocab_size = len(tokenizer.hf_tokenizer)
        self._connected = False

    @classmethod
    def from_settings(cls, settings: Settings) -> RemoteBackend:
        """Load ``model``'s tokenizer and set up the client; contacts nothing (``connect``).

        Raises:
            BackendUnavailable: no ``engine_url``, or the tokenizer cannot be loaded.
        """
        from service.backends.tokenizer_files import load_prompt_tokenizer
        from service.model_assets import resolve_model

        if not settings.engine_url:
            raise BackendUnavailable("backend 'remote' needs RAG_REORDER_ENGINE_URL")
        key = settings.engine_api_key
        client = EngineClient(
            settings.engine_url,
            api_key=key.get_secret_value() if key is not None else None,
            timeout_s=settings.engine_timeout_s,
            max_concurrency=settings.engine_max_concurrency,
            max_inflight_tokens=settings.engine_max_inflight_tokens,
            retries=settings.engine_retries,
        )
        tokenizer = load_prompt_tokenizer(resolve_model(settings), name=settings.model)
        return cls(
            client,
            tokenizer,
            model_id=settings.model,
            served_model=settings.engine_model,
            max_model_len=settings.max_model_len,
            prompts_per_call=settings.engine_prompts_per_call,
        )

    # --- LogprobBackend -------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        """The server's context length (capped by ``max_model_len``); 0 before ``connect``."""
        return self._max_model_len

    @property
    def tokenizer(self) -> HFPromptTokenizer:
        return self._tokenizer

    @property
    def client(self) -> EngineClient:
        return self._client

    @property
    def connected(self) -> bool:
        """``connect`` has succeeded once."""
        return self._connected

    async def connect(self) -> None:
        """Check the server (module docstring); idempotent once it succeeded.

        Raises:
            EngineUnavailable: the server cannot be reached or refuses (retry later).
            EngineTimeout: it did not answer in time.
            EngineMismatch: it serves another model or tokenizer than configured.
        """
        try:
            listed = await self._client.get("/v1/models", request_id="connect-models")
        except EngineHTTPError as exc:
            raise EngineMismatch(
                f"{self._client.base_url} does not answer /v1/models like an OpenAI-compatible "
                f"server ({exc.status})"
            ) from exc
        cards = {str(m.get("id")): m for m in listed.get("data", []) if isinstance(m, dict)}
        served = self._served
        if served is None:
            if len(cards) != 1:
                raise EngineMismatch(
                    f"{self._client.base_url} serves {sorted(cards)}: set "
                    "RAG_REORDER_ENGINE_MODEL to the one to score with"
                )
            served = next(iter(cards))
        if served not in cards:
            raise EngineMismatch(
                f"{self._client.base_url} serves {sorted(cards)}, not {served!r} "
                f"(RAG_REORDER_ENGINE_MODEL)"
            )
        self._served = served
        context = cards[served].get("max_model_len")
        limits = [v for v in (context, self._cap) if isinstance(v, int) and v > 0]
        if not limits:
            raise EngineMismatch(
                f"{served!r} reports no max_model_len; set RAG_REORDER_MAX_MODEL_LEN"
            )
        self._max_model_len = min(limits)
        await self._check_tokenizer(served)
        self._connected = True
        logger.info(
            "remote engine %s serves %r (context %d); tokenizer of %r matches",
            self._client.base_url,
            served,
            self._max_model_len,
            self._model_id,
        )

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Span log-probs, one result per request, in order.

        Raises:
            InvalidRequest: a span out of range or an id outside the vocabulary.
            LimitExceeded: a prompt too long for the server's context.
            EngineUnavailable, EngineTimeout: the server is down or too slow.
        """
        reqs = list(requests)
        self._require_connected()
        for req in reqs:
            self._validate(req.request_id, req.token_ids[: req.span_end])
            if not 1 <= req.span_start < req.span_end <= len(req.token_ids):
                raise InvalidRequest(
                    f"request {req.request_id!r}: span [{req.span_start}, {req.span_end}) must "
                    f"satisfy 1 <= span_start < span_end <= {len(req.token_ids)}",
                    param="span_start",
                )
        chunks = [reqs[i : i + self._per_call] for i in range(0, len(reqs), self._per_call)]
        parts = await _gather(self._score_chunk(chunk) for chunk in chunks)
        return [result for part in parts for result in part]

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Greedy continuations, one result per request, in order (``LogprobBackend``).

        Raises:
            InvalidRequest: ``max_new_tokens < 1`` or an id outside the vocabulary.
            LimitExceeded: the prompt (with its score ids) leaves no room in the context.
            EngineUnavailable, EngineTimeout: the server is down or too slow.
        """
        reqs = list(requests)
        self._require_connected()
        for req in reqs:
            if req.max_new_tokens < 1:
                raise InvalidRequest(
                    f"request {req.request_id!r}: max_new_tokens must be >= 1, "
                    f"got {req.max_new_tokens}",
                    param="max_new_tokens",
                )
            self._validate(req.request_id, req.token_ids + req.score_ids)
        # One completion call takes one max_tokens and one stop list for all its prompts.
        groups: dict[tuple[int, frozenset[int]], list[int]] = {}
        for i, req in enumerate(reqs):
            groups.setdefault((req.max_new_tokens, req.stop_token_ids), []).append(i)
        jobs = []
        for (steps, stops), members in groups.items():
            for k in range(0, len(members), self._per_call):
                jobs.append((members[k : k + self._per_call], steps, stops))
        scored = [
            SpanRequest(
                r.request_id,
                r.token_ids + r.score_ids,
                len(r.token_ids),
                len(r.token_ids) + len(r.score_ids),
            )
            for r in reqs
            if r.score_ids
        ]
        outs = await _gather(
            [
                *(self._generate_chunk([reqs[i] for i in m], s, st) for m, s, st in jobs),
                self.score(scored),
            ]
        )
        results: dict[int, GenerateResult] = {}
        for (members, _, _), part in zip(jobs, outs[:-1], strict=True):
            for i, result in zip(members, part, strict=True):
                results[i] = result
        by_id = {s.request_id: s for s in outs[-1]}
        out: list[GenerateResult] = []
        for i, req in enumerate(reqs):
            result = results[i]
            if req.score_ids and isinstance(result, Generation):
                score = by_id[req.request_id]
                if isinstance(score, PromptFailure):
                    result = PromptFailure(req.request_id, f"score_ids: {score.reason}")
                else:
                    result = dataclasses.replace(result, score_logprobs=score.logprobs)
            out.append(result)
        return out

    async def aclose(self) -> None:
        """Close the HTTP client (the server keeps running: it is not ours)."""
        await self._client.aclose()

    # --- internals ------------------------------------------------------------------------

    def _require_connected(self) -> None:
        if not self._connected:
            raise EngineUnavailable(
                f"the engine at {self._client.base_url} has not been reached yet"
            )

    def _validate(self, request_id: str, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequest(f"request {request_id!r}: empty prompt", param="token_ids")
        # vLLM needs room for the one token it must generate.
        limit = self._max_model_len - 1
        if len(token_ids) > limit:
            raise LimitExceeded("token_ids", limit, len(token_ids), what="prompt tokens")
        bad = out_of_vocab(token_ids, self._vocab_size)
        if bad is not None:
            raise InvalidRequest(
                f"request {request_id!r}: token ids must be in [0, {self._vocab_size}), got {bad}",
                param="token_ids",
            )

    async def _score_chunk(self, chunk: list[SpanRequest]) -> list[ScoreResult]:
        prompts = [list(r.token_ids[: r.span_end]) for r in chunk]
        body = {
            "model": self._served,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        ids = [r.request_id for r in chunk]
        choices = await self._complete(ids, body, sum(len(p) for p in prompts))
        return [
            choice
            if isinstance(choice, PromptFailure)
            else span_from_rows(req, choice.get("prompt_logprobs"))
            for req, choice in zip(chunk, choices, strict=True)
        ]

    async def _generate_chunk(
        self, chunk: list[GenerationRequest], steps: int, stops: frozenset[int]
    ) -> list[GenerateResult]:
        limit = self._max_model_len
        body = {
            "model": self._served,
            "prompt": [list(r.token_ids) for r in chunk],
            # Cut where the context ends, as the in-process backends do.
            "max_tokens": max(1, min(steps, *(limit - len(r.token_ids) for r in chunk))),
            "temperature": 0.0,
            "logprobs": 1,
            "stop_token_ids": sorted(stops | self._tokenizer.eos_token_ids),
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        ids = [r.request_id for r in chunk]
        choices = await self._complete(ids, body, sum(len(r.token_ids) + steps for r in chunk))
        return [
            c if isinstance(c, PromptFailure) else generation_from_choice(rid, c)
            for rid, c in zip(ids, choices, strict=True)
        ]

    async def _complete(
        self, request_ids: list[str], body: dict[str, Any], tokens: int
    ) -> list[dict[str, Any] | PromptFailure]:
        """One ``/v1/completions`` call for ``request_ids``' prompts: its choices in prompt
        order, or a ``PromptFailure`` for each prompt when the engine refused the call or its
        answer cannot be read (an unreachable or slow engine raises instead)."""
        try:
            answer = await self._client.post(
                "/v1/completions", body, tokens=tokens, request_id=request_ids[0]
            )
        except EngineHTTPError as exc:
            return [PromptFailure(rid, f"engine refused: {exc.detail}") for rid in request_ids]
        choices = _choices(answer, len(request_ids))
        if choices is None:
            return [PromptFailure(rid, "unreadable engine answer") for rid in request_ids]
        return list(choices)

    async def _check_tokenizer(self, served: str) -> None:
        ours = list(self._tokenizer.encode(PROBE_TEXT).ids)
        try:
            tokenized = await self._client.post(
                "/tokenize",
                {"model": served, "prompt": PROBE_TEXT, "add_special_tokens": False},
                request_id="connect-tokenize",
            )
            theirs = [int(t) for t in tokenized.get("tokens", [])]
        except EngineHTTPError as exc:
            raise EngineMismatch(
                f"{self._client.base_url} has no usable /tokenize ({exc.status}): cannot check "
                "that its tokenizer is ours"
            ) from exc
        if theirs != ours:
            pairs = enumerate(zip(ours, theirs, strict=False))
            at = next((k for k, (a, b) in pairs if a != b), None)
            at = min(len(ours), len(theirs)) if at is None else at
            raise EngineMismatch(
                f"the tokenizer of {self._model_id!r} here and of {served!r} at "
                f"{self._client.base_url} differ: {len(ours)} against {len(theirs)} tokens for "
                f"the probe text, first at token {at}"
            )
        # The probe scored as text (the server's own tokens) and as our ids: a server or proxy
        # that ignores token-id prompts, or another model, shows here.
        probe = SpanRequest("connect-probe", tuple(ours), 1, len(ours))
        as_ids = (await self._score_chunk([probe]))[0]
        try:
            answer = await self._client.post(
                "/v1/completions",
                {
                    "model": served,
                    "prompt": PROBE_TEXT,
                    "add_special_tokens": False,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": 0,
                },
                tokens=len(ours),
                request_id="connect-probe-text",
            )
        except EngineHTTPError as exc:
            raise EngineMismatch(f"the probe as text was refused: {exc.detail}") from exc
        choices = _choices(answer, 1)
        as_text = span_from_rows(probe, choices[0].get("prompt_logprobs") if choices else None)
        for what, result in (("ids", as_ids), ("text", as_text)):
            if isinstance(result, PromptFailure):
                raise EngineMismatch(
                    f"{served!r} at {self._client.base_url} gives no usable prompt log-probs for "
                    f"the probe as {what} ({result.reason}): it cannot score"
                )
        assert not isinstance(as_ids, PromptFailure) and not isinstance(as_text, PromptFailure)
        worst = max(abs(a - b) for a, b in zip(as_ids.logprobs, as_text.logprobs, strict=True))
        if worst > _PROBE_TOLERANCE:
            raise EngineMismatch(
                f"the probe's log-probs differ by {worst:.3g} nats between its text and our "
                f"token ids at {self._client.base_url}: the server does not score our ids"
            )


def _choices(answer: Any, count: int) -> list[dict[str, Any]] | None:
    """The answer's choices in prompt order, or ``None`` if there are not ``count`` of them."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return None
    choices = [c for c in answer["choices"] if isinstance(c, dict)]
    if len(choices) != count:
        return None
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def _value(entry: Any) -> float | None:
    if isinstance(entry, dict):
        entry = entry.get("logprob")
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return float(entry)
    return None


def span_from_rows(req: SpanRequest, rows: Any) -> ScoreResult:
    """Span log-probs out of an OpenAI-server ``prompt_logprobs`` list, checked.

    Args:
        req: the request; ``rows`` must cover ``token_ids[:span_end]``.
        rows: one entry per prompt token (the first ``null``), each a dict keyed by the token
            id's string, with ``{"logprob": ...}`` values.

    Returns:
        ``SpanLogprobs``, or ``PromptFailure`` when a row is missing, lacks the prompt's token,
        or a value is non-finite or positive.
    """
    if not isinstance(rows, list):
        return PromptFailure(req.request_id, "engine returned no prompt log-probs")
    if len(rows) < req.span_end:
        return PromptFailure(
            req.request_id, f"engine returned {len(rows)} prompt rows, need {req.span_end}"
        )
    values: list[float] = []
    for pos in range(req.span_start, req.span_end):
        row = rows[pos]
        token = req.token_ids[pos]
        value = _value(row.get(str(token))) if isinstance(row, dict) else None
        if value is None:
            return PromptFailure(
                req.request_id, f"prompt row {pos} has no log-prob for its token {token}"
            )
        values.append(value)
    return checked_span(req.request_id, values)


def generation_from_choice(request_id: str, choice: dict[str, Any]) -> GenerateResult:
    """A ``Generation`` out of one completion choice (``logprobs: 1``, ``return_token_ids``).

    Returns:
        ``Generation``, or ``PromptFailure`` on missing ids or log-probs, a non-finite or
        positive log-prob, or a finish reason other than ``stop``/``length``.
    """
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        return PromptFailure(request_id, f"generation ended with {reason!r}")
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(ids, list) or not isinstance(values, list) or len(ids) != len(values):
        return PromptFailure(request_id, "engine returned no token ids or log-probs")
    floats = [float(v) if isinstance(v, (int, float)) else math.nan for v in values]
    checked = checked_span(request_id, floats)
    if isinstance(checked, PromptFailure):
        return checked
    return Generation(request_id, tuple(int(t) for t in ids), checked.logprobs, str(reason))


async def _gather(coros: Any) -> list[Any]:
    """Run ``coros`` at once; the first exception cancels the rest and is raised as itself.

    Plain tasks and ``asyncio.gather``, not ``asyncio.TaskGroup``: a TaskGroup cancels and
    uncancels its parent task when a child fails, which an anyio cancel scope around the
    request (``app.execution``) then takes for its own cancellation.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
