"""Transformers backend: batched span log-probs equal a brute-force forward; greedy decoding.

The reference is deliberately naive: one sequence, no padding, no ``logits_to_keep``, the full
log-softmax over every position. Everything the backend does to be fast (sorting, padding,
batching under a budget, running the LM head on scored rows only) must not move a number by
more than 1e-4 nats.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from service.backends.base import (
    ChatMessage,
    Generation,
    GenerationRequest,
    LogprobBackend,
    PromptFailure,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.engines.transformers_backend import (
    TransformersBackend,
    default_batch_token_budget,
    token_logprobs,
)
from service.backends.scheduling.batching import HeadMode, plan_batches, plan_generation_batches
from service.backends.scheduling.scheduler import ForwardStats
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.config.settings import EMBEDDED_MODEL, Settings
from service.errors import BackendUnavailable, InvalidRequest, LimitExceeded
from tests.support.models import build_tiny_gemma3, cache_dir_for_tests
from tests.support.prompt_contract import Limits, check_contract

TOL = 1e-4
T = TypeVar("T")


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


def load_reference(folder: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train(False)
    return model


def brute_force(model: PreTrainedModel, req: SpanRequest) -> list[float]:
    """log P(token t | tokens < t) for t in the span, from one unbatched full forward."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([req.token_ids])).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
    return [float(logp[t - 1, req.token_ids[t]]) for t in range(req.span_start, req.span_end)]


def manual_greedy(
    model: PreTrainedModel, prompt: Sequence[int], steps: int
) -> list[tuple[int, float]]:
    """Argmax decoding that recomputes the whole sequence every step (no KV cache)."""
    ids = list(prompt)
    out: list[tuple[int, float]] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            logp = torch.log_softmax(logits.double(), dim=-1)
            token = int(torch.argmax(logits))
            out.append((token, float(logp[token])))
            ids.append(token)
    return out


def chat_ids(backend: TransformersBackend, question: str, answer: str = "") -> tuple[int, ...]:
    tok = backend.tokenizer
    text = tok.render_chat(
        [ChatMessage("system", "Answer from the passages."), ChatMessage("user", question)],
        add_generation_prompt=True,
    )
    return tok.encode(text + answer).ids


def mixed_requests(backend: TransformersBackend) -> list[SpanRequest]:
    """Prompts of clearly different lengths, spans at the start, middle and end."""
    passages = " ".join(f"Passage {i}: the river number {i} flows north." for i in range(12))
    long_ids = chat_ids(backend, passages + " Which river flows north?", "River 3.")
    mid_ids = chat_ids(backend, "Where is Paris? " * 6, "In France, on the Seine.")
    short_ids = chat_ids(backend, "Hi", "Hello!")
    tiny_ids = short_ids[:9]
    return [
        SpanRequest("long-tail", long_ids, len(long_ids) - 6, len(long_ids)),
        SpanRequest("mid-middle", mid_ids, 10, len(mid_ids) - 5),
        SpanRequest("short-all", short_ids, 1, len(short_ids)),
        SpanRequest("tiny-one", tiny_ids, 4, 5),
        SpanRequest("long-head", long_ids, 1, 30),
    ]


def assert_close_to_reference(
    results: Sequence[object], requests: Sequence[SpanRequest], reference: PreTrainedModel
) -> float:
    worst = 0.0
    for result, req in zip(results, requests, strict=True):
        assert isinstance(result, SpanLogprobs), result
        assert result.request_id == req.request_id
        expected = brute_force(reference, req)
        assert len(result.logprobs) == len(expected) == req.span_end - req.span_start
        assert all(v <= 0.0 for v in result.logprobs)
        worst = max(worst, *(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)))
    assert worst <= TOL, worst
    return worst


# --- tiny model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> PreTrainedModel:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), smollm2_dir)


