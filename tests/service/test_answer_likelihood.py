"""The attribution's tie-break scorer (``service.learning.answer_likelihood``): the answer's
log-likelihood under each passage, from a real model behind its real tokenizer (a tiny random
Llama with SmolLM2's tokenizer), equal to the model's own log-softmax over the same tokens,
and scored as the service's own work."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from service.backends.base import (
    LogprobBackend,
    ScoreResult,
    SpanRequest,
    in_background,
)
from service.errors import ScoringFailed
from service.learning.answer_likelihood import PROMPT, AnswerLikelihood

QUESTION = "Who wrote the novel?"
PASSAGES = ["The novel was written by Mary Shelley in 1818.", "Mary Shelley lived in London."]
ANSWER = "Mary Shelley"


class Recording:
    """``inner`` with each ``score`` call's requests and whether it ran as background work."""

    def __init__(self, inner: LogprobBackend) -> None:
        self.inner = inner
        self.calls: list[tuple[list[SpanRequest], bool]] = []

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.inner.tokenizer

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.calls.append((list(requests), in_background()))
        return await self.inner.score(requests)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LogprobBackend:
    from service.backends.transformers_backend import TransformersBackend

    return TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")


async def test_the_answer_s_log_likelihood_under_each_passage(
    tiny: LogprobBackend, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    rec = Recording(tiny)
    got = await AnswerLikelihood(rec)(QUESTION, PASSAGES, ANSWER)  # type: ignore[arg-type]
    assert len(got) == 2 and got[0] != got[1]
    ((requests, background),) = rec.calls
    assert background  # callers' forwards go first (service.backends.scheduler)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = tiny.tokenizer
    answer_ids = tok.encode(" " + ANSWER).ids
    for passage, req, value in zip(PASSAGES, requests, got, strict=True):
        head = tok.encode(tok.render_completion(PROMPT.format(passage=passage, question=QUESTION)))
        assert req.token_ids == (*head.ids, *answer_ids)
        assert (req.span_start, req.span_end) == (len(head.ids), len(req.token_ids))
        ids = torch.tensor([req.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        direct = lp[torch.arange(target.shape[0]), target][len(head.ids) - 1 :].sum()
        assert value == pytest.approx(float(direct), abs=1e-3)


async def test_an_empty_answer_is_refused_before_any_call(tiny: LogprobBackend) -> None:
    rec = Recording(tiny)
    with pytest.raises(ScoringFailed, match="no tokens"):
        await AnswerLikelihood(rec)(QUESTION, PASSAGES, "   ")  # type: ignore[arg-type]
    assert rec.calls == []
