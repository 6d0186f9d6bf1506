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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from service.backends.base import LogprobBackend, PromptFailure, SpanRequest, background_work
from service.errors import ReorderError, ScoringFailed
from solver.blind_profile import Attribution, break_tie

log = logging.getLogger(__name__)

PROMPT = "Document: {passage}\nQuestion: {question}\nAnswer:"

Likelihood = Callable[[str, Sequence[str], str], Awaitable[Sequence[float]]]
"""``(question, passages, answer)`` to ``log P(answer | passage, question)`` per passage
(``AnswerLikelihood``; the online sampler and ``profile-generator --no-labels --tie-break``)."""


class AnswerLikelihood:
    """``log P(answer | passage, question)`` for each of several passages, from ``backend``."""

    def __init__(self, backend: LogprobBackend) -> None:
        self.backend = backend

    async def __call__(self, question: str, passages: Sequence[str], answer: str) -> list[float]:
        """One log-likelihood (nats, summed over the answer's tokens) per passage.

        Raises:
            ScoringFailed: the answer has no tokens, or a prompt failed to score.
            LimitExceeded, EngineUnavailable, EngineTimeout: as the backend's ``score``.
        """
        if not answer.strip():
            raise ScoringFailed("the answer has no tokens to score")
        tok = self.backend.tokenizer
        prefixes = [
            tok.render_completion(PROMPT.format(passage=p, question=question)) for p in passages
        ]
        *heads, tail = tok.encode_batch([*prefixes, " " + answer.strip()])
        requests = [
            SpanRequest(
                f"tie-{j}", (*head.ids, *tail.ids), len(head.ids), len(head.ids) + len(tail.ids)
            )
            for j, head in enumerate(heads)
        ]
        with background_work():
            results = await self.backend.score(requests)
        out = []
        for r in results:
            if isinstance(r, PromptFailure):
                raise ScoringFailed(f"a tie-break prompt failed to score: {r.reason}")
            out.append(r.total)
        return out


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