def test_satisfies_protocol_and_reports_model(tiny_backend: TransformersBackend) -> None:
    assert isinstance(tiny_backend, LogprobBackend)
    assert tiny_backend.model_id == "tiny"
    assert tiny_backend.max_model_len == 4096
    assert tiny_backend.device == "cpu"
    # transformers >= 5.2x selects exactly the scored rows (2-D boolean logits_to_keep); older
    # versions (the vLLM virtualenv's) keep the union of scored positions. Never all rows.
    assert tiny_backend.head_mode in ("mask", "positions")


@pytest.mark.parametrize("head_mode", ["mask", "positions", "full"])
def test_batched_span_logprobs_match_brute_force(
    tiny_model_dir: Path, tiny_reference: PreTrainedModel, head_mode: HeadMode
) -> None:
    try:
        backend = TransformersBackend.load(tiny_model_dir, device="cpu", head_mode=head_mode)
    except ValueError as exc:
        pytest.skip(f"this transformers version: {exc}")
    requests = mixed_requests(backend)
    lengths = sorted({len(r.token_ids) for r in requests})
    assert len(lengths) >= 4 and lengths[-1] > 2 * lengths[1]
    # One forward batch: the comparison covers padding, not just separate forwards.
    assert len(plan_batches(requests, token_budget=16384, row_budget=10**6, head_mode="mask")) == 1
    results = run(lambda: backend.score(requests))
    assert_close_to_reference(results, requests, tiny_reference)


def test_small_token_budget_splits_batches_with_same_numbers(
    tiny_model_dir: Path, tiny_backend: TransformersBackend, tiny_reference: PreTrainedModel
) -> None:
    requests = mixed_requests(tiny_backend)
    budget = max(len(r.token_ids) for r in requests)  # room for one long prompt at a time
    assert len(plan_batches(requests, token_budget=budget, row_budget=10**6)) >= 3
    small = tiny_backend.with_batch_token_budget(budget)
    assert small.batch_token_budget == budget != tiny_backend.batch_token_budget
    split = run(lambda: small.score(requests))
    together = run(lambda: tiny_backend.score(requests))
    assert_close_to_reference(split, requests, tiny_reference)
    for a, b in zip(split, together, strict=True):
        assert isinstance(a, SpanLogprobs) and isinstance(b, SpanLogprobs)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5


def test_the_batch_budget_defaults_by_device_and_settings_override_it(
    tiny_model_dir: Path,
) -> None:
    # Measured (results/bench/batch_budget.json): on a CPU a 4096-token batch scores faster
    # than a 16384 one; a GPU keeps the large batches.
    assert default_batch_token_budget(torch.device("cpu")) == 4096
    assert default_batch_token_budget(torch.device("cuda")) == 16384
    assert TransformersBackend.load(tiny_model_dir, device="cpu").batch_token_budget == 4096
    explicit = TransformersBackend.load(tiny_model_dir, device="cpu", batch_token_budget=8192)
    assert explicit.batch_token_budget == 8192


def test_results_keep_request_order_and_duplicates(tiny_backend: TransformersBackend) -> None:
    requests = mixed_requests(tiny_backend)
    doubled = [*requests, *reversed(requests)]
    results = run(lambda: tiny_backend.score(doubled))
    assert [r.request_id for r in results] == [r.request_id for r in doubled]
    for first, second in zip(
        results[: len(requests)], reversed(results[len(requests) :]), strict=True
    ):
        assert isinstance(first, SpanLogprobs) and isinstance(second, SpanLogprobs)
        assert first.logprobs == pytest.approx(second.logprobs, abs=1e-5)


