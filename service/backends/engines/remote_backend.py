"""``LogprobBackend`` on an inference server that already runs: vLLM's OpenAI server, or SGLang.

Production RAG teams serve their generator elsewhere, often sharded over several GPUs; the
gain measured here comes from fitting *that* generator's position bias, so rag-reorder scores
with it instead of loading a second copy (issue 39). Prompts are still built here
(``service.prompting.prompts``) with the served model's own tokenizer (``model``'s folder), and the
server gets token ids, so every backend scores byte-identical prompts:

- scoring: ``POST /v1/completions`` with ``prompt`` a list of token-id lists (each cut at its
  span's end), ``max_tokens: 1`` (the least vLLM takes), ``prompt_logprobs: 0``; the answer has
  one ``prompt_logprobs`` row per prompt token (the first ``null``), each keyed by the token id's
  string, holding the prompt's own token;
- generation: the same route with ``max_tokens``, ``temperature: 0``, ``stop_token_ids``,
  ``logprobs: 1`` and ``return_token_ids``; a generation's score ids are scored as one more
  prompt (``prompt + score_ids``), since a completion cannot teacher-force them.

``connect`` (run by the app before warm-up, and again after the engine was found down) checks
the server in full, every time: it is up, it serves the configured model (``/v1/models``, whose
context length is taken again: a redeploy may shrink it), it tokenises a probe text to our ids
(``/tokenize``, exactly), and a probe scored as text and as our ids gives the same log-probs
within ``probe_tolerance`` (a shared bf16 engine is not batch-invariant: two calls of the same
prompt differ by about 0.13 nats; a server that ignores token ids by many). Only a *proven*
mismatch raises ``EngineMismatch`` (the service refuses to start): another model listed, other
token ids, a 200 answer without usable prompt log-probs. Anything that may pass by itself (the
engine down or refusing, a gateway's 404 or 5xx during a rollout, rejected credentials, an
answer that is not JSON, the probe's numbers apart three times) raises ``EngineUnavailable``:
the app keeps ``/ready`` 503 with the reason and tries again. Never silently wrong scores.
The probe's log-probs are kept as a fingerprint: a later ``connect`` that finds them moved
reports that the weights changed under the same name (``weights_changed_at_reconnect``).

At run time an engine answering 5xx, 401 or 403 raises ``EngineUnavailable`` (the engine is at
fault, not the prompts); another 4xx fails the call's prompts alone (``PromptFailure``).

With ``engine_dialect=sglang`` the same calls go to SGLang's native ``/generate``
(``service.backends.engines.sglang_dialect``: ``input_ids``, ``logprob_start_len`` at the token
before the span, ``max_new_tokens: 0``; rows placed by their token ids). Its ``connect`` lists the
model the same way (SGLang serves ``/v1/models`` with ``max_model_len``) and checks the
tokenizer by scoring: the probe sent as text comes back with one row per token the *server*
encoded (with its special tokens, as SGLang encodes text), which must be exactly ours; the
probe sent as those ids must then give the same log-probs within ``probe_tolerance``.
SGLang's OpenAI ``/v1/completions`` with ``echo`` is not used: it returns token strings with
``text_offset = -1`` and starts the log-probs at 0, so spans could not be placed by id.

Servers that give no prompt log-probs (llama.cpp, Ollama, OpenAI, Anthropic: log-probs of
generated tokens only) cannot score; TGI is archived.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    check_generations,
    check_scoring,
    checked_span,
)
from service.backends.engines import sglang_dialect
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.backends.transport.engine_client import EngineClient, EngineHTTPError
from service.config.settings import Settings
from service.errors import (
    BackendUnavailable,
    EngineMismatch,
    EngineUnavailable,
)

logger = logging.getLogger(__name__)

# Words, digits, punctuation, accents, a line break and a chat marker: where tokenizers of
# one family but different versions or settings part ways.
PROBE_TEXT = (
    "<|im_start|>user\nThe Eiffel Tower (Paris) opened on 31 March 1889; "
    "Gödel, Escher & Bach cost $12.50.<|im_end|>\n"
)
# The probe as text and as ids, compared this many times before the engine is reported
# unavailable: on a shared engine each call lands in another batch, with other rounding.
_PROBE_ATTEMPTS = 3
# 4xx answers that are the engine's (or its gateway's) fault, never the prompt's.
_ENGINE_FAULT_4XX = frozenset({401, 403, 429})


class RemoteBackend:
    """Scores and generates through vLLM's OpenAI server or SGLang (module docstring)."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: HFPromptTokenizer,
        *,
        model_id: str,
        served_model: str | None = None,
        max_model_len: int | None = None,
        prompts_per_call: int = 8,
        probe_tolerance: float = 0.5,
        dialect: Literal["vllm", "sglang"] = "vllm",
    ) -> None:
        """Args:
        client: the HTTP client to the server.
        tokenizer: the served model's tokenizer, loaded here.
        model_id: the name reported by ``model_id`` (the configured ``model``).
        served_model: the name the server serves; ``None``: its only model.
        max_model_len: a cap below the server's own context length.
        prompts_per_call: prompts sent in one HTTP call.
        probe_tolerance: nats the probe's log-probs may differ by between its text and our
            ids, and from one ``connect`` to the next (``engine_probe_tolerance``).
        dialect: what the server speaks (``engine_dialect``).
        """
        self._client = client
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._served_setting = served_model
        self._served = served_model
        self._cap = max_model_len
        self._max_model_len = max_model_len or 0
        self._per_call = prompts_per_call
        self._vocab_size = len(tokenizer.hf_tokenizer)
        self._probe_tolerance = probe_tolerance
        self._connected = False
        self._down: str | None = None
        self._fingerprint: tuple[float, ...] | None = None
        self._weights_changed = False
        self._prompts_in_flight = 0
        self._dialect = dialect
        self._route = sglang_dialect.ROUTE if dialect == "sglang" else "/v1/completions"

    @classmethod
    def from_settings(cls, settings: Settings) -> RemoteBackend:
        """Load ``model``'s tokenizer and set up the client; contacts nothing (``connect``).

        Raises:
            BackendUnavailable: no ``engine_url``, or the tokenizer cannot be loaded.
        """
        from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
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
            retry_unsafe=settings.engine_retry_unsafe,
        )
        tokenizer = load_prompt_tokenizer(resolve_model(settings), name=settings.model)
        return cls(
            client,
            tokenizer,
            model_id=settings.model,
            served_model=settings.engine_model,
            max_model_len=settings.max_model_len,
            prompts_per_call=settings.engine_prompts_per_call,
            probe_tolerance=settings.engine_probe_tolerance,
            dialect=settings.engine_dialect,
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
    def prompts_in_flight(self) -> int:
        """Prompts of this backend's completion calls not yet answered (each is one request
        in vLLM's queue): what ``EngineLoad`` subtracts from the engine's own counts."""
        return self._prompts_in_flight

    @property
    def connected(self) -> bool:
        """The last ``connect`` succeeded and the engine was not marked down since."""
        return self._connected

    @property
    def weights_changed_at_reconnect(self) -> bool:
        """The last successful ``connect`` found the probe's log-probs moved (by more than
        ``probe_tolerance``) since the one before: the same name serves other weights, so what
        was learned on the old ones (bias profiles) may no longer hold."""
        return self._weights_changed

    def mark_down(self, reason: str) -> None:
        """Note that the engine was found down or failing: until the next successful
        ``connect`` (a full check again), ``connected`` is false and ``score``/``generate``
        raise ``EngineUnavailable``, since what comes back may be another deployment.

        Args:
            reason: why, for the messages (without the engine's address).
        """
        self._connected = False
        self._down = reason

    async def connect(self) -> None:
        """Check the server in full (module docstring), on every call: the app calls it again
        after ``mark_down``. Its context length and served name are taken anew; a failure
        leaves the backend not ``connected``.

        Raises:
            EngineUnavailable: the server cannot be reached, refuses (credentials, a gateway's
                404 or 5xx), answers something else than JSON, or the probe's log-probs stay
                apart (retry later).
            EngineTimeout: it did not answer in time.
            EngineMismatch: it provably serves another model or tokenizer than configured, or
                no prompt log-probs.
        """
        try:
            served, context, probe = await self._check()
        except BaseException:
            self._connected = False
            raise
        url = self._client.redacted_url
        moved = 0.0 if self._fingerprint is None else _worst(self._fingerprint, probe)
        self._weights_changed = moved > self._probe_tolerance
        if self._weights_changed:
            logger.warning(
                "remote engine %s: the engine's weights changed under the same name %r: the "
                "probe's log-probs moved by %.3g nats since the last check",
                url,
                served,
                moved,
            )
        if self._max_model_len and context != self._max_model_len:
            logger.warning(
                "remote engine %s: context length now %d (was %d)",
                url,
                context,
                self._max_model_len,
            )
        self._fingerprint = probe
        self._served = served
        self._max_model_len = context
        self._down = None
        self._connected = True
        logger.info(
            "remote engine %s serves %r (context %d); tokenizer of %r matches",
            url,
            served,
            context,
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
        # vLLM needs room for the one token it must generate.
        check_scoring(reqs, limit=self._max_model_len - 1, vocab_size=self._vocab_size)
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
        # The score ids go to vLLM as a prompt of their own (prompt + score ids), which needs
        # room for the one token it must generate, as the generation's prompt does.
        limit = self._max_model_len - 1
        check_generations(reqs, limit=limit, scored_limit=limit, vocab_size=self._vocab_size)
        # One completion call takes one max_tokens and one stop list for all its prompts, so
        # prompts are grouped by their own: each cut where the context ends, as the in-process
        # backends do, without cutting a shorter batch-mate's answer with it.
        groups: dict[tuple[int, frozenset[int]], list[int]] = {}
        for i, req in enumerate(reqs):
            steps = max(1, min(req.max_new_tokens, self._max_model_len - len(req.token_ids)))
            groups.setdefault((steps, req.stop_token_ids), []).append(i)
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
        if self._connected:
            return
        if self._down is not None:
            raise EngineUnavailable(
                f"the engine was found down ({self._down}); it scores again once checked again"
            )
        if self._fingerprint is not None:
            raise EngineUnavailable(
                "the engine failed its last check; it scores again once checked again"
            )
        raise EngineUnavailable("the engine has not been reached yet")

    def _refused(self, path: str, exc: EngineHTTPError) -> EngineUnavailable:
        """The engine (or a gateway) refused ``path``: retryable, naming no address."""
        logger.warning(
            "remote engine %s answered %s with HTTP %d: %s",
            self._client.redacted_url,
            path,
            exc.status,
            exc.detail,
        )
        if exc.status in (401, 403):
            return EngineUnavailable(
                f"the engine refused the credentials (HTTP {exc.status} to {path}): check "
                "RAG_REORDER_ENGINE_API_KEY (or the credentials in RAG_REORDER_ENGINE_URL)"
            )
        return EngineUnavailable(f"the engine answered {path} with HTTP {exc.status}")

    async def _score_chunk(self, chunk: list[SpanRequest]) -> list[ScoreResult]:
        prompts = [list(r.token_ids[: r.span_end]) for r in chunk]
        ids = [r.request_id for r in chunk]
        tokens = sum(len(p) for p in prompts)
        if self._dialect == "sglang":
            items = await self._complete(ids, sglang_dialect.score_body(chunk), tokens)
            return [
                item
                if isinstance(item, PromptFailure)
                else sglang_dialect.span_from_item(req, item)
                for req, item in zip(chunk, items, strict=True)
            ]
        body = {
            "model": self._served,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choices = await self._complete(ids, body, tokens)
        return [
            choice
            if isinstance(choice, PromptFailure)
            else span_from_rows(req, choice.get("prompt_logprobs"))
            for req, choice in zip(chunk, choices, strict=True)
        ]

    async def _generate_chunk(
        self, chunk: list[GenerationRequest], steps: int, stops: frozenset[int]
    ) -> list[GenerateResult]:
        ids = [r.request_id for r in chunk]
        tokens = sum(len(r.token_ids) + steps for r in chunk)
        stop_ids = sorted(stops | self._tokenizer.eos_token_ids)
        if self._dialect == "sglang":
            body = sglang_dialect.generate_body([r.token_ids for r in chunk], steps, stop_ids)
            items = await self._complete(ids, body, tokens)
            return [
                item
                if isinstance(item, PromptFailure)
                else sglang_dialect.generation_from_item(rid, item)
                for rid, item in zip(ids, items, strict=True)
            ]
        body = {
            "model": self._served,
            "prompt": [list(r.token_ids) for r in chunk],
            "max_tokens": steps,  # each prompt's own, cut at the context's end (``generate``)
            "temperature": 0.0,
            "logprobs": 1,
            "stop_token_ids": stop_ids,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        choices = await self._complete(ids, body, tokens)
        return [
            c if isinstance(c, PromptFailure) else generation_from_choice(rid, c)
            for rid, c in zip(ids, choices, strict=True)
        ]

    async def _complete(
        self, request_ids: list[str], body: dict[str, Any], tokens: int
    ) -> list[dict[str, Any] | PromptFailure]:
        """One scoring call for ``request_ids``' prompts (``/v1/completions``, or SGLang's
        ``/generate``): its choices (items) in prompt order, or a ``PromptFailure`` for each
        prompt when the engine refused these prompts (a 4xx) or its answer cannot be read. An
        engine at fault (5xx, 401, 403, 429), unreachable or slow raises instead: its refusal
        says nothing about the prompts."""
        route = self._route
        self._prompts_in_flight += len(request_ids)
        try:
            if self._dialect == "sglang":
                listed = await self._client.post_list(
                    route, body, tokens=tokens, request_id=request_ids[0]
                )
            else:
                answer = await self._client.post(
                    route, body, tokens=tokens, request_id=request_ids[0]
                )
        except EngineHTTPError as exc:
            if exc.status >= 500 or exc.status in _ENGINE_FAULT_4XX:
                raise self._refused(route, exc) from exc
            return [PromptFailure(rid, f"engine refused: {exc.detail}") for rid in request_ids]
        finally:
            self._prompts_in_flight -= len(request_ids)
        if self._dialect == "sglang":
            choices = sglang_dialect.items(listed, len(request_ids))
        else:
            choices = _choices(answer, len(request_ids))
        if choices is None:
            return [PromptFailure(rid, "unreadable engine answer") for rid in request_ids]
        return list(choices)

    async def _check(self) -> tuple[str, int, tuple[float, ...]]:
        """The served name, its context length and the probe's log-probs (``connect``)."""
        url = self._client.redacted_url
        try:
            listed = await self._client.get("/v1/models", request_id="connect-models")
        except EngineHTTPError as exc:
            # A gateway during a rollout answers 404 or 5xx too: not proof of another server.
            raise self._refused("/v1/models", exc) from exc
        data = listed.get("data")
        if not isinstance(data, list):
            raise EngineUnavailable(
                "the engine answered /v1/models without a list of models ('data'), unlike an "
                "OpenAI-compatible server"
            )
        cards = {str(m.get("id")): m for m in data if isinstance(m, dict)}
        served = self._served_setting
        if served is None:
            if len(cards) != 1:
                raise EngineMismatch(
                    f"{url} serves {sorted(cards)}: set RAG_REORDER_ENGINE_MODEL to the one to "
                    "score with"
                )
            served = next(iter(cards))
        if served not in cards:
            raise EngineMismatch(
                f"{url} serves {sorted(cards)}, not {served!r} (RAG_REORDER_ENGINE_MODEL)"
            )
        context = cards[served].get("max_model_len")
        limits = [v for v in (context, self._cap) if isinstance(v, int) and v > 0]
        if not limits:
            raise EngineMismatch(
                f"{served!r} reports no max_model_len; set RAG_REORDER_MAX_MODEL_LEN"
            )
        probe = await self._check_tokenizer(served)
        return served, min(limits), probe

    async def _check_tokenizer(self, served: str) -> tuple[float, ...]:
        """Check ``served``'s tokenizer and scoring of our ids; the probe's log-probs."""
        url = self._client.redacted_url
        if self._dialect == "sglang":
            # Text first: its rows are the tokenizer's check, as /tokenize is vLLM's.
            return await self._compare_probes(*self._sglang_probes(served), text_first=True)
        ours = list(self._tokenizer.encode(PROBE_TEXT).ids)
        try:
            tokenized = await self._client.post(
                "/tokenize",
                {"model": served, "prompt": PROBE_TEXT, "add_special_tokens": False},
                request_id="connect-tokenize",
            )
        except EngineHTTPError as exc:
            raise self._refused("/tokenize", exc) from exc
        theirs = tokenized.get("tokens")
        if not isinstance(theirs, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in theirs
        ):
            raise EngineMismatch(
                f"{url} answers /tokenize without token ids: cannot check that its tokenizer "
                "is ours"
            )
        if theirs != ours:
            pairs = enumerate(zip(ours, theirs, strict=False))
            at = next((k for k, (a, b) in pairs if a != b), None)
            at = min(len(ours), len(theirs)) if at is None else at
            raise EngineMismatch(
                f"the tokenizer of {self._model_id!r} here and of {served!r} at {url} differ: "
                f"{len(ours)} against {len(theirs)} tokens for the probe text, first at token {at}"
            )
        return await self._compare_probes(
            lambda: self._probe(served, ours, [ours], "ids"),
            lambda: self._probe(served, ours, PROBE_TEXT, "text"),
        )

    async def _compare_probes(
        self,
        as_ids: Callable[[], Awaitable[tuple[float, ...]]],
        as_text: Callable[[], Awaitable[tuple[float, ...]]],
        *,
        text_first: bool = False,
    ) -> tuple[float, ...]:
        """The probe's log-probs scored as our ids, once they agree with it scored as text.

        As text the server scores its own tokens: a server or proxy that ignores token-id
        prompts, or another model, shows here. Ids must match exactly (``/tokenize``, or the
        SGLang text probe's rows); log-probs only within the tolerance, since two calls on a
        shared engine are batched with different neighbours and round differently (0.13 nats
        measured in bf16).

        Raises:
            EngineUnavailable: apart by more than the tolerance in every attempt.
        """
        url = self._client.redacted_url
        worst = math.inf
        for attempt in range(1, _PROBE_ATTEMPTS + 1):
            text_logprobs = await as_text() if text_first else None
            ids_logprobs = await as_ids()
            if text_logprobs is None:
                text_logprobs = await as_text()
            worst = _worst(ids_logprobs, text_logprobs)
            if worst <= self._probe_tolerance:
                return ids_logprobs
            logger.warning(
                "remote engine %s: the probe's log-probs differ by %.3g nats between its text "
                "and our token ids (attempt %d of %d, tolerance %g)",
                url,
                worst,
                attempt,
                _PROBE_ATTEMPTS,
                self._probe_tolerance,
            )
        raise EngineUnavailable(
            f"the probe's log-probs differ by {worst:.3g} nats between its text and our token "
            f"ids in {_PROBE_ATTEMPTS} attempts, over RAG_REORDER_ENGINE_PROBE_TOLERANCE "
            f"({self._probe_tolerance:g}): the engine may not score token ids as sent"
        )

    async def _probe(
        self, served: str, ours: list[int], prompt: str | list[list[int]], what: str
    ) -> tuple[float, ...]:
        """The probe's log-probs, sent as ``prompt`` (its text, or our ids)."""
        body: dict[str, Any] = {
            "model": served,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        if isinstance(prompt, str):
            body["add_special_tokens"] = False
        try:
            answer = await self._client.post(
                "/v1/completions", body, tokens=len(ours), request_id=f"connect-probe-{what}"
            )
        except EngineHTTPError as exc:
            raise self._refused("/v1/completions", exc) from exc
        choices = _choices(answer, 1)
        probe = SpanRequest(f"connect-probe-{what}", tuple(ours), 1, len(ours))
        result = span_from_rows(probe, choices[0].get("prompt_logprobs") if choices else None)
        if isinstance(result, PromptFailure):
            raise EngineMismatch(
                f"{served!r} at {self._client.redacted_url} gives no usable prompt log-probs "
                f"for the probe as {what} ({result.reason}): it cannot score"
            )
        return result.logprobs

    def _sglang_probes(
        self, served: str
    ) -> tuple[
        Callable[[], Awaitable[tuple[float, ...]]], Callable[[], Awaitable[tuple[float, ...]]]
    ]:
        """SGLang's probe as our ids and as text (``_compare_probes``). Its tokenizer is
        checked by the text probe's rows, which name the ids the *server* encoded: SGLang
        encodes ``text`` prompts with the tokenizer's special tokens (a BOS for Llama 3), so
        ours are taken the same way, and the ids probe sends exactly those."""
        encoded = self._tokenizer.hf_tokenizer(
            PROBE_TEXT, return_offsets_mapping=False, add_special_tokens=True
        )["input_ids"]
        ours = tuple(int(t) for t in encoded) if isinstance(encoded, list) else ()
        probe = SpanRequest("connect-probe", ours, 1, len(ours))
        ids_body = sglang_dialect.score_body([probe])
        text_body = sglang_dialect.text_probe_body(PROBE_TEXT)
        return (
            lambda: self._sglang_probe(served, ids_body, probe, "ids"),
            lambda: self._sglang_probe(served, text_body, probe, "text"),
        )

    async def _sglang_probe(
        self, served: str, body: dict[str, Any], probe: SpanRequest, what: str
    ) -> tuple[float, ...]:
        """The probe's log-probs from SGLang's ``/generate`` (``body``: as text or as ids).

        Raises:
            EngineMismatch: the text encoded to other ids than ours (another tokenizer: its
                ``prompt_tokens`` or its rows' ids differ), rows for other ids than sent, or
                no usable log-probs.
            EngineUnavailable: rows for part of the probe only (as on a cache hit): retried.
        """
        url = self._client.redacted_url
        route = sglang_dialect.ROUTE
        try:
            answer = await self._client.post_list(
                route, body, tokens=len(probe.token_ids), request_id=f"connect-probe-{what}"
            )
        except EngineHTTPError as exc:
            raise self._refused(route, exc) from exc
        ours = list(probe.token_ids)
        items = sglang_dialect.items(answer, 1)
        meta: dict[str, Any] = items[0]["meta_info"] if items else {}
        rows = meta.get("input_token_logprobs")
        theirs = sglang_dialect.row_token_ids(rows)
        placed = sglang_dialect.placed_rows(ours, 0, rows)
        count = meta.get("prompt_tokens")
        if what == "text" and (
            (isinstance(count, int) and count != len(ours))
            or (theirs is not None and isinstance(placed, str))
        ):
            pairs = enumerate(zip(ours, theirs or [], strict=False))
            at = next((k for k, (a, b) in pairs if a != b), min(len(ours), len(theirs or [])))
            raise EngineMismatch(
                f"the tokenizer of {self._model_id!r} here and of {served!r} at {url} differ: "
                f"{len(ours)} against {count} tokens for the probe text (rows from token "
                f"{at} on differ or are missing)"
            )
        if isinstance(placed, str):
            raise EngineMismatch(
                f"{served!r} at {url} gives no usable prompt log-probs for the probe as {what} "
                f"({placed}): it cannot score"
            )
        if any(placed.get(p) is None for p in range(1, len(ours))):
            raise EngineUnavailable(
                f"the engine answered log-probs for part of the probe as {what} only "
                f"({len(placed)} rows of {len(ours)}), as SGLang has on cache hits"
            )
        result = sglang_dialect.span_from_item(probe, {"meta_info": meta})
        if isinstance(result, PromptFailure):
            raise EngineMismatch(
                f"{served!r} at {url} gives no usable prompt log-probs for the probe as {what} "
                f"({result.reason}): it cannot score"
            )
        return result.logprobs


def _worst(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest difference between two probes' log-probs (nats)."""
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


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
    request (``serving.execution``) then takes for its own cancellation.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
