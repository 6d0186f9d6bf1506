"""A deterministic ``LogprobBackend`` with a known truth: passage utilities and position bias.

Part of the backend contract, not a test helper: contract tests, the app's tests and the
evaluation harness run the whole pipeline against it without a model and check that the fit
recovers the truth it was built with.

Scoring rule. A request's tokens up to ``span_end`` are decoded with the ``ByteTokenizer``;
the known passage texts (the keys of ``truth``) found in that text, by position, fill slots
``0..L-1``. With ``a = bias(L)`` (non-negative, normalised to sum 1), ``u`` the utilities,
``lam = query_logprob_per_token`` and ``n`` the number of span tokens that are not inside a
passage, the span's log-probs sum to::

    s = lam * n - max(0, max_p u_p) - 8 * noise + sum_j a_j * u[slot j] + noise * eps

``eps`` is a standard normal clipped to [-8, 8], seeded by ``seed`` and a hash of the token ids
and the span, so identical prompts get identical scores. The constant terms make every
per-token log-prob <= 0; they are the same for every permutation of one query, so orders and
the fitted (a, u) are unaffected. ``s`` is spread evenly over the ``n`` tokens; a span token
inside a passage (only in ``joint`` requests) gets ``passage_logprob_per_token`` instead.
With a joint request, the query's own tokens therefore carry ``s`` scaled by
``n_query / n`` (the template's separators between passages share it), not ``s`` exactly.

Generation rule. The answer is ``answers[text]`` when given, else the first ``answer_words``
words of the highest-utility passage present (earliest slot on ties), followed by the
end-of-turn token; every generated token has log-prob ``log(sigmoid(u))`` of that passage, so a
more useful passage gives a more confident answer. With no known passage present the answer is
``no_answer`` at log-prob ``log(1/2)`` per token. Generation stops after a token in
``stop_token_ids`` or the tokenizer's end tokens (``finish_reason="stop"``, the token included)
or at ``max_new_tokens`` (``"length"``).

Fused scoring. A generation request's ``score_ids`` get exactly the log-probs ``score`` gives
the span ``[len(token_ids), len(token_ids) + len(score_ids))`` of ``token_ids + score_ids``
(the failure rules and the context limit apply to that longer prompt too, after the answer's);
when that scoring fails, the whole request comes back as ``PromptFailure``, as on a real
backend, where both come from one forward.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import anyio
import numpy as np

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.tokenizers.byte_tokenizer import END_OF_TURN_ID, ByteTokenizer
from service.errors import BackendUnavailable

BiasSpec = Sequence[float] | Callable[[int], Sequence[float]]

_NOISE_CLIP = 8.0


def primacy_bias(n_slots: int) -> tuple[float, ...]:
    """Linearly decreasing weights ``a_j = (L - j) / (L (L + 1) / 2)``: the fake's default."""
    total = n_slots * (n_slots + 1) / 2
    return tuple((n_slots - j) / total for j in range(n_slots))


