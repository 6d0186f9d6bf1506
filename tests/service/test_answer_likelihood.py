"""The attribution's tie-break scorer (``service.learning.answer_likelihood``): the answer's
log-likelihood under each passage, from a real model behind its real tokenizer (a tiny random
Llama with SmolLM2's tokenizer), equal to the model's own log-softmax over the same tokens,
and scored as the service's own work."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from service.backends.base import (
    Encoding,
    LogprobBackend,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
    in_background,
)
from service.errors import EngineTimeout, LimitExceeded, ScoringFailed
from service.learning.answer_likelihood import (
    PROMPT,
    AnswerLikelihood,
    TieBreakLimits,
    resolve_tie,
)
from solver.blind_profile import Attribution

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

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.calls.append((list(requests), in_background()))
        return await self.inner.score(requests)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LogprobBackend:
    from service.backends.engines.transformers_backend import TransformersBackend

    return TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")


async def test_the_answer_s_log_likelihood_under_each_passage(
    tiny: LogprobBackend, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    rec = Recording(tiny)
    got = await AnswerLikelihood(rec)(QUESTION, PASSAGES, ANSWER)  # type: ignore[arg-type]
    assert len(got) == 2 and got[0] != got[1]
    ((requests, background),) = rec.calls
    assert background  # callers' forwards go first (service.backends.scheduling.scheduler)
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


# --- bounded as a request is (issue 90 item 7) ---------------------------------------------


class _Engine:
    """A byte-tokenised engine: each answer token -1 nat, one per prompt; records the
    threads that tokenised and the calls it was sent. ``hang``: never answers."""

    def __init__(self, *, hang: bool = False, max_model_len: int = 32768) -> None:
        from service.backends.tokenizers.byte_tokenizer import ByteTokenizer

        self.calls: list[list[SpanRequest]] = []
        self.hang = hang
        self.max_model_len = max_model_len
        self.encoded_on: list[int] = []
        self.cancelled = 0
        engine = self

        class _Tok(ByteTokenizer):
            def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
                engine.encoded_on.append(threading.get_ident())
                return super().encode_batch(texts)

        self.tokenizer = _Tok()

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.calls.append(list(requests))
        try:
            if self.hang:
                await anyio.sleep_forever()
            await anyio.sleep(0.05)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        return [
            SpanLogprobs(r.request_id, tuple(-1.0 for _ in range(r.span_end - r.span_start)))
            for r in requests
        ]


def _limits(**kw: float) -> TieBreakLimits:
    base: dict[str, float] = {"max_passages": 100, "max_prompt_tokens": 262_144, "timeout_s": 5.0}
    base.update(kw)
    return TieBreakLimits(
        max_passages=int(base["max_passages"]),
        max_prompt_tokens=int(base["max_prompt_tokens"]),
        timeout_s=base["timeout_s"],
    )


async def test_a_tie_over_a_request_s_limits_is_not_scored_and_stays_split() -> None:
    """64 tied passages of 8,000 characters were 512k prompt tokens in one call, twice a
    request's cap: now refused before the engine, and the answer's weight stays split."""
    engine = _Engine()
    scorer = AnswerLikelihood(engine, _limits())  # type: ignore[arg-type]
    texts = [f"passage {i} " + "x" * 8000 for i in range(64)]
    with pytest.raises(LimitExceeded) as over:
        await scorer(QUESTION, texts, ANSWER)
    assert over.value.param == "tie_break.prompt_tokens_x_prompts"
    assert over.value.limit == 262_144 and over.value.value > 512_000
    with pytest.raises(LimitExceeded, match=r"tie_break\.passages"):
        await scorer(QUESTION, ["p"] * 101, ANSWER)
    with pytest.raises(LimitExceeded, match=r"tie_break\.prompt_chars"):  # never tokenised
        await AnswerLikelihood(engine, _limits(max_prompt_tokens=1000))(  # type: ignore[arg-type]
            QUESTION, ["y" * 20_000] * 2, ANSWER
        )
    assert engine.calls == []
    found = Attribution(passages=tuple(range(64)), kind="contained", overlap=1.0)
    kept = await resolve_tie(scorer, found, QUESTION, texts, ANSWER, where="test")
    assert kept == found and engine.calls == []


async def test_a_tie_is_tokenised_off_the_event_loop_and_given_up_at_its_deadline() -> None:
    engine = _Engine(hang=True)
    scorer = AnswerLikelihood(engine, _limits(timeout_s=0.3))  # type: ignore[arg-type]
    loop_thread = threading.get_ident()
    t = time.monotonic()
    with anyio.fail_after(10), pytest.raises(EngineTimeout, match=r"0\.3 s"):
        await scorer(QUESTION, PASSAGES, ANSWER)
    assert time.monotonic() - t < 5 and engine.cancelled == 1
    assert engine.encoded_on and loop_thread not in engine.encoded_on


async def test_a_tie_is_scored_only_while_the_engine_is_idle() -> None:
    """vLLM and a remote engine give the service's own work no background priority: the
    tie-break waits for an idle engine and yields the moment a caller's work arrives."""
    engine = _Engine()
    busy = [True]
    scorer = AnswerLikelihood(engine, _limits(), idle=lambda: not busy[0])  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        got: list[list[float]] = []

        async def run() -> None:
            got.append(await scorer(QUESTION, PASSAGES, ANSWER))

        tg.start_soon(run)
        await anyio.sleep(0.3)
        assert engine.calls == []  # a caller's work is on the engine: it waits
        busy[0] = False
    assert len(engine.calls) == 1 and got == [[-float(len(" " + ANSWER))] * 2]
    # A caller arrives while it scores: cancelled, the weight stays split.
    engine.hang = True
    busy[0] = False
    async with anyio.create_task_group() as tg:
        failed: list[Exception] = []

        async def run_again() -> None:
            try:
                await scorer(QUESTION, PASSAGES, ANSWER)
            except ScoringFailed as exc:
                failed.append(exc)

        tg.start_soon(run_again)
        await anyio.sleep(0.3)
        busy[0] = True
    assert failed and "preempted" in str(failed[0]) and engine.cancelled == 1