def test_concurrent_calls_share_forwards_with_the_numbers_of_each_alone(
    tiny_backend: TransformersBackend,
) -> None:
    requests = mixed_requests(tiny_backend)
    callers = [[replace(r, request_id=f"{k}-{r.request_id}") for r in requests] for k in range(3)]
    alone = [run(lambda reqs=reqs: tiny_backend.score(reqs)) for reqs in callers]
    stats: list[ForwardStats] = []
    tiny_backend.scheduler.add_observer(stats.append)
    outputs: dict[int, list[object]] = {}

    async def together() -> None:
        async def one(k: int) -> None:
            outputs[k] = list(await tiny_backend.score(callers[k]))

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(one, k)

    run(together)
    # The three calls' prompts were packed together: forwards carry rows of several calls.
    assert max(s.callers for s in stats) == 3
    assert len(stats) < 3 * len(plan_batches(requests, token_budget=4096, row_budget=10**6))
    for k in range(3):
        for got, want in zip(outputs[k], alone[k], strict=True):
            assert isinstance(got, SpanLogprobs) and isinstance(want, SpanLogprobs)
            assert got.request_id == want.request_id
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_a_cancelled_call_leaves_no_work_behind(tiny_backend: TransformersBackend) -> None:
    requests = mixed_requests(tiny_backend)
    many = [replace(r, request_id=f"{i}") for i in range(8) for r in requests]

    async def cancelled() -> int:
        with anyio.move_on_after(0.01):
            await tiny_backend.score(many)
        return tiny_backend.scheduler.queue_depth

    assert run(cancelled) == 0
    results = run(lambda: tiny_backend.score(requests))
    assert [r.request_id for r in results] == [r.request_id for r in requests]


def test_greedy_generation_matches_manual_argmax_loop(
    tiny_backend: TransformersBackend, tiny_reference: PreTrainedModel
) -> None:
    prompt = chat_ids(tiny_backend, "Name a river.")
    steps = 12
    manual = manual_greedy(tiny_reference, prompt, steps)
    eos = tiny_backend.tokenizer.eos_token_ids
    # A random model might emit eos early; the manual loop must then be cut the same way.
    cut = next((k + 1 for k, (tok, _) in enumerate(manual) if tok in eos), steps)
    [gen] = run(lambda: tiny_backend.generate([GenerationRequest("g", prompt, steps)]))
    assert isinstance(gen, Generation)
    assert list(gen.token_ids) == [tok for tok, _ in manual[:cut]]
    assert gen.logprobs == pytest.approx([lp for _, lp in manual[:cut]], abs=TOL)
    assert gen.finish_reason == ("stop" if cut < steps else "length")

    # A request's own stop id ends generation after that token, which is kept.
    stop_at = manual[2][0]
    first_hit = next(k for k, (tok, _) in enumerate(manual) if tok == stop_at)
    [stopped] = run(
        lambda: tiny_backend.generate(
            [GenerationRequest("s", prompt, steps, stop_token_ids=frozenset({stop_at}))]
        )
    )
    assert isinstance(stopped, Generation)
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == [tok for tok, _ in manual[: first_hit + 1]]


