"""The scoring model's likelihood of a generator's answer under each passage: the label-free
attribution's tie-break (``solver.blind_profile.break_tie``).

When several shown passages hold an answer equally, the answer's weight used to be split
among them. Under ``log P(answer | passage, question)`` from the service's own scoring model
the likeliest one is a gold passage more often than the split's share: +0.30 [+0.18, +0.43]
on SmolLM2's answers, +0.10 [+0.01, +0.18] on Gemma-3-270m's, scored by SmolLM2
(``eval/attribution_tiebreak.py``, which measures through this module). One prompt per tied
passage, ``Document: <passage>\\nQuestion: <question>\\nAnswer:`` as a plain completion (the
model's BOS, if any, first), then the answer; scored as the service's own work
(``background_work``), so callers' forwards go first.

Bounded as a request is (issue 90: one prompt per tied passage and nothing else measured 512k
prompt tokens, twice a request's cap, and blocked the event loop 0.77 s while tokenising):

- the same limits as a request (``TieBreakLimits``): the passages (``max_passages``), each
  prompt's tokens (the model's context) and the prompts' tokens together
  (``max_prompt_tokens_x_prompts``), checked by characters before tokenising and by tokens
  after; over one, the tie is not broken (``LimitExceeded``: ``resolve_tie`` keeps the weight
  split);
- tokenised in a worker thread, never on the event loop;
- a deadline (``timeout_s``) over the wait for the engine and the scoring;
- only while the engine is idle (``idle``): it waits for an idle engine and is cancelled the
  moment a caller's work arrives. Background priority alone is not enough: only the
  transformers and paced backends' scheduler serves ``background_work`` after callers; vLLM
  and a remote engine take it as a caller's call, and a caller arriving meanwhile would wait
  behind it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from service.backends.base import (
    Encoding,
    LogprobBackend,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    background_work,
)
from service.config.settings import Settings
from service.errors import EngineTimeout, LimitExceeded, ReorderError, ScoringFailed
from service.prompting.prompts import MAX_CHARS_PER_TOKEN
from solver.blind_profile import Attribution, break_tie

log = logging.getLogger(__name__)

PROMPT = "Document: {passage}\nQuestion: {question}\nAnswer:"

Likelihood = Callable[[str, Sequence[str], str], Awaitable[Sequence[float]]]
"""``(question, passages, answer)`` to ``log P(answer | passage, question)`` per passage
(``AnswerLikelihood``; the online sampler and ``profile-generator --no-labels --tie-break``)."""


_IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class TieBreakLimits:
    """A tie-break's bounds: a request's limits, and how long it may take (module
    docstring)."""

    max_passages: int
    """Tied passages scored at most (``max_passages``)."""
    max_prompt_tokens: int
    """Tokens of all its prompts together (``max_prompt_tokens_x_prompts``)."""
    timeout_s: float
    """Seconds for the whole tie-break, its wait for an idle engine included."""

    @classmethod
    def from_settings(cls, settings: Settings) -> TieBreakLimits:
        """A request's limits, and its deadline (``request_timeout_s``)."""
        return cls(
            max_passages=settings.max_passages,
            max_prompt_tokens=settings.max_prompt_tokens_x_prompts,
            timeout_s=settings.request_timeout_s,
        )