@dataclass(frozen=True, slots=True)
class FakePrompt:
    """What failure rules see of one request: its id, text and the known passages in it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    passages: tuple[str, ...]
    """Known passage texts in slot order."""


PromptRule = Callable[[FakePrompt], bool]


@dataclass(slots=True)
class FakeBackendStats:
    """Counters, for tests that check how much work a strategy asked for."""

    score_calls: int = 0
    generate_calls: int = 0
    prompts_scored: int = 0
    """Prompts whose log-probs were read: by ``score``, and generations with score ids."""
    prompt_tokens: int = 0
    """Tokens of all prompts received (scored and generated from): the prefill cost."""
    span_tokens: int = 0
    generated_tokens: int = 0
    failures: int = 0


@dataclass(frozen=True, slots=True)
class _Parsed:
    prompt: FakePrompt
    passage_token_ranges: tuple[range, ...]
    """Token indices of each known passage occurrence."""

    def passage_tokens(self, span: range) -> frozenset[int]:
        """Indices in ``span`` that lie inside a passage."""
        inside: set[int] = set()
        for tokens in self.passage_token_ranges:
            inside.update(range(max(tokens.start, span.start), min(tokens.stop, span.stop)))
        return frozenset(inside)


class FakeBackend:
    """Deterministic ``LogprobBackend`` with known utilities and position bias (module doc).

    Failure injection, all settable after construction: ``fail_ids`` / ``fail_rule`` make a
    prompt come back as ``PromptFailure``; ``nan_ids`` / ``nan_rule`` put a NaN in its log-probs
    (breaking the port's contract on purpose, to test the caller's guard); ``delay_s`` sleeps
    before answering each call; ``hang`` never answers (until cancelled); ``s_per_token``
    makes it an engine of fixed capacity: calls run one at a time, in arrival order, each for
    its prompt tokens times ``s_per_token`` (overload and admission tests), a generation also
    for its answer budget times ``s_per_new_token`` (default ``s_per_token``; a real engine's
    decode is much slower per token than its prefill).

    Args:
        truth: passage text -> true utility. Every passage of a request must be a key; texts
            are found in the prompt by exact match (a key inside a longer matched key counts
            only as part of it).
        bias: slot weights: a sequence used for prompts of exactly that many passages, or a
            callable ``L -> weights``; default ``primacy_bias``. Normalised to sum 1.
        noise: standard deviation of the score noise, in nats.
        seed: noise seed.
        query_logprob_per_token: ``lam`` of the formula, <= 0.
        passage_logprob_per_token: log-prob of a passage token inside a scored span, <= 0.
        answers: passage text -> generated answer (default: its first ``answer_words`` words).
        answer_words: words of the passage used as the default answer.
        no_answer: the answer when no known passage is in the prompt.
        max_model_len: longer prompts come back as ``PromptFailure``.
        model_id: reported model id.

    Raises:
        ValueError: a non-finite utility, positive per-token log-prob or negative noise.
    """

    def __init__(
        self,
        truth: Mapping[str, float],
        *,
        bias: BiasSpec = primacy_bias,
        noise: float = 0.0,
        seed: int = 0,
        query_logprob_per_token: float = -2.0,
        passage_logprob_per_token: float = -1.0,
        answers: Mapping[str, str] | None = None,
        answer_words: int = 3,
        no_answer: str = "unknown",
        max_model_len: int = 32768,
        model_id: str = "fake/known-truth",
        fail_ids: Collection[str] = (),
        fail_rule: PromptRule | None = None,
        nan_ids: Collection[str] = (),
        nan_rule: PromptRule | None = None,
        delay_s: float = 0.0,
        hang: bool = False,
        s_per_token: float = 0.0,
        s_per_new_token: float | None = None,
    ) -> None:
        if not all(math.isfinite(u) for u in truth.values()):
            raise ValueError("utilities must be finite")
        if query_logprob_per_token > 0 or passage_logprob_per_token > 0:
            raise ValueError("per-token log-probs must be <= 0")
        if not noise >= 0:
            raise ValueError("noise must be >= 0")
        if seed < 0:
            raise ValueError("seed must be >= 0")
        self.truth = dict(truth)
        self.bias = bias
        self.noise = float(noise)
        self.seed = seed
        self.query_logprob_per_token = float(query_logprob_per_token)
        self.passage_logprob_per_token = float(passage_logprob_per_token)
        self.answers = dict(answers or {})
        self.answer_words = answer_words
        self.no_answer = no_answer
        self.fail_ids: set[str] = set(fail_ids)
        self.fail_rule = fail_rule
        self.nan_ids: set[str] = set(nan_ids)
        self.nan_rule = nan_rule
        self.delay_s = delay_s
        self.hang = hang
        self.s_per_token = s_per_token
        self.s_per_new_token = s_per_token if s_per_new_token is None else s_per_new_token
        # Made on first use (tests run one backend under several event loops); anyio's lock
        # hands over in arrival order: a FIFO engine.
        self._engine: anyio.Lock | None = None
        self.stats = FakeBackendStats()
        self.closed = False
        self._tokenizer = ByteTokenizer()
        self._max_model_len = max_model_len
        self._model_id = model_id
        # Longest first: at equal start positions the longer key wins (keys may nest).
        self._keys = sorted(self.truth, key=len, reverse=True)

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    def bias_for(self, n_slots: int) -> tuple[float, ...]:
        """The normalised true slot weights for a prompt showing ``n_slots`` passages.

        Raises:
            ValueError: the bias has the wrong length, a negative or non-finite weight, or
                sums to 0.
        """
        raw = self.bias(n_slots) if callable(self.bias) else self.bias
        weights = [float(w) for w in raw]
        if len(weights) != n_slots:
            raise ValueError(f"bias has {len(weights)} weights for {n_slots} slots")
        if not all(math.isfinite(w) and w >= 0 for w in weights) or (n_slots and not sum(weights)):
            raise ValueError(f"bias weights must be finite, >= 0 and not all 0: {weights}")
        total = sum(weights)
        return tuple(w / total for w in weights)

    def expected_score(self, passages_in_order: Sequence[str], n_query_tokens: int) -> float:
        """``s`` of the module formula without the noise term, for tests and harnesses.

        Args:
            passages_in_order: known passage texts, slot order.
            n_query_tokens: ``n`` of the formula (non-passage tokens of the span).

        Returns:
            The noiseless sum of the span's log-probs.
        """
        weights = self.bias_for(len(passages_in_order))
        signal = sum(a * self.truth[p] for a, p in zip(weights, passages_in_order, strict=True))
        return self._baseline(n_query_tokens) + signal

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Span log-probs by the module's scoring rule, one result per request.

        Raises:
            BackendUnavailable: the backend was closed.
            ValueError: a request's span is outside its tokens or starts at token 0.
        """
        await self._enter()
        await self._occupy(sum(len(r.token_ids) for r in requests))
        self.stats.score_calls += 1
        results: list[ScoreResult] = []
        for request in requests:
            if not 1 <= request.span_start < request.span_end <= len(request.token_ids):
                raise ValueError(
                    f"request {request.request_id!r}: span [{request.span_start}, "
                    f"{request.span_end}) is invalid for {len(request.token_ids)} tokens"
                )
            self.stats.prompt_tokens += len(request.token_ids)
            result = self._score_one(request)
            if isinstance(result, PromptFailure):
                self.stats.failures += 1
            else:
                self.stats.prompts_scored += 1
                self.stats.span_tokens += len(result.logprobs)
            results.append(result)
        return results

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Answers by the module's generation rule, one result per request, with the
        ``score_ids``' log-probs by its scoring rule (module docstring: fused scoring).

        Raises:
            BackendUnavailable: the backend was closed.
            ValueError: ``max_new_tokens < 1``.
        """
        await self._enter()
        prefill = sum(len(r.token_ids) + len(r.score_ids) for r in requests)
        decode_s = self.s_per_new_token * sum(r.max_new_tokens for r in requests)
        await self._occupy(prefill, decode_s)
        self.stats.generate_calls += 1
        results: list[GenerateResult] = []
        for request in requests:
            if request.max_new_tokens < 1:
                raise ValueError(f"request {request.request_id!r}: max_new_tokens must be >= 1")
            # The score ids are prefilled after the prompt: one longer prompt, not two.
            self.stats.prompt_tokens += len(request.token_ids) + len(request.score_ids)
            result = self._generate_one(request)
            if isinstance(result, PromptFailure):
                self.stats.failures += 1
            else:
                self.stats.generated_tokens += len(result.token_ids)
                if result.score_logprobs is not None:
                    self.stats.prompts_scored += 1
                    self.stats.span_tokens += len(result.score_logprobs)
            results.append(result)
        return results

    async def aclose(self) -> None:
        self.closed = True

    async def _enter(self) -> None:
        if self.closed:
            raise BackendUnavailable("the fake backend is closed")
        if self.hang:
            await anyio.sleep_forever()
        if self.delay_s > 0:
            await anyio.sleep(self.delay_s)

    async def _occupy(self, tokens: int, decode_s: float = 0.0) -> None:
        """Hold the one engine for ``tokens`` x ``s_per_token`` plus ``decode_s`` (nothing
        when that is 0)."""
        seconds = tokens * self.s_per_token + decode_s
        if seconds > 0:
            if self._engine is None:
                self._engine = anyio.Lock()
            async with self._engine:
                await anyio.sleep(seconds)

    def _score_one(self, request: SpanRequest) -> ScoreResult:
        parsed = self._parse(request.request_id, request.token_ids[: request.span_end])
        if isinstance(parsed, PromptFailure):
            return parsed
        prompt = parsed.prompt
        failure = self._injected_failure(prompt, len(request.token_ids))
        if failure is not None:
            return failure
        span = range(request.span_start, request.span_end)
        passage_tokens = parsed.passage_tokens(span)
        query_tokens = [k for k in span if k not in passage_tokens]
        weights = self.bias_for(len(prompt.passages))
        signal = sum(a * self.truth[p] for a, p in zip(weights, prompt.passages, strict=True))
        total = self._baseline(len(query_tokens)) + signal + self.noise * self._eps(request)
        per_query_token = total / len(query_tokens) if query_tokens else 0.0
        logprobs = [
            self.passage_logprob_per_token if k in passage_tokens else per_query_token for k in span
        ]
        if request.request_id in self.nan_ids or (self.nan_rule and self.nan_rule(prompt)):
            logprobs[len(logprobs) // 2] = math.nan
        return SpanLogprobs(request_id=request.request_id, logprobs=tuple(logprobs))

    def _generate_one(self, request: GenerationRequest) -> GenerateResult:
        parsed = self._parse(request.request_id, request.token_ids)
        if isinstance(parsed, PromptFailure):
            return parsed
        prompt = parsed.prompt
        failure = self._injected_failure(prompt, len(request.token_ids))
        if failure is not None:
            return failure
        if prompt.passages:
            # max() keeps the first maximum: the earliest slot wins ties.
            best = max(prompt.passages, key=lambda p: self.truth[p])
            answer = self.answers.get(best) or " ".join(best.split()[: self.answer_words])
            # log(sigmoid(u)), computed without overflow for large |u|.
            logprob = -float(np.logaddexp(0.0, -self.truth[best]))
        else:
            answer, logprob = self.no_answer, math.log(0.5)
        planned = [*self._tokenizer.encode(answer).ids, END_OF_TURN_ID]
        stops = request.stop_token_ids | self._tokenizer.eos_token_ids
        room = min(request.max_new_tokens, self._max_model_len - len(request.token_ids))
        out: list[int] = []
        finish = "length"
        for token in planned[:room]:
            out.append(token)
            if token in stops:
                finish = "stop"
                break
        logprobs = [logprob] * len(out)
        if request.request_id in self.nan_ids or (self.nan_rule and self.nan_rule(prompt)):
            logprobs[0] = math.nan
        score_logprobs: tuple[float, ...] | None = None
        if request.score_ids:
            n = len(request.token_ids)
            scored = self._score_one(
                SpanRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids + request.score_ids,
                    span_start=n,
                    span_end=n + len(request.score_ids),
                )
            )
            if isinstance(scored, PromptFailure):
                return scored
            score_logprobs = scored.logprobs
        return Generation(
            request_id=request.request_id,
            token_ids=tuple(out),
            logprobs=tuple(logprobs),
            finish_reason=finish,
            score_logprobs=score_logprobs,
        )

    def _injected_failure(self, prompt: FakePrompt, n_tokens: int) -> PromptFailure | None:
        if n_tokens > self._max_model_len:
            return PromptFailure(
                prompt.request_id,
                f"prompt is {n_tokens} tokens, over max_model_len {self._max_model_len}",
            )
        if prompt.request_id in self.fail_ids or (self.fail_rule and self.fail_rule(prompt)):
            return PromptFailure(prompt.request_id, "injected failure (fake backend)")
        return None

    def _parse(self, request_id: str, token_ids: tuple[int, ...]) -> _Parsed | PromptFailure:
        try:
            text = self._tokenizer.decode(token_ids)
        except ValueError as exc:
            return PromptFailure(request_id, f"not ByteTokenizer ids: {exc}")
        encoding = self._tokenizer.encode(text)
        if encoding.ids != token_ids:
            # A cut multi-byte character or foreign ids: the text does not round-trip.
            return PromptFailure(request_id, "token ids are not a ByteTokenizer encoding")
        found = self._find_passages(text)
        # ByteTokenizer offsets never decrease, so each passage's tokens are one bisected range.
        offsets = encoding.offsets
        ranges = tuple(
            range(
                bisect.bisect_left(offsets, start, key=lambda o: o[0]),
                bisect.bisect_left(offsets, end, key=lambda o: o[0]),
            )
            for start, end, _ in found
        )
        prompt = FakePrompt(
            request_id=request_id,
            token_ids=token_ids,
            text=text,
            passages=tuple(p for _, _, p in found),
        )
        return _Parsed(prompt=prompt, passage_token_ranges=ranges)

    def _find_passages(self, text: str) -> list[tuple[int, int, str]]:
        hits: list[tuple[int, int, str]] = []
        for key in self._keys:
            start = text.find(key)
            while start >= 0:
                hits.append((start, start + len(key), key))
                start = text.find(key, start + 1)
        # Earliest first, longest first at one position; drop hits overlapping a kept one.
        hits.sort(key=lambda h: (h[0], -(h[1] - h[0])))
        kept: list[tuple[int, int, str]] = []
        for hit in hits:
            if not kept or hit[0] >= kept[-1][1]:
                kept.append(hit)
        return kept

    def _baseline(self, n_query_tokens: int) -> float:
        top = max(self.truth.values(), default=0.0)
        return (
            self.query_logprob_per_token * n_query_tokens - max(0.0, top) - _NOISE_CLIP * self.noise
        )

    def _eps(self, request: SpanRequest) -> float:
        if self.noise == 0:
            return 0.0
        ids = np.asarray(request.token_ids, dtype=np.uint32).tobytes()
        span = np.asarray([request.span_start, request.span_end], dtype=np.uint32).tobytes()
        digest = hashlib.blake2b(ids + span, digest_size=8).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest, "little")])
        return float(np.clip(rng.standard_normal(), -_NOISE_CLIP, _NOISE_CLIP))