def test_batched_generation_matches_each_prompt_alone(
    tiny_backend: TransformersBackend, tiny_reference: PreTrainedModel
) -> None:
    # Prompts of different lengths (left padding differs per row) and different budgets
    # (rows finish at different steps) decode in one lockstep batch; each row must equal the
    # no-cache argmax loop on that prompt alone.
    questions = ["Name a river.", "Which is the longest river in the whole of Europe?", "Hi"]
    prompts = [chat_ids(tiny_backend, q) for q in questions]
    budgets = [12, 5, 9]
    eos = tiny_backend.tokenizer.eos_token_ids
    requests = [
        GenerationRequest(f"g{k}", p, n)
        for k, (p, n) in enumerate(zip(prompts, budgets, strict=True))
    ]
    assert len({len(p) for p in prompts}) == 3
    assert (
        len(
            plan_generation_batches(
                [(len(p), n) for p, n in zip(prompts, budgets, strict=True)], token_budget=16384
            )
        )
        == 1
    )
    got = run(lambda: tiny_backend.generate(requests))
    for gen, prompt, steps, req in zip(got, prompts, budgets, requests, strict=True):
        manual = manual_greedy(tiny_reference, prompt, steps)
        cut = next((k + 1 for k, (tok, _) in enumerate(manual) if tok in eos), steps)
        assert isinstance(gen, Generation)
        assert gen.request_id == req.request_id
        assert list(gen.token_ids) == [tok for tok, _ in manual[:cut]]
        assert gen.logprobs == pytest.approx([lp for _, lp in manual[:cut]], abs=TOL)
        assert gen.finish_reason == ("stop" if cut < steps else "length")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_finished_rows_leave_the_lockstep_batch(
    arch: str, tiny_model_dir: Path, tiny_gemma3_dir: Path
) -> None:
    # Budgets 9, 2 and 5 in one batch: each decode forward carries only the rows still
    # running (their KV cache cut to them: on Gemma-3, sliding and full layers both), and
    # every row still decodes as the no-cache loop on its prompt alone.
    folder = tiny_model_dir if arch == "llama" else tiny_gemma3_dir
    model = load_reference(folder)
    tokenizer = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    backend = TransformersBackend(
        model, tokenizer, model_id="tiny", max_model_len=4096, batch_token_budget=16384
    )
    reference = load_reference(folder)
    questions = ["Which is the longest river in the whole of Europe?", "Hi", "Name a river."]
    prompts = [chat_ids(backend, q) for q in questions]
    budgets = [9, 2, 5]
    # No eos: the budgets alone decide when each row finishes.
    eos = tokenizer.eos_token_ids
    assert all(tok not in eos for p in prompts for tok, _ in manual_greedy(reference, p, 9))
    requests = [
        GenerationRequest(f"g{k}", p, n)
        for k, (p, n) in enumerate(zip(prompts, budgets, strict=True))
    ]
    rows: list[int] = []

    def record(_module: torch.nn.Module, _args: object, kwargs: dict[str, torch.Tensor]) -> None:
        rows.append(int(kwargs["input_ids"].shape[0]))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = run(lambda: backend.generate(requests))
        pruned_rows = list(rows)
        rows.clear()
        backend.prune_finished = False
        unpruned = run(lambda: backend.generate(requests))
    finally:
        hook.remove()
    # The prefill, then 8 decode steps: 3 rows until the 2-token row is done, 2 until the
    # 5-token one is, then the last alone. Unpruned, all 3 rows run every step.
    assert pruned_rows == [3, 3, 2, 2, 2, 1, 1, 1, 1]
    assert rows == [3] * 9
    for gen, other, prompt, steps in zip(got, unpruned, prompts, budgets, strict=True):
        manual = manual_greedy(reference, prompt, steps)
        assert isinstance(gen, Generation) and isinstance(other, Generation)
        assert gen.finish_reason == other.finish_reason == "length"
        assert list(gen.token_ids) == list(other.token_ids) == [tok for tok, _ in manual]
        assert gen.logprobs == pytest.approx([lp for _, lp in manual], abs=TOL)