class AnswerLikelihood:
    """``log P(answer | passage, question)`` for each of several passages, from ``backend``."""

    def __init__(
        self,
        backend: LogprobBackend,
        limits: TieBreakLimits | None = None,
        *,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """Args:
        backend: the scoring model.
        limits: the request limits and deadline it is held to; ``None``: the defaults of
            ``Settings`` (the offline commands, which share no engine).
        idle: whether no caller's work is on the engine now; ``None``: always (an engine of
            its own). Scoring waits for it and is cancelled when it turns false.
        """
        self.backend = backend
        self.limits = limits if limits is not None else TieBreakLimits.from_settings(Settings())
        self.idle = idle

    async def __call__(self, question: str, passages: Sequence[str], answer: str) -> list[float]:
        """One log-likelihood (nats, summed over the answer's tokens) per passage.

        Raises:
            ScoringFailed: the answer has no tokens, a prompt failed to score, or a caller's
                work arrived on the engine first (preempted).
            LimitExceeded: over a request's limits (``TieBreakLimits``), found before the
                engine is called.
            EngineTimeout: ``limits.timeout_s`` passed.
            EngineUnavailable: as the backend's ``score``.
        """
        if not answer.strip():
            raise ScoringFailed("the answer has no tokens to score")
        limits = self.limits
        if len(passages) > limits.max_passages:
            raise LimitExceeded(
                "tie_break.passages", limits.max_passages, len(passages), what="tied passages"
            )
        tok = self.backend.tokenizer
        prefixes = [
            tok.render_completion(PROMPT.format(passage=p, question=question)) for p in passages
        ]
        tail_text = " " + answer.strip()
        # By characters first: a prompt of more than max x 32 characters certainly has more
        # than max tokens, so a tie that can never fit is not tokenised at all.
        chars = sum(len(p) for p in prefixes) + len(prefixes) * len(tail_text)
        if chars > limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            raise LimitExceeded(
                "tie_break.prompt_chars",
                limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN,
                chars,
                what=f"{len(prefixes)} tie-break prompts",
            )
        try:
            with anyio.fail_after(limits.timeout_s):
                return await self._scored(tok.encode_batch, prefixes, tail_text)
        except TimeoutError:
            raise EngineTimeout(
                f"the tie-break did not finish within {limits.timeout_s:g} s"
            ) from None

    async def _scored(
        self,
        encode: Callable[[Sequence[str]], list[Encoding]],
        prefixes: Sequence[str],
        tail_text: str,
    ) -> list[float]:
        limits = self.limits
        # Off the event loop: a tie's prompts are tokenised as long as a request's are.
        *heads, tail = await anyio.to_thread.run_sync(lambda: encode([*prefixes, tail_text]))
        requests = [
            SpanRequest(
                f"tie-{j}", (*head.ids, *tail.ids), len(head.ids), len(head.ids) + len(tail.ids)
            )
            for j, head in enumerate(heads)
        ]
        longest = max(len(r.token_ids) for r in requests)
        if longest > self.backend.max_model_len:
            raise LimitExceeded(
                "tie_break.prompt_tokens",
                self.backend.max_model_len,
                longest,
                what="a tie-break prompt over the model's context",
            )
        total = sum(len(r.token_ids) for r in requests)
        if total > limits.max_prompt_tokens:
            raise LimitExceeded(
                "tie_break.prompt_tokens_x_prompts",
                limits.max_prompt_tokens,
                total,
                what=f"{len(requests)} tie-break prompts",
            )
        results = await self._when_idle(requests)
        out = []
        for r in results:
            if isinstance(r, PromptFailure):
                raise ScoringFailed(f"a tie-break prompt failed to score: {r.reason}")
            out.append(r.total)
        return out

    async def _when_idle(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Score ``requests`` once the engine is idle, as background work, cancelled the
        moment a caller's work arrives (``ScoringFailed``: preempted)."""
        idle = self.idle
        if idle is None:
            with background_work():
                return await self.backend.score(requests)
        while not idle():
            await anyio.sleep(_IDLE_POLL_S)
        results: list[list[ScoreResult]] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while idle():
                    await anyio.sleep(_IDLE_POLL_S)
                tg.cancel_scope.cancel()

            async def work() -> None:
                with background_work():
                    results.append(await self.backend.score(requests))
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(work)
        if not results:
            raise ScoringFailed("preempted: a caller's work arrived on the engine first")
        return results[0]


async def resolve_tie(
    likelihood: Likelihood | None,
    found: Attribution,
    question: str,
    texts: Sequence[str],
    answer: str,
    *,
    where: str,
) -> Attribution:
    """``found`` with its tie broken by ``likelihood`` (``solver.blind_profile.break_tie``;
    ``texts[i]`` is passage ``i`` of ``found.passages``); as it is when no passages tie, there
    is no scorer, or the scorer fails (logged with ``where``). A broken tie has ``tied > 0``."""
    if len(found.passages) < 2 or likelihood is None:
        return found
    try:
        shown = [texts[i] for i in found.passages]
        return break_tie(found, await likelihood(question, shown, answer))
    except (ReorderError, ValueError) as exc:
        log.warning("%s: the answer's tie kept split: %s", where, exc)
        return found
