"""``Work``: one request's metered access to the model.

A strategy never talks to the backend directly: it goes through ``Work``. ``Work`` builds
prompts off the event loop, sends each distinct prompt once, turns failed or non-finite prompts
into ``None`` (the strategy degrades, the request does not fail), and keeps the cost ledger
every response reports (prompts scored, tokens prefilled, tokens scored, answers and tokens
generated, time in the model).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import anyio.to_thread
import numpy as np

from service.backends.base import (
    Generation,
    GenerationRequest,
    LogprobBackend,
    PromptFailure,
    SpanRequest,
)
from service.config.settings import Settings
from service.errors import InvalidRequest, ScoringFailed
from service.passage import Passage
from service.prompting.answers import first_line
from service.prompting.prompts import (
    BuiltPrompt,
    PromptSize,
    build_generation_prompt,
    build_prompts,
    prompt_size,
)
from service.prompting.templates import get_template
from service.runtime import tracing
from service.runtime.solver_pool import shared_pool
from service.strategies.request import Answer, Cost, Estimate, PromptScore, Usage

if TYPE_CHECKING:
    from service.learning.learner import ProfileLearner
    from service.state.profile_store import ProfileStore
    from service.state.traffic import TrafficSampler

log = logging.getLogger(__name__)

T = TypeVar("T")


class RequestGate(Protocol):
    """Admission of a request as a whole (the server's is
    ``serving.admission.backends.AdmittedBackend``)."""

    def admit(self, estimate: Estimate) -> float | None:
        """Admit the request's estimated work or raise; returns its estimated seconds on an
        idle engine (``None``: no measured rate to estimate with).

        Raises:
            Overloaded: the queue ahead would not let it finish by its deadline (503).
            DeadlineUnreachable: it cannot finish by its deadline even on an idle engine.
        """
        ...

    def release(self) -> None:
        """The request is done: give back what its calls did not take of the estimate."""
        ...

    def estimate_s(self, estimate: Estimate) -> float | None:
        """Seconds until the estimated work would be done if admitted now (the queue ahead
        and its own; ``None``: no measured rate). Admits nothing."""
        ...


class Work:
    """One request's metered access to the model (see the module docstring)."""

    def __init__(
        self,
        backend: LogprobBackend,
        settings: Settings,
        request_id: str,
        template: str,
        profiles: ProfileStore,
        traffic: TrafficSampler | None = None,
        learner: ProfileLearner | None = None,
        gate: RequestGate | None = None,
    ) -> None:
        self.backend = backend
        self.gate = gate
        self.settings = settings
        self.request_id = request_id
        self.template = template
        self.profiles = profiles
        self.traffic = traffic
        self.learner = learner
        """``auto``'s profile learner (the server's); ``None``: decide from stored profiles."""
        self.tokenize_s = 0.0
        self.model_s = 0.0
        self.solver_s = 0.0
        self.planned = 0  # model calls asked for, before de-duplication
        self.estimated_s: float | None = None  # admission's estimate (``admit``)
        self._scored = 0
        self._failed = 0
        self._prompt_tokens = 0
        self._scored_tokens = 0
        self._generations = 0
        self._generated_tokens = 0
        self._next_id = 0

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    def usage(self) -> Usage:
        return Usage(
            prompts=self.planned,
            prompts_scored=self._scored,
            prompts_failed=self._failed,
            prompt_tokens=self._prompt_tokens,
            scored_tokens=self._scored_tokens,
            generations=self._generations,
            generated_tokens=self._generated_tokens,
        )

    def new_id(self) -> str:
        self._next_id += 1
        return f"{self.request_id}-{self._next_id - 1}"

    async def admit(self, cost: Cost, query: str, passages: Sequence[Passage]) -> None:
        """Have the request's whole model work admitted before its first prompt is built.

        The prompts' tokens are estimated from one rendered prompt without passages and each
        passage's block (``prompt_size``, off the loop): a refusal comes in milliseconds, not
        after tokenising every prompt. Without a gate (calibration's own runs, the CLI, the
        tests) nothing is checked.

        Raises:
            as ``RequestGate.admit``; InvalidRequest as ``build_prompt``.
        """
        if self.gate is None or not cost.calls:
            return
        estimate = await self.estimate(cost, query, passages)
        with tracing.span(
            "rag_reorder.admission",
            {
                "rag_reorder.prompts": estimate.prompts,
                "rag_reorder.prompt_tokens": estimate.prompt_tokens,
                "rag_reorder.new_tokens": estimate.new_tokens,
            },
        ) as span:
            self.estimated_s = self.gate.admit(estimate)
            if self.estimated_s is not None:
                tracing.set_attributes(span, {"rag_reorder.estimated_s": self.estimated_s})

    async def estimate_s(self, cost: Cost, query: str, passages: Sequence[Passage]) -> float | None:
        """Seconds until ``cost``'s model work would be done if admitted now (the queue ahead
        and its own, at the measured rates), without admitting it; ``None`` without a gate
        or a measured rate."""
        if self.gate is None or not cost.calls:
            return None
        return self.gate.estimate_s(await self.estimate(cost, query, passages))

    async def estimate(self, cost: Cost, query: str, passages: Sequence[Passage]) -> Estimate:
        """``cost``'s prompts, prompt tokens and answer budget, from one rendered prompt
        without passages and each passage's block per prompt shape (off the loop)."""
        tokenizer = self.backend.tokenizer

        def per_prompt() -> list[int]:
            # Each shape's prompt as it will be built: its template, a generation prompt's
            # assistant header, and the continuation scored after it.
            sizes: dict[tuple[str, bool], PromptSize] = {}
            tokens: list[int] = []
            for c in cost.calls:
                key = (c.template or self.template, c.generation)
                if key not in sizes:
                    sizes[key] = prompt_size(
                        tokenizer, key[0], query, passages, generation=c.generation
                    )
                extra = len(tokenizer.encode(c.continuation).ids) if c.continuation else 0
                tokens.append(sizes[key].tokens(c.passages) + extra)
            return tokens

        tokens = await self.off_loop(per_prompt, timer="tokenize")
        return Estimate(
            prompts=sum(c.sent for c in cost.calls),
            prompt_tokens=sum(c.sent * t for c, t in zip(cost.calls, tokens, strict=True)),
            new_tokens=sum(c.sent * c.new_tokens for c in cost.calls),
            param=cost.param,
        )

    async def off_loop(self, fn: Callable[[], T], *, timer: Literal["tokenize", "solver"]) -> T:
        """Run CPU work (tokenising, fitting) in a worker thread, timed into ``timer``."""
        t0 = time.perf_counter()
        try:
            return await anyio.to_thread.run_sync(fn)
        finally:
            if timer == "tokenize":
                self.tokenize_s += time.perf_counter() - t0
            else:
                self.solver_s += time.perf_counter() - t0

    async def solve(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` (a module-level solver function) in the solver's worker
        processes (``solver_processes``; a thread when 0), timed into ``solver_s``."""
        pool = shared_pool(self.settings.solver_processes, self.settings.cpus)
        name = getattr(fn, "__qualname__", "solver")
        with tracing.span("rag_reorder.fit", {"rag_reorder.solver.function": name}):
            if pool is None:
                return await self.off_loop(lambda: fn(*args, **kwargs), timer="solver")
            t0 = time.perf_counter()
            try:
                return await pool.run(fn, *args, **kwargs)
            finally:
                self.solver_s += time.perf_counter() - t0

    async def scoring_prompts(
        self, query: str, passages: Sequence[Passage], orders: Sequence[Sequence[int]]
    ) -> list[BuiltPrompt]:
        """Scoring prompts (query at the end of the user turn) for ``orders``, off the loop.

        Raises:
            InvalidRequest, LimitExceeded, PromptAlignmentError: as ``build_prompts``.
        """
        return await self.off_loop(
            lambda: build_prompts(
                self.backend.tokenizer,
                self.template,
                query,
                passages,
                orders,
                max_tokens=self.backend.max_model_len,
                # Stop tokenising once the request is certainly over its token budget: the
                # refusal comes before gigabytes of encodings, not after.
                max_total_tokens=self.settings.max_prompt_tokens_x_prompts,
            ),
            timer="tokenize",
        )

    async def generation_prompts(
        self,
        query: str,
        passages: Sequence[Passage],
        orders: Sequence[Sequence[int]],
        *,
        template: str | None = None,
        room: int = 0,
    ) -> list[BuiltPrompt]:
        """Prompts ending in the assistant turn, one per order, off the loop.

        Args:
            template: the prompt template (default: the request's).
            room: tokens that must stay free after the prompt (the answer's budget).

        Raises:
            InvalidRequest, LimitExceeded, PromptAlignmentError: as ``build_generation_prompt``.
        """
        name = template or self.template
        limit = self.backend.max_model_len - room

        def build() -> list[BuiltPrompt]:
            return [
                build_generation_prompt(
                    self.backend.tokenizer, name, query, passages, order, max_tokens=limit
                )
                for order in orders
            ]

        return await self.off_loop(build, timer="tokenize")

    async def score_spans(self, requests: Sequence[SpanRequest]) -> list[tuple[float, ...] | None]:
        """Per-token log-probs of each request's span; ``None`` where the prompt failed.

        Identical requests are sent once. Every returned row has the span's length and only
        finite values.

        Raises:
            ScoringFailed: the backend answered the wrong number of requests.
            BackendUnavailable: the backend is unusable.
        """
        if not requests:
            return []
        self.planned += len(requests)
        unique: dict[tuple[tuple[int, ...], int, int], int] = {}
        sent: list[SpanRequest] = []
        index: list[int] = []
        for r in requests:
            key = (r.token_ids, r.span_start, r.span_end)
            k = unique.get(key)
            if k is None:
                k = unique[key] = len(sent)
                sent.append(
                    SpanRequest(
                        request_id=self.new_id(),
                        token_ids=r.token_ids,
                        span_start=r.span_start,
                        span_end=r.span_end,
                    )
                )
            index.append(k)
        t0 = time.perf_counter()
        try:
            with tracing.span("rag_reorder.engine.score", _call_attributes(self, sent)):
                results = await self.backend.score(sent)
        finally:
            self.model_s += time.perf_counter() - t0
        if len(results) != len(sent):
            raise ScoringFailed(f"backend answered {len(results)} of {len(sent)} prompts")
        rows: list[tuple[float, ...] | None] = []
        for req, res in zip(sent, results, strict=True):
            row: tuple[float, ...] | None = None
            if isinstance(res, PromptFailure):
                log.warning("prompt %s failed: %s", res.request_id, res.reason)
            elif len(res.logprobs) != req.span_end - req.span_start:
                log.warning(
                    "prompt %s: %d log-probs for a %d-token span",
                    req.request_id,
                    len(res.logprobs),
                    req.span_end - req.span_start,
                )
            elif not all(math.isfinite(v) for v in res.logprobs):
                log.warning("prompt %s: non-finite log-prob", req.request_id)
            else:
                row = tuple(res.logprobs)
            if row is None:
                self._failed += 1
            rows.append(row)
        self._scored += len(sent)
        self._prompt_tokens += sum(len(r.token_ids) for r in sent)
        self._scored_tokens += sum(r.span_end - r.span_start for r in sent)
        return [rows[k] for k in index]

    async def score_prompts(
        self, prompts: Sequence[BuiltPrompt], *, joint: bool = False
    ) -> list[PromptScore | None]:
        """The query's (and with ``joint`` the passages') log-probs in each scoring prompt.

        Tokens after the query are never sent (a causal model's query log-probs do not depend
        on them).
        """
        requests = [p.span_request("", joint=joint) for p in prompts]
        rows = await self.score_spans(requests)
        out: list[PromptScore | None] = []
        for prompt, row in zip(prompts, rows, strict=True):
            if row is None:
                out.append(None)
                continue
            start, _ = prompt.scored_span(joint=joint)
            q0, q1 = prompt.query_span
            passages = 0.0
            if joint:
                passages = float(
                    sum(sum(row[s - start : e - start]) for s, e in prompt.passage_spans)
                )
            out.append(PromptScore(np.asarray(row[q0 - start : q1 - start]), passages))
        return out

    async def continuation_logprobs(
        self, prompts: Sequence[BuiltPrompt], continuation: str
    ) -> list[tuple[float, ...] | None]:
        """Teacher-forced log-probs of ``continuation`` as the assistant's reply to each prompt.

        The continuation is tokenised on its own and appended to the generation prompt's ids:
        the same ids a generator would have to produce, token by token.

        Raises:
            InvalidRequest: the continuation is empty.
        """
        ids = await self._continuation_ids(continuation)
        requests = [
            SpanRequest(
                request_id="",
                token_ids=p.token_ids + ids,
                span_start=len(p.token_ids),
                span_end=len(p.token_ids) + len(ids),
            )
            for p in prompts
        ]
        return await self.score_spans(requests)

    async def generate(
        self, prompts: Sequence[BuiltPrompt], *, max_new_tokens: int
    ) -> list[Answer | None]:
        """Greedy answers to generation prompts; ``None`` where the prompt failed.

        Identical prompts are generated once (greedy decoding is deterministic).
        """
        return [answer for answer, _ in await self._generate(prompts, max_new_tokens, ())]

    async def generate_and_score(
        self, prompts: Sequence[BuiltPrompt], continuation: str, *, max_new_tokens: int
    ) -> list[tuple[Answer | None, tuple[float, ...] | None]]:
        """``generate`` and ``continuation_logprobs`` on the same prompts, from one prefill each.

        The continuation's ids (tokenised as ``continuation_logprobs`` does) travel with each
        generation request (``GenerationRequest.score_ids``): the backend scores them from
        the prefill that starts the answer instead of forwarding the prompt a second time.
        The usage counts one model call per prompt, prefilling the prompt and the
        continuation, with the continuation's tokens scored.

        Returns:
            Per prompt, the answer (``None`` where generation failed) and the continuation's
            per-token log-probs (``None`` where scoring failed); a prompt that failed on the
            backend has neither.

        Raises:
            InvalidRequest: the continuation is empty.
            ScoringFailed: the backend answered the wrong number of prompts.
            BackendUnavailable: the backend is unusable.
        """
        ids = await self._continuation_ids(continuation)
        return await self._generate(prompts, max_new_tokens, ids)

    async def _continuation_ids(self, continuation: str) -> tuple[int, ...]:
        ids = await self.off_loop(
            lambda: self.backend.tokenizer.encode(continuation).ids, timer="tokenize"
        )
        if not ids:
            raise InvalidRequest("continuation is empty", param="continuation")
        return ids

    async def _generate(
        self, prompts: Sequence[BuiltPrompt], max_new_tokens: int, score_ids: tuple[int, ...]
    ) -> list[tuple[Answer | None, tuple[float, ...] | None]]:
        """Greedy answers, with ``score_ids`` scored after each prompt when given; identical
        prompts are sent once.

        A completion template's answer is the line after its answer prefix: its generation
        stops at the first line break (``PromptTokenizer.line_break_ids``) instead of running
        on into the next "Question:" a base model writes, up to ``max_new_tokens``.
        """
        if not prompts:
            return []
        self.planned += len(prompts)
        tokenizer = self.backend.tokenizer
        completion = {p.template: get_template(p.template).completion for p in prompts}
        one_line = frozenset[int]()
        if any(completion.values()):
            # Decoding the vocabulary the first time takes seconds: not on the event loop.
            one_line = await self.off_loop(lambda: tokenizer.line_break_ids, timer="tokenize")
        unique: dict[tuple[int, ...], int] = {}
        sent: list[GenerationRequest] = []
        index: list[int] = []
        for p in prompts:
            k = unique.get(p.token_ids)
            if k is None:
                k = unique[p.token_ids] = len(sent)
                sent.append(
                    GenerationRequest(
                        request_id=self.new_id(),
                        token_ids=p.token_ids,
                        max_new_tokens=max_new_tokens,
                        stop_token_ids=one_line if completion[p.template] else frozenset(),
                        score_ids=score_ids,
                    )
                )
            index.append(k)
        t0 = time.perf_counter()
        try:
            with tracing.span("rag_reorder.engine.generate", _call_attributes(self, sent)):
                results = await self.backend.generate(sent)
        finally:
            self.model_s += time.perf_counter() - t0
        if len(results) != len(sent):
            raise ScoringFailed(f"backend answered {len(results)} of {len(sent)} generations")
        eos = tokenizer.eos_token_ids
        rows: list[tuple[Answer | None, tuple[float, ...] | None]] = []
        for req, res in zip(sent, results, strict=True):
            if isinstance(res, PromptFailure):
                log.warning("generation %s failed: %s", res.request_id, res.reason)
                self._failed += 1
                rows.append((None, None))
                continue
            answer: Answer | None = None
            if all(math.isfinite(v) for v in res.logprobs):
                self._generated_tokens += len(res.token_ids)
                answer = _answer(res, eos, req.stop_token_ids, tokenizer.decode)
            else:
                log.warning("generation %s failed: non-finite log-prob", res.request_id)
            scores = _checked_scores(res, len(score_ids)) if score_ids else None
            if answer is None or (score_ids and scores is None):
                self._failed += 1  # one prompt, whichever of its two parts failed
            rows.append((answer, scores))
        self._generations += len(sent)
        # The score ids are prefilled after the prompt, in the same forward: one longer prompt.
        self._prompt_tokens += sum(len(r.token_ids) + len(r.score_ids) for r in sent)
        if score_ids:
            self._scored += len(sent)
            self._scored_tokens += len(sent) * len(score_ids)
        return [rows[k] for k in index]


def _call_attributes(
    work: Work, sent: Sequence[SpanRequest] | Sequence[GenerationRequest]
) -> tracing.Attributes | None:
    """An engine call's span attributes: its prompts and their tokens (only when traced)."""
    if not tracing.enabled():
        return None
    tokens = sum(len(r.token_ids) for r in sent)
    if sent and isinstance(sent[0], GenerationRequest):
        tokens += sum(len(r.score_ids) for r in sent if isinstance(r, GenerationRequest))
    return {
        "rag_reorder.model": work.backend.model_id,
        "rag_reorder.prompts": len(sent),
        "rag_reorder.prompt_tokens": tokens,
    }


def _checked_scores(gen: Generation, expected: int) -> tuple[float, ...] | None:
    """A generation's score log-probs if there is one finite value per score id, else None."""
    values = gen.score_logprobs
    if values is None or len(values) != expected:
        log.warning(
            "generation %s: %s score log-probs for %d score ids",
            gen.request_id,
            "no" if values is None else len(values),
            expected,
        )
        return None
    if not all(math.isfinite(v) for v in values):
        log.warning("generation %s: non-finite score log-prob", gen.request_id)
        return None
    return tuple(values)


def _answer(
    gen: Generation,
    eos: frozenset[int],
    line_breaks: frozenset[int],
    decode: Callable[[Sequence[int]], str],
) -> Answer:
    """The answer in ``gen``: its text and log-probs without the token that ended it (an
    end-of-turn id in ``eos``, or for a one-line answer a line-break id in ``line_breaks``:
    then the text ends at the first newline, which keeps any text a line-break token carries
    before its newline)."""
    ids = list(gen.token_ids)
    lps = list(gen.logprobs)
    text: str | None = None
    if ids and ids[-1] in line_breaks and ids[-1] not in eos:
        text = first_line(decode(ids))
    if ids and (ids[-1] in eos or text is not None):
        ids.pop()
        lps.pop()
    return Answer(
        text=(decode(ids) if text is None else text).strip(),
        token_ids=tuple(ids),
        logprobs=tuple(lps),
        finish_reason=gen.finish_reason,
    )