@pytest.mark.parametrize(
    ("arch", "head_mode"),
    # auto is the best mode this transformers supports (mask on recent ones, positions before).
    [("llama", "auto"), ("llama", "positions"), ("llama", "full"), ("gemma3", "auto")],
)
def test_generation_with_score_ids_equals_generate_and_score(
    arch: str, head_mode: HeadMode, tiny_model_dir: Path, tiny_gemma3_dir: Path
) -> None:
    # One prefill serves the answer and the score ids: it must give the tokens of a plain
    # generation and the log-probs `score` gives the same ids after the same prompt. Prompts
    # of different lengths (left padding differs per row) and score ids of different lengths
    # (right padding in the scoring forward, rows without any or with one beside them) in one
    # batch; on Gemma-3 the prompts overflow the sliding window, so the copied cache holds
    # both kinds of layers. Every head mode selects the scoring forward's rows its own way.
    folder = tiny_model_dir if arch == "llama" else tiny_gemma3_dir
    backend = TransformersBackend.load(folder, device="cpu", head_mode=head_mode)
    reference = load_reference(folder)
    questions = [
        "Name a river.",
        "Which is the longest river in the whole of Europe?",
        "Hi",
        "Where is the Eiffel tower?",
    ]
    prompts = [chat_ids(backend, q) for q in questions]
    tok = backend.tokenizer
    score_ids = [tok.encode(a).ids for a in ("The Danube, in Europe.", "Volga", "", "Paris")]
    assert len({len(p) for p in prompts}) == 4 and len({len(s) for s in score_ids}) == 4
    assert min(len(s) for s in score_ids) == 0 and 1 in {len(s) for s in score_ids}
    if arch == "gemma3":
        window = reference.config.sliding_window
        assert min(len(p) for p in prompts) > window
    budgets = [12, 5, 9, 7]
    fused = [
        GenerationRequest(f"f{k}", p, n, score_ids=s)
        for k, (p, n, s) in enumerate(zip(prompts, budgets, score_ids, strict=True))
    ]
    shapes = [(len(p), n) for p, n in zip(prompts, budgets, strict=True)]
    scored = [len(s) for s in score_ids]
    assert len(plan_generation_batches(shapes, token_budget=4096, scored=scored)) == 1

    got = run(lambda: backend.generate(fused))
    plain = run(lambda: backend.generate([replace(r, score_ids=()) for r in fused]))
    spans = [
        SpanRequest(f"s{k}", p + s, len(p), len(p) + len(s))
        for k, (p, s) in enumerate(zip(prompts, score_ids, strict=True))
        if s
    ]
    scores = iter(run(lambda: backend.score(spans)))
    for gen, alone, req in zip(got, plain, fused, strict=True):
        assert isinstance(gen, Generation) and isinstance(alone, Generation), (gen, alone)
        assert gen.request_id == req.request_id
        assert gen.token_ids == alone.token_ids and gen.finish_reason == alone.finish_reason
        assert gen.logprobs == pytest.approx(alone.logprobs, abs=TOL)
        if not req.score_ids:
            assert gen.score_logprobs is None
            continue
        span = next(scores)
        assert isinstance(span, SpanLogprobs) and gen.score_logprobs is not None
        assert len(gen.score_logprobs) == len(req.score_ids)
        assert gen.score_logprobs == pytest.approx(span.logprobs, abs=TOL)
        # ... and the naive reference, so that both paths are right, not merely alike.
        n = len(req.token_ids)
        whole = SpanRequest("r", req.token_ids + req.score_ids, n, n + len(req.score_ids))
        assert gen.score_logprobs == pytest.approx(brute_force(reference, whole), abs=TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_kv_cache_goes_by_the_name_the_installed_transformers_uses(
    arch: str, tiny_model_dir: Path, tiny_gemma3_dir: Path
) -> None:
    # transformers 5.2x renamed ``past_key_values`` to ``cache`` (argument and output field)
    # and drops the old name in 5.40, which ``transformers<6`` admits: a backend still using
    # it warns today and would decode without its cache then. Decoding and the fused scoring
    # (both pass a cache) must not touch a deprecated name.
    folder = tiny_model_dir if arch == "llama" else tiny_gemma3_dir
    backend = TransformersBackend.load(folder, device="cpu")
    prompt = chat_ids(backend, "Name a river.")
    req = GenerationRequest(
        "g", prompt, 4, score_ids=tuple(backend.tokenizer.encode("The Volga").ids)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        (gen,) = run(lambda: backend.generate([req]))
    assert isinstance(gen, Generation) and len(gen.token_ids) >= 1, gen
    assert gen.score_logprobs is not None and len(gen.score_logprobs) == len(req.score_ids)


def test_a_failed_or_nonfinite_scoring_fails_its_request_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TransformersBackend.load(tiny_model_dir, device="cpu")
    prompt = chat_ids(backend, "Name a river.")
    answer = backend.tokenizer.encode("The Danube.").ids
    requests = [
        GenerationRequest(rid, prompt, 4, score_ids=answer) for rid in ("ok", "nan", "boom")
    ]
    requests.append(GenerationRequest("plain", prompt, 4))
    original = TransformersBackend._score_after_prefill

    def flaky(
        self: TransformersBackend,
        model: PreTrainedModel,
        batch: list[GenerationRequest],
        last_logits: torch.Tensor,
        *rest: object,
    ) -> list[tuple[float, ...] | PromptFailure | None]:
        ids = [r.request_id for r in batch]
        if "boom" in ids:
            raise RuntimeError("simulated out of memory")
        if "nan" in ids:
            last_logits = last_logits.clone()
            last_logits[ids.index("nan")] = math.nan
        return original(self, model, batch, last_logits, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(TransformersBackend, "_score_after_prefill", flaky)
    by_id = {r.request_id: r for r in run(lambda: backend.generate(requests))}
    assert isinstance(by_id["boom"], PromptFailure) and "RuntimeError" in by_id["boom"].reason
    assert isinstance(by_id["nan"], PromptFailure)
    assert by_id["nan"].reason == "score_ids: non-finite log-prob"
    # The batch was retried one by one: the others are still served, with their scores.
    ok, plain = by_id["ok"], by_id["plain"]
    assert isinstance(ok, Generation) and isinstance(plain, Generation)
    assert ok.token_ids == plain.token_ids
    assert ok.score_logprobs is not None and len(ok.score_logprobs) == len(answer)
    assert plain.score_logprobs is None


def test_generation_batches_count_score_ids() -> None:
    # (prompt tokens, tokens to generate) and score ids; cost of a batch = size x (longest
    # prompt + most score ids + most steps).
    shapes = [(10, 4), (30, 2), (20, 8), (5, 1)]
    # Without score ids: 2 x (30 + 8) = 76 <= 80, then 2 x (10 + 4) = 28.
    assert plan_generation_batches(shapes, token_budget=80) == [[1, 2], [0, 3]]
    # Five score ids on the 20-token prompt: 2 x (30 + 5 + 8) = 86 > 80 splits the first pair;
    # then 2 x (20 + 5 + 8) = 66 fits, 3 x (20 + 5 + 8) = 99 does not.
    scored = [0, 0, 5, 0]
    assert plan_generation_batches(shapes, token_budget=80, scored=scored) == [[1], [2, 0], [3]]
    with pytest.raises(ValueError, match="3 score counts for 4 requests"):
        plan_generation_batches(shapes, token_budget=80, scored=[1, 2, 3])


def test_prompt_plus_score_ids_must_fit_the_context(tiny_model_dir: Path) -> None:
    short = TransformersBackend.load(tiny_model_dir, device="cpu", max_model_len=16)
    prompt = tuple(range(100, 112))  # 12 tokens: room for 4 more
    [fits] = run(lambda: short.generate([GenerationRequest("x", prompt, 2, score_ids=(5,) * 4)]))
    assert isinstance(fits, Generation) and fits.score_logprobs is not None
    with pytest.raises(LimitExceeded) as info:
        run(lambda: short.generate([GenerationRequest("x", prompt, 2, score_ids=(5,) * 5)]))
    assert (info.value.param, info.value.limit, info.value.value) == ("score_ids", 4, 5)
    assert "after a 12-token prompt, 16 tokens at most" in info.value.message
    with pytest.raises(InvalidRequest, match="score ids must be in") as bad:
        run(lambda: short.generate([GenerationRequest("x", prompt, 2, score_ids=(10**7,))]))
    assert bad.value.param == "score_ids"


def test_generation_batches_respect_the_token_budget() -> None:
    # (prompt tokens, tokens to generate); cost of a batch = size x (longest + most steps).
    shapes = [(10, 4), (30, 2), (20, 8), (5, 1)]
    batches = plan_generation_batches(shapes, token_budget=80)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    assert batches[0][0] == 1  # longest prompt first
    for b in batches:
        cost = len(b) * (max(shapes[i][0] for i in b) + max(shapes[i][1] for i in b))
        assert len(b) == 1 or cost <= 80
    assert batches == [[1, 2], [0, 3]]  # 2 x (30 + 8) = 76; then 2 x (10 + 4) = 28
    assert plan_generation_batches([(100, 10)], token_budget=8) == [[0]]


def test_generation_stops_at_context_end(tiny_model_dir: Path) -> None:
    backend = TransformersBackend.load(tiny_model_dir, device="cpu", max_model_len=32)
    prompt = chat_ids(backend, "Name a river.")
    room = 32 - len(prompt)
    assert 0 < room < 40
    [gen] = run(lambda: backend.generate([GenerationRequest("g", prompt, 40)]))
    assert isinstance(gen, Generation)
    assert len(gen.token_ids) <= room
    if gen.finish_reason == "length":
        assert len(gen.token_ids) == room


@pytest.mark.parametrize(
    ("span", "message"),
    [
        ((0, 3), "1 <= span_start"),  # the first token has no context, hence no log-prob
        ((2, 2), "span_start < span_end"),
        ((3, 2), "span_start < span_end"),
        ((1, 999), "span_end <= "),
        ((-1, 3), "1 <= span_start"),
    ],
)
def test_bad_span_is_rejected_before_any_forward(
    tiny_backend: TransformersBackend, span: tuple[int, int], message: str
) -> None:
    ids = chat_ids(tiny_backend, "Hi")
    good = SpanRequest("good", ids, 1, len(ids))
    bad = SpanRequest("bad", ids, *span)
    with pytest.raises(InvalidRequest, match="request 'bad'") as info:
        run(lambda: tiny_backend.score([good, bad]))
    assert message in info.value.message
    assert info.value.param == "span_start"


def test_bad_token_ids_and_lengths_are_rejected(
    tiny_model_dir: Path, tiny_backend: TransformersBackend
) -> None:
    ids = chat_ids(tiny_backend, "Hi")
    with pytest.raises(InvalidRequest, match="token ids must be in"):
        run(lambda: tiny_backend.score([SpanRequest("x", (*ids[:2], 10**7), 1, 3)]))
    # Tokens after the span's end are not forwarded (they cannot change its log-probs), so
    # they are not checked either: the same in every backend.
    [after] = run(lambda: tiny_backend.score([SpanRequest("x", (*ids, 10**7), 1, 3)]))
    assert isinstance(after, SpanLogprobs)
    with pytest.raises(InvalidRequest, match="token ids must be in"):
        run(lambda: tiny_backend.score([SpanRequest("x", (-1, *ids), 1, 3)]))
    with pytest.raises(InvalidRequest, match="empty prompt"):
        run(lambda: tiny_backend.generate([GenerationRequest("x", (), 3)]))
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        run(lambda: tiny_backend.generate([GenerationRequest("x", ids, 0)]))
    short = TransformersBackend.load(tiny_model_dir, device="cpu", max_model_len=16)
    long_ids = tuple(range(100, 117))  # 17 tokens
    with pytest.raises(LimitExceeded) as info:
        run(lambda: short.score([SpanRequest("x", long_ids, 1, 17)]))
    assert (info.value.param, info.value.limit, info.value.value) == ("token_ids", 16, 17)
    with pytest.raises(LimitExceeded):
        run(lambda: short.generate([GenerationRequest("x", long_ids[:16], 4)]))


def test_failed_forward_and_nonfinite_rows_become_prompt_failures(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TransformersBackend.load(tiny_model_dir, device="cpu")
    requests = mixed_requests(backend)
    original = TransformersBackend._forward_span_logprobs

    def flaky(
        self: TransformersBackend, model: PreTrainedModel, batch: list[SpanRequest]
    ) -> list[float]:
        ids = {r.request_id for r in batch}
        if "mid-middle" in ids:
            raise RuntimeError("simulated out of memory")
        values = original(self, model, batch)
        if ids == {"short-all"}:
            values[0] = math.nan
        if ids == {"tiny-one"}:
            values[0] = 0.5
        return values

    monkeypatch.setattr(TransformersBackend, "_forward_span_logprobs", flaky)
    results = run(lambda: backend.score(requests))
    by_id = {r.request_id: r for r in results}
    assert isinstance(by_id["mid-middle"], PromptFailure)
    assert "RuntimeError" in by_id["mid-middle"].reason
    assert isinstance(by_id["short-all"], PromptFailure)
    assert "non-finite" in by_id["short-all"].reason
    assert isinstance(by_id["tiny-one"], PromptFailure)
    assert "positive" in by_id["tiny-one"].reason
    # The batch was retried one by one, so the healthy prompts are still scored.
    assert isinstance(by_id["long-tail"], SpanLogprobs)
    assert isinstance(by_id["long-head"], SpanLogprobs)


def test_closed_backend_refuses_work(tiny_model_dir: Path) -> None:
    backend = TransformersBackend.load(tiny_model_dir, device="cpu")
    ids = chat_ids(backend, "Hi")
    run(backend.aclose)
    run(backend.aclose)  # idempotent
    with pytest.raises(BackendUnavailable):
        run(lambda: backend.score([SpanRequest("x", ids, 1, 3)]))


def test_plan_batches_covers_each_request_once_within_budgets() -> None:
    lengths = [5, 300, 40, 41, 120, 7, 300, 2000, 64]
    requests = [SpanRequest(str(i), tuple(range(n)), 1, n) for i, n in enumerate(lengths)]
    modes: list[HeadMode] = ["mask", "positions", "full"]
    for mode in modes:
        batches = plan_batches(requests, token_budget=600, row_budget=700, head_mode=mode)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for batch in batches:
            sizes = [lengths[i] for i in batch]
            if len(batch) > 1:  # an oversized request runs alone; otherwise budgets hold
                assert len(batch) * max(sizes) <= 600
                if mode == "mask":
                    assert sum(n - 1 for n in sizes) <= 700
    # Longest first, so padding stays small.
    assert plan_batches(requests, token_budget=600, row_budget=700)[0] == [7]


def test_token_logprobs_equals_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 20
    targets = torch.randint(0, 50, (7,))
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(7), targets]
    assert torch.allclose(token_logprobs(logits, targets).double(), expected, atol=1e-5)
    assert bool((token_logprobs(logits.bfloat16(), targets) <= 0).all())


# --- real SmolLM2 -----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_from_settings_batched_logprobs_match_brute_force(smollm2_dir: Path) -> None:
    settings = Settings(model=EMBEDDED_MODEL, cache_dir=cache_dir_for_tests(), device="cpu")
    backend = TransformersBackend.from_settings(settings)
    assert backend.model_id == EMBEDDED_MODEL
    assert backend.max_model_len == 8192
    assert backend.tokenizer.encode("<|im_end|>").ids == (2,)
    assert 2 in backend.tokenizer.eos_token_ids
    requests = mixed_requests(backend)
    results = run(lambda: backend.score(requests))
    worst = assert_close_to_reference(results, requests, load_reference(smollm2_dir))
    assert worst < TOL
    # The model is real, not random: the answer to a trivial question is likely.
    ids = chat_ids(backend, "What is the capital of France?", "The capital of France is Paris.")
    prompt_len = len(chat_ids(backend, "What is the capital of France?"))
    [answer] = run(lambda: backend.score([SpanRequest("a", ids, prompt_len, len(ids))]))
    assert isinstance(answer, SpanLogprobs)
    assert answer.total / len(answer.logprobs) > -1.0
    run(backend.aclose)


def test_the_prompt_contract_of_every_backend(tiny_model_dir: Path) -> None:
    # A short context, so that the at-the-limit forwards stay cheap.
    short = TransformersBackend.load(tiny_model_dir, device="cpu", max_model_len=64)
    limits = Limits(prompt=64, generation=63, scored=64, vocab=short._vocab_size)
    run(lambda: check_contract(short.score, short.generate, limits))
