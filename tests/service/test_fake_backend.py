"""The fake backend: known truth in, the documented scores and answers out."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import anyio
import pytest

from service.backends.base import (
    Generation,
    GenerationRequest,
    LogprobBackend,
    PromptFailure,
    PromptTokenizer,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.fakes.fake import FakeBackend, FakePrompt, primacy_bias
from service.backends.tokenizers.byte_tokenizer import (
    ASSISTANT_ID,
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    ByteTokenizer,
)
from service.errors import BackendUnavailable
from service.passage import Passage
from service.prompting.prompts import BuiltPrompt, build_generation_prompt, build_prompts

A = "Alpha passage about the Eiffel tower in Paris."
B = "Bravo passage about bread and cheese."
C = "Charlie passage: the moon is made of rock."
TRUTH = {A: 1.0, B: 0.0, C: -0.5}
PASSAGES = [Passage(A, title="Alpha"), Passage(B, title="Bravo"), Passage(C)]
QUERY = "where is it?"  # 12 bytes: 12 query tokens
BIAS = {1: [1.0], 2: [0.75, 0.25], 3: [0.5, 0.3, 0.2]}


def bias_table(n_slots: int) -> Sequence[float]:
    return BIAS[n_slots]


def prompts(backend: FakeBackend, orders: Sequence[Sequence[int]]) -> list[BuiltPrompt]:
    return build_prompts(backend.tokenizer, "qa_default", QUERY, PASSAGES, orders)


def score(backend: FakeBackend, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
    async def run() -> list[ScoreResult]:
        return await backend.score(requests)

    return anyio.run(run)


def totals(results: Sequence[ScoreResult]) -> list[float]:
    out = []
    for result in results:
        assert isinstance(result, SpanLogprobs)
        out.append(result.total)
    return out


# --- ByteTokenizer ---------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_and_special_tokens() -> None:
    tok = ByteTokenizer()
    text = "<|bos|>héllo 日本 🙂<|end|>\n<|unknown|>"
    encoding = tok.encode(text)
    assert tok.decode(encoding.ids) == text
    assert encoding.ids[0] == BOS_ID
    assert END_OF_TURN_ID in encoding.ids
    # "é" is 2 bytes -> 2 tokens, both covering its one character.
    e_at = text.index("é")
    assert [o for o in encoding.offsets if o == (e_at, e_at + 1)] == [(e_at, e_at + 1)] * 2
    assert len(encoding.ids) == len(encoding.offsets)
    assert tok.decode([0xC3]) == "\ufffd"  # a cut character is visible, not an exception
    with pytest.raises(ValueError, match="vocabulary"):
        tok.decode([999])


def test_byte_tokenizer_chat_template() -> None:
    from service.backends.base import ChatMessage

    tok = ByteTokenizer()
    messages = [ChatMessage("system", "S"), ChatMessage("user", "U")]
    assert tok.render_chat(messages, add_generation_prompt=False) == (
        "<|bos|><|system|>\nS<|end|>\n<|user|>\nU<|end|>\n"
    )
    rendered = tok.render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|end|>\n<|assistant|>\n")
    assert tok.encode(rendered).ids[-2:] == (ASSISTANT_ID, ord("\n"))
    assert tok.eos_token_ids == {EOS_ID, END_OF_TURN_ID}
    with pytest.raises(ValueError, match="role"):
        tok.render_chat([ChatMessage("tool", "x")], add_generation_prompt=False)


def test_fake_backend_satisfies_the_ports() -> None:
    backend = FakeBackend(TRUTH)
    assert isinstance(backend, LogprobBackend)
    assert isinstance(backend.tokenizer, PromptTokenizer)
    assert backend.model_id == "fake/known-truth"
    assert FakeBackend(TRUTH, max_model_len=100).max_model_len == 100


# --- the scoring formula, by hand ------------------------------------------------------------


def test_scores_follow_the_documented_formula() -> None:
    backend = FakeBackend(TRUTH, bias=bias_table, query_logprob_per_token=-2.0)
    orders = [[0, 1, 2], [2, 1, 0], [1, 0, 2], [2, 0], [1]]
    built = prompts(backend, orders)
    results = score(backend, [p.span_request(f"r{i}") for i, p in enumerate(built)])
    # c = lam * n - max(0, max u) = -2 * 12 - 1.0 = -25
    expected = [
        -25 + 0.5 * 1.0 + 0.3 * 0.0 + 0.2 * -0.5,  # A B C: -24.6
        -25 + 0.5 * -0.5 + 0.3 * 0.0 + 0.2 * 1.0,  # C B A: -25.05
        -25 + 0.5 * 0.0 + 0.3 * 1.0 + 0.2 * -0.5,  # B A C: -24.8
        -25 + 0.75 * -0.5 + 0.25 * 1.0,  # C A (pruned): -25.125
        -25 + 1.0 * 0.0,  # B alone: -25
    ]
    assert totals(results) == pytest.approx(expected, abs=1e-12)
    for result, prompt, order in zip(results, built, orders, strict=True):
        assert isinstance(result, SpanLogprobs)
        assert result.request_id == f"r{orders.index(order)}"
        assert len(result.logprobs) == len(QUERY)
        assert all(v <= 0 for v in result.logprobs)
        names = [PASSAGES[i].text for i in order]
        assert result.total == pytest.approx(backend.expected_score(names, len(QUERY)))
        assert prompt.totals(result.logprobs)[0] == pytest.approx(result.total)


def test_default_bias_is_linear_primacy_and_sequences_are_normalised() -> None:
    assert primacy_bias(3) == pytest.approx((3 / 6, 2 / 6, 1 / 6))
    assert FakeBackend(TRUTH).bias_for(3) == pytest.approx(primacy_bias(3))
    assert FakeBackend(TRUTH, bias=[2.0, 1.0, 1.0]).bias_for(3) == (0.5, 0.25, 0.25)
    with pytest.raises(ValueError, match="2 weights for 3 slots"):
        FakeBackend(TRUTH, bias=[1.0, 1.0]).bias_for(3)
    with pytest.raises(ValueError, match=">= 0"):
        FakeBackend(TRUTH, bias=[1.0, -1.0, 1.0]).bias_for(3)


def test_position_bias_decides_between_permutations() -> None:
    # With primacy bias the best passage first must beat the best passage last.
    backend = FakeBackend(TRUTH)
    first, last = totals(
        score(backend, [p.span_request("x") for p in prompts(backend, [[0, 1, 2], [1, 2, 0]])])
    )
    assert first > last


def test_no_passage_gives_the_baseline() -> None:
    backend = FakeBackend(TRUTH, query_logprob_per_token=-1.0)
    [prompt] = prompts(backend, [[]])
    assert totals(score(backend, [prompt.span_request("empty")])) == [pytest.approx(-12 - 1.0)]


def test_joint_span_gives_passage_tokens_their_own_logprob() -> None:
    backend = FakeBackend(TRUTH, bias=bias_table, passage_logprob_per_token=-0.25)
    [prompt] = prompts(backend, [[1, 0]])
    request = prompt.span_request("j", joint=True)
    [result] = score(backend, [request])
    assert isinstance(result, SpanLogprobs)
    n_passage = sum(e - s for s, e in prompt.passage_spans)
    n_other = request.span_end - request.span_start - n_passage
    expected_s = -2.0 * n_other - 1.0 + 0.75 * 0.0 + 0.25 * 1.0
    assert result.total == pytest.approx(expected_s - 0.25 * n_passage)
    _, passage_total = prompt.totals(result.logprobs, joint=True)
    assert passage_total == pytest.approx(-0.25 * n_passage)


def test_nested_passage_texts_count_once() -> None:
    short = "Eiffel tower"  # occurs inside A
    backend = FakeBackend({**TRUTH, short: 5.0}, bias=bias_table)
    [prompt] = prompts(backend, [[0, 1]])
    [result] = score(backend, [prompt.span_request("n")])
    assert isinstance(result, SpanLogprobs)
    # max u is now 5: c = -24 - 5; A and B fill the two slots, the nested key is ignored.
    assert result.total == pytest.approx(-29 + 0.75 * 1.0 + 0.25 * 0.0)


# --- noise and determinism -------------------------------------------------------------------


def test_noise_is_deterministic_per_prompt_and_seed() -> None:
    orders = [random.Random(k).sample(range(3), 3) for k in range(30)]
    backend = FakeBackend(TRUTH, noise=0.5, seed=7)
    built = prompts(backend, orders)
    first = totals(score(backend, [p.span_request(f"a{i}") for i, p in enumerate(built)]))
    again = totals(score(backend, [p.span_request(f"b{i}") for i, p in enumerate(built)]))
    fresh = totals(
        score(FakeBackend(TRUTH, noise=0.5, seed=7), [p.span_request("c") for p in built])
    )
    other = totals(
        score(FakeBackend(TRUTH, noise=0.5, seed=8), [p.span_request("d") for p in built])
    )
    assert first == again == fresh
    assert first != other
    # Same order -> same score; the noise is the only difference from the noiseless formula.
    for order, value in zip(orders, first, strict=True):
        assert value == first[orders.index(order)]
    noiseless = FakeBackend(TRUTH, noise=0.0)
    clean = totals(score(noiseless, [p.span_request("e") for p in built]))
    residuals = [v - c + 8 * 0.5 for v, c in zip(first, clean, strict=True)]
    assert all(abs(r) <= 8 * 0.5 for r in residuals)
    assert len(set(residuals)) > 1


def test_large_noise_never_gives_positive_logprobs() -> None:
    backend = FakeBackend(TRUTH, noise=50.0, query_logprob_per_token=0.0)
    built = prompts(backend, [random.Random(k).sample(range(3), 3) for k in range(50)])
    for result in score(backend, [p.span_request("z") for p in built]):
        assert isinstance(result, SpanLogprobs)
        assert all(v <= 0 for v in result.logprobs)


def test_constructor_rejects_impossible_truths() -> None:
    with pytest.raises(ValueError):
        FakeBackend({A: math.nan})
    with pytest.raises(ValueError):
        FakeBackend(TRUTH, query_logprob_per_token=0.5)
    with pytest.raises(ValueError):
        FakeBackend(TRUTH, noise=-1.0)


# --- failures, NaN, limits, counters ---------------------------------------------------------


def test_failures_by_id_and_by_rule_degrade_single_prompts() -> None:
    def a_first(prompt: FakePrompt) -> bool:
        return prompt.passages[:1] == (A,)

    backend = FakeBackend(TRUTH, fail_ids={"r1"}, fail_rule=a_first)
    built = prompts(backend, [[1, 2, 0], [1, 0, 2], [0, 1, 2], [2, 1, 0]])
    results = score(backend, [p.span_request(f"r{i}") for i, p in enumerate(built)])
    kinds = [type(r).__name__ for r in results]
    assert kinds == ["SpanLogprobs", "PromptFailure", "PromptFailure", "SpanLogprobs"]
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    assert backend.stats.failures == 2
    assert backend.stats.prompts_scored == 2
    backend.fail_ids.clear()
    backend.fail_rule = None
    assert all(isinstance(r, SpanLogprobs) for r in score(backend, [built[1].span_request("r1")]))


def test_nan_injection_puts_a_nan_in_the_logprobs() -> None:
    backend = FakeBackend(TRUTH, nan_ids={"bad"}, nan_rule=lambda p: p.passages == (C,))
    built = prompts(backend, [[0, 1], [2]])
    results = score(
        backend,
        [built[0].span_request("bad"), built[0].span_request("good"), built[1].span_request("c")],
    )
    values = [r.logprobs for r in results if isinstance(r, SpanLogprobs)]
    assert [any(math.isnan(v) for v in vs) for vs in values] == [True, False, True]


def test_prompts_over_max_model_len_fail() -> None:
    backend = FakeBackend(TRUTH)
    [prompt] = prompts(backend, [[0, 1, 2]])
    short = FakeBackend(TRUTH, max_model_len=len(prompt.token_ids) - 1)
    [full] = score(short, [SpanRequest("f", prompt.token_ids, *prompt.query_span)])
    assert isinstance(full, PromptFailure)
    assert "max_model_len" in full.reason


def test_foreign_token_ids_fail_and_bad_spans_raise() -> None:
    backend = FakeBackend(TRUTH)
    [failure] = score(backend, [SpanRequest("x", (1, 2, 999, 3), 1, 3)])
    assert isinstance(failure, PromptFailure)
    [cut] = score(backend, [SpanRequest("y", (65, 0xC3, 66), 1, 3)])  # a cut UTF-8 character
    assert isinstance(cut, PromptFailure)
    with pytest.raises(ValueError, match="span"):
        score(backend, [SpanRequest("z", (65, 66, 67), 0, 2)])
    with pytest.raises(ValueError, match="span"):
        score(backend, [SpanRequest("z", (65, 66, 67), 2, 4)])


def test_counters() -> None:
    backend = FakeBackend(TRUTH)
    built = prompts(backend, [[0, 1, 2], [2, 1, 0]])
    requests = [p.span_request(str(i)) for i, p in enumerate(built)]
    score(backend, requests)
    score(backend, requests[:1])
    assert backend.stats.score_calls == 2
    assert backend.stats.prompts_scored == 3
    assert backend.stats.span_tokens == 3 * len(QUERY)
    assert backend.stats.prompt_tokens == sum(len(r.token_ids) for r in [*requests, requests[0]])


# --- delays, hangs, closing ------------------------------------------------------------------


def test_delay_and_hang_are_cancellable() -> None:
    backend = FakeBackend(TRUTH, delay_s=0.05)
    [prompt] = prompts(backend, [[0]])
    started = time.monotonic()
    score(backend, [prompt.span_request("d")])
    assert time.monotonic() - started >= 0.05

    backend.hang = True

    async def hung() -> bool:
        with anyio.move_on_after(0.05) as scope:
            await backend.score([prompt.span_request("h")])
        return scope.cancelled_caught

    assert anyio.run(hung)
    assert backend.stats.score_calls == 1  # the hung call never counted as answered


def test_closed_backend_raises() -> None:
    backend = FakeBackend(TRUTH)
    anyio.run(backend.aclose)
    with pytest.raises(BackendUnavailable):
        score(backend, [])


# --- generation ------------------------------------------------------------------------------


def generate(backend: FakeBackend, requests: Sequence[GenerationRequest]) -> list[Generation]:
    async def run() -> list[Generation]:
        out = []
        for result in await backend.generate(requests):
            assert isinstance(result, Generation)
            out.append(result)
        return out

    return anyio.run(run)


def generation_ids(order: Sequence[int]) -> tuple[int, ...]:
    return build_generation_prompt(ByteTokenizer(), "qa_default", QUERY, PASSAGES, order).token_ids


def test_generation_answers_from_the_most_useful_passage() -> None:
    backend = FakeBackend(TRUTH)
    tok = backend.tokenizer
    [out] = generate(backend, [GenerationRequest("g", generation_ids([2, 1, 0]), 50)])
    assert tok.decode(out.token_ids) == "Alpha passage about<|end|>"
    assert out.finish_reason == "stop"
    assert out.logprobs == pytest.approx([math.log(1 / (1 + math.exp(-1.0)))] * len(out.token_ids))
    assert backend.stats.generated_tokens == len(out.token_ids)


def test_generation_honours_answers_stop_ids_and_max_new_tokens() -> None:
    backend = FakeBackend(TRUTH, answers={B: "bread\nmore"})
    tok = backend.tokenizer
    ids = generation_ids([1, 2])  # B (u=0) beats C (u=-0.5)
    [short, stopped, full] = generate(
        backend,
        [
            GenerationRequest("s", ids, 3),
            GenerationRequest("n", ids, 50, stop_token_ids=frozenset({ord("\n")})),
            GenerationRequest("f", ids, 50),
        ],
    )
    assert (tok.decode(short.token_ids), short.finish_reason) == ("bre", "length")
    assert (tok.decode(stopped.token_ids), stopped.finish_reason) == ("bread\n", "stop")
    assert tok.decode(full.token_ids) == "bread\nmore<|end|>"
    assert full.logprobs[0] == pytest.approx(math.log(0.5))


def test_generation_without_known_passages_and_with_ties() -> None:
    backend = FakeBackend({**TRUTH, "Tie passage one.": 1.0})
    empty_ids = build_generation_prompt(ByteTokenizer(), "qa_default", QUERY, []).token_ids
    tie = [Passage("Tie passage one."), Passage(A)]
    tie_ids = build_generation_prompt(ByteTokenizer(), "qa_default", QUERY, tie).token_ids
    [none, tied] = generate(
        backend, [GenerationRequest("e", empty_ids, 20), GenerationRequest("t", tie_ids, 20)]
    )
    assert backend.tokenizer.decode(none.token_ids) == "unknown<|end|>"
    assert none.logprobs[0] == pytest.approx(math.log(0.5))
    assert backend.tokenizer.decode(tied.token_ids) == "Tie passage one.<|end|>"


def test_generation_failures_and_limits() -> None:
    ids = generation_ids([0])
    backend = FakeBackend(TRUTH, fail_ids={"bad"}, max_model_len=len(ids) + 2)
    results = anyio.run(
        backend.generate, [GenerationRequest("bad", ids, 5), GenerationRequest("ok", ids, 5)]
    )
    assert isinstance(results[0], PromptFailure)
    ok = results[1]
    assert isinstance(ok, Generation)
    assert len(ok.token_ids) == 2  # the context ran out
    assert ok.finish_reason == "length"


def test_generation_scores_its_score_ids_as_score_would() -> None:
    backend = FakeBackend(TRUTH, bias=bias_table, query_logprob_per_token=-2.0)
    ids = generation_ids([2, 1, 0])  # C, B, A: weights 0.5, 0.3, 0.2
    paris = backend.tokenizer.encode("Paris").ids  # 5 bytes, 5 tokens, none in a passage
    [plain, fused] = generate(
        backend, [GenerationRequest("p", ids, 50), GenerationRequest("f", ids, 50, score_ids=paris)]
    )
    # The answer is the plain generation's; the score ids get the scoring formula by hand:
    # c = lam * n - max(0, max u) = -2 * 5 - 1.0 = -11; signal 0.5 * -0.5 + 0.3 * 0 + 0.2 * 1.0
    # = -0.05; spread evenly over the 5 tokens.
    assert (fused.token_ids, fused.logprobs) == (plain.token_ids, plain.logprobs)
    assert plain.score_logprobs is None
    assert fused.score_logprobs == pytest.approx([-11.05 / 5] * 5)
    [span] = score(backend, [SpanRequest("s", ids + paris, len(ids), len(ids) + 5)])
    assert isinstance(span, SpanLogprobs) and fused.score_logprobs == span.logprobs
    # One prefill of prompt + score ids, counted as a scored prompt.
    stats = backend.stats
    assert stats.prompts_scored == 2 and stats.span_tokens == 10  # the fused one and `score`
    assert stats.prompt_tokens == len(ids) + (len(ids) + 5) + (len(ids) + 5)

    # The score ids must fit the context too; when their scoring fails, the request does.
    short = FakeBackend(TRUTH, max_model_len=len(ids) + 3)
    [ok, over] = anyio.run(
        short.generate,
        [GenerationRequest("ok", ids, 2), GenerationRequest("over", ids, 2, score_ids=paris)],
    )
    assert isinstance(ok, Generation) and ok.score_logprobs is None
    assert isinstance(over, PromptFailure) and "max_model_len" in over.reason


def test_scores_are_exactly_the_bilinear_model() -> None:
    # With a known, u is a linear least-squares problem: the fake's scores must give it back
    # exactly (up to the constant the model cannot see), which is what the fit relies on.
    import numpy as np

    texts = [f"Passage number {k} says something {'x' * k}." for k in range(5)]
    utilities = [0.3, -1.2, 2.0, 0.0, 0.7]
    weights = [0.4, 0.25, 0.15, 0.12, 0.08]
    backend = FakeBackend(dict(zip(texts, utilities, strict=True)), bias=weights)
    rng = random.Random(3)
    orders = [rng.sample(range(5), 5) for _ in range(12)]
    built = build_prompts(backend.tokenizer, "qa_plain", QUERY, [Passage(t) for t in texts], orders)
    s = np.array(totals(score(backend, [p.span_request("r") for p in built])))
    design = np.zeros((len(orders), 5))
    for i, order in enumerate(orders):
        for slot, passage in enumerate(order):
            design[i, passage] = weights[slot]
    fitted, *_ = np.linalg.lstsq(design, s, rcond=None)
    truth = np.array(utilities)
    np.testing.assert_allclose(fitted - fitted.mean(), truth - truth.mean(), atol=1e-9)
