"""The vLLM backend against brute-force transformers on a tiny random Llama (CPU, float32).

On a GPU (scripts/device/gpu-engines.sh) the same module runs on CUDA, both sides on the GPU,
with ``RAG_REORDER_TEST_VLLM_DTYPE`` (default float32); the per-token tolerance in nats comes
from ``TOLERANCES`` (what was measured on each device and dtype) unless
``RAG_REORDER_TEST_VLLM_TOL`` sets it. A tolerance that loose would let a misaligned span pass
is caught: the score test also checks that an off-by-one reading misses by more than twice it.
Greedy generation is checked against the reference model on vLLM's own tokens (each one the
reference's arg-max within the tolerance), since in bfloat16 a near-tie may go either way.

Runs only where vLLM is importable, i.e. in the ``.venv-vllm`` virtualenv made by
``scripts/vllm-venv.sh``::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -m vllm \
        tests/service/test_vllm_backend.py

One engine serves the whole module (starting one costs ~20 s): every test drives it through
one module-scoped ``asyncio.Runner``, because vLLM's output handler is a task of the event loop
that first used the engine and dies with that loop.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Set before vllm is imported: the EngineCore then runs the model itself instead of spawning one
# more worker process (~16 s faster start on CPU).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip(
    "vllm", reason="vllm is not installed here; run in .venv-vllm (scripts/vllm-venv.sh)"
)

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm.config import SchedulerConfig
from vllm.engine import arg_utils
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.logprobs import FlatLogprobs, Logprob
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from service.backends.base import (
    POSITIVE_TOLERANCE,
    ChatMessage,
    Generation,
    GenerationRequest,
    LogprobBackend,
    PromptFailure,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.engines import vllm_engine
from service.backends.engines.vllm_backend import VLLMBackend
from service.backends.engines.vllm_engine import apply_vllm_env_defaults
from service.backends.engines.vllm_requests import (
    TOKEN_ID_PARAMS,
    generation_from_output,
    resolve_score_mode,
    span_from_prompt_logprobs,
    span_from_token_id_scores,
    with_score_logprobs,
)
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.errors import BackendUnavailable
from tests.support.prompt_contract import Limits, check_contract

pytestmark = pytest.mark.vllm

DTYPE = os.environ.get("RAG_REORDER_TEST_VLLM_DTYPE", "float32")
# nats, per (device, dtype): about 3x the largest |vLLM - transformers| this module measured.
# CPU float32: ~1e-5. H200, vLLM 0.26 (2026-11-27, results/bench/gpu_h200_20261127): float32
# 0.0126 (vLLM runs float32 attention in Triton, whose dots default to TF32; transformers' SDPA
# does not), bfloat16 0.127 (FlashAttention 3 and torch.compile's fused kernels against SDPA).
TOLERANCES = {
    ("cpu", "float32"): 1e-3,
    ("cuda", "float32"): 0.04,
    ("cpu", "bfloat16"): 0.4,
    ("cuda", "bfloat16"): 0.4,
}
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = float(
    os.environ.get("RAG_REORDER_TEST_VLLM_TOL") or TOLERANCES.get((_DEVICE, DTYPE), 1e-3)
)
CONTEXT = 512
STEP_TOKENS = 128  # below the longest test prompt, so chunked prefill is exercised


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as run:
        yield run


@pytest.fixture(scope="module")
def backend(runner: asyncio.Runner, tiny_model_dir: Path) -> Iterator[VLLMBackend]:
    # Built in a worker thread, as an app's lifespan would, to keep that path tested.
    built = runner.run(
        asyncio.to_thread(
            VLLMBackend.load,
            tiny_model_dir,
            model_id="tiny-llama",
            dtype=DTYPE,  # type: ignore[arg-type]
            max_model_len=CONTEXT,
            max_num_batched_tokens=STEP_TOKENS,
            max_num_seqs=16,
            # A fixed KV cache: the utilisation share would claim 85% of this machine's RAM.
            kv_cache_memory_bytes=128 << 20,
        )
    )
    yield built
    # Closing while a call is in flight: the caller gets BackendUnavailable, not a hang.
    pending = long_requests(built, count=8)

    async def close_during_call() -> BaseException | None:
        task = asyncio.create_task(built.score(pending))
        await wait_until(lambda: built.num_unfinished_requests > 0)
        await built.aclose()
        try:
            await task
        except BaseException as exc:
            return exc
        return None

    raised = runner.run(close_during_call())
    assert isinstance(raised, BackendUnavailable), raised
    assert not built.is_healthy()
    with pytest.raises(BackendUnavailable):
        runner.run(built.score(pending[:1]))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=getattr(torch, DTYPE)
    ).to("cuda" if torch.cuda.is_available() else "cpu")
    return model.eval()


def run(runner: asyncio.Runner, coro: Any) -> Any:
    return runner.run(coro)


async def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


def random_ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def long_requests(backend: VLLMBackend, count: int) -> list[SpanRequest]:
    rng = random.Random(7)
    vocab = backend._vocab_size
    return [SpanRequest(f"long{i}", random_ids(rng, 400, vocab), 1, 400) for i in range(count)]


def max_diff(got: Sequence[float], expected: Sequence[float]) -> float:
    return max(abs(a - b) for a, b in zip(got, expected, strict=True))


def reference_span(model: Any, req: SpanRequest) -> list[float]:
    """log_softmax over the whole sequence (not cut at span_end), gathered at the span."""
    with torch.no_grad():
        logits = model(torch.tensor([req.token_ids], device=model.device)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[pos - 1, req.token_ids[pos]]) for pos in range(req.span_start, req.span_end)]


def reference_greedy(
    model: Any, prompt: Sequence[int], max_new: int, stop_ids: frozenset[int]
) -> tuple[list[int], list[float], str]:
    """Greedy decoding by full recomputation: no KV cache to share bugs with."""
    ids = list(prompt)
    out: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logp))
            out.append(token)
            lps.append(float(logp[token]))
            ids.append(token)
            if token in stop_ids:
                return out, lps, "stop"
    return out, lps, "length"


def check_greedy(
    model: Any,
    prompt: Sequence[int],
    result: Generation,
    max_new: int,
    stop_ids: frozenset[int],
) -> float:
    """vLLM's greedy tokens, read by the reference with teacher forcing: each must be the
    reference's arg-max within TOLERANCE (bfloat16 near-ties may go either way), the run must
    end as greedy decoding ends (a stop id, else max_new tokens), and the returned log-probs
    must be the reference's. Returns the largest log-prob difference."""
    ids = list(result.token_ids)
    assert 1 <= len(ids) <= max_new
    stops = [i for i, t in enumerate(ids) if t in stop_ids]
    if result.finish_reason == "stop":
        assert stops == [len(ids) - 1], (ids, stop_ids)
    else:
        assert result.finish_reason == "length" and not stops and len(ids) == max_new
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + ids], device=model.device)).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1]
    worst = 0.0
    for step, token in enumerate(ids):
        chosen, best = float(logp[step, token]), float(logp[step].max())
        assert chosen >= best - TOLERANCE, (step, token, chosen, best)
        worst = max(worst, abs(result.logprobs[step] - chosen))
    return worst


def test_is_a_logprob_backend(backend: VLLMBackend) -> None:
    assert isinstance(backend, LogprobBackend)
    assert isinstance(backend.tokenizer, HFPromptTokenizer)
    assert backend.max_model_len == CONTEXT - 1
    # Model Runner V2 (the token-id fast path) needs Triton, which the CPU build lacks; on CUDA
    # it also needs vLLM >= 0.32's SamplingParams fields (vLLM 0.26 has the runner, not them).
    v2 = bool(backend._engine.vllm_config.use_v2_model_runner)
    assert v2 == torch.cuda.is_available()
    expected = "token_ids" if v2 and TOKEN_ID_PARAMS else "prompt_logprobs"
    assert backend.score_mode == expected
    assert backend.is_healthy() and not backend.errored


def test_tokenizer_matches_transformers(backend: VLLMBackend, tiny_model_dir: Path) -> None:
    hf = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    messages = [ChatMessage("user", "Where is the Eiffel tower? Answer briefly.")]
    text = backend.tokenizer.render_chat(messages, add_generation_prompt=True)
    assert text == hf.render_chat(messages, add_generation_prompt=True)
    assert backend.tokenizer.encode(text) == hf.encode(text)
    assert backend.tokenizer.eos_token_ids == hf.eos_token_ids
    # What a completion template's answers stop at: vLLM's tokenizer object decodes alike.
    assert backend.tokenizer.line_break_ids == hf.line_break_ids and hf.line_break_ids


def test_score_matches_brute_force_transformers(
    backend: VLLMBackend, hf_model: Any, runner: asyncio.Runner
) -> None:
    rng = random.Random(0)
    vocab = backend._vocab_size
    chat = backend.tokenizer.encode(
        backend.tokenizer.render_chat(
            [
                ChatMessage("user", "Which city has the Eiffel tower?"),
                ChatMessage("assistant", "Paris."),
            ],
            add_generation_prompt=False,
        )
    ).ids
    lengths = [5, 17, 64, 130, 260, 400, 2]
    requests = [
        # Real chat text, the whole answer turn scored.
        SpanRequest("chat", chat, len(chat) - 6, len(chat)),
    ]
    for i, n in enumerate(lengths):
        ids = random_ids(rng, n, vocab)
        requests.append(SpanRequest(f"end{i}", ids, max(1, n // 2), n))  # span at the end
        if n >= 4:
            # span in the middle: the prompt is cut at span_end before it reaches the engine
            requests.append(SpanRequest(f"mid{i}", ids, n // 4, n // 4 + max(1, n // 3)))
    requests.append(SpanRequest("first", requests[1].token_ids, 1, 2))  # first scorable token
    results = run(runner, backend.score(requests))

    assert [r.request_id for r in results] == [r.request_id for r in requests]
    worst = 0.0
    for req, result in zip(requests, results, strict=True):
        assert isinstance(result, SpanLogprobs), result
        expected = reference_span(hf_model, req)
        assert len(result.logprobs) == req.span_end - req.span_start
        worst = max(worst, max_diff(result.logprobs, expected))
    print(f"max |vLLM - transformers| = {worst:.3e} nats over {len(requests)} prompts")
    assert worst <= TOLERANCE
    # The weights are not near-uniform: scores differ, so the comparison has teeth.
    spread = [v for r in results if isinstance(r, SpanLogprobs) for v in r.logprobs]
    assert max(spread) - min(spread) > 5.0
    # And the tolerance is tight enough to see a span read one token off.
    shifted = [
        max_diff(result.logprobs[1:], reference_span(hf_model, req)[:-1])
        for req, result in zip(requests, results, strict=True)
        if isinstance(result, SpanLogprobs) and len(result.logprobs) >= 8
    ]
    print(f"off-by-one readings miss by >= {min(shifted):.3f} nats")
    assert min(shifted) > 2 * TOLERANCE


def test_generate_matches_greedy_transformers(
    backend: VLLMBackend, hf_model: Any, runner: asyncio.Runner
) -> None:
    rng = random.Random(1)
    vocab = backend._vocab_size
    eos = backend.tokenizer.eos_token_ids
    prompts = [random_ids(rng, n, vocab) for n in (3, 40, 150)]
    requests = [GenerationRequest(f"g{i}", p, 8) for i, p in enumerate(prompts)]
    results = run(runner, backend.generate(requests))
    # Stop on the third token vLLM chose for the first prompt: it must stop there, include it.
    first = results[0]
    assert isinstance(first, Generation), first
    stop_at = first.token_ids[2]
    stop = GenerationRequest("stop", prompts[0], 8, frozenset({stop_at}))
    # Alone in its batch it may take other kernels than beside the others: in bfloat16 its
    # tokens can differ, and check_greedy then holds it to stopping wherever stop_at comes.
    stopped = run(runner, backend.generate([stop]))[0]
    assert isinstance(stopped, Generation), stopped

    worst = 0.0
    for result, req in zip([*results, stopped], [*requests, stop], strict=True):
        assert isinstance(result, Generation), result
        stop_ids = eos | req.stop_token_ids
        worst = max(worst, check_greedy(hf_model, req.token_ids, result, 8, stop_ids))
    if (_DEVICE, DTYPE) == ("cpu", "float32"):
        # Where both sides compute alike, the whole trajectory is the reference's own.
        for result, req in zip([*results, stopped], [*requests, stop], strict=True):
            ids, _, reason = reference_greedy(hf_model, req.token_ids, 8, eos | req.stop_token_ids)
            assert isinstance(result, Generation)
            assert (list(result.token_ids), result.finish_reason) == (ids, reason)
        assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    print(f"max |vLLM - transformers| generation log-prob = {worst:.3e} nats")
    assert worst <= TOLERANCE


def test_generate_with_score_ids_matches_transformers(
    backend: VLLMBackend, hf_model: Any, runner: asyncio.Runner
) -> None:
    # The answer of a plain generation, and the log-probs of the score ids after the prompt,
    # for prompts and score ids of different lengths (one of them with none) in one call.
    rng = random.Random(2)
    vocab = backend._vocab_size
    eos = backend.tokenizer.eos_token_ids
    prompts = [random_ids(rng, n, vocab) for n in (3, 40, 150)]
    score_ids = [random_ids(rng, m, vocab) for m in (1, 7, 0)]
    requests = [
        GenerationRequest(f"f{i}", p, 6, score_ids=s)
        for i, (p, s) in enumerate(zip(prompts, score_ids, strict=True))
    ]
    results = run(runner, backend.generate(requests))
    worst = 0.0
    for result, req in zip(results, requests, strict=True):
        assert isinstance(result, Generation), result
        worst = max(worst, check_greedy(hf_model, req.token_ids, result, 6, eos))
        if not req.score_ids:
            assert result.score_logprobs is None
            continue
        n = len(req.token_ids)
        span = SpanRequest("r", req.token_ids + req.score_ids, n, n + len(req.score_ids))
        assert result.score_logprobs is not None
        worst = max(worst, max_diff(result.score_logprobs, reference_span(hf_model, span)))
    print(f"max |vLLM - transformers| fused generation = {worst:.3e} nats")
    assert worst <= TOLERANCE


def test_the_prompt_contract_of_every_backend(backend: VLLMBackend, runner: asyncio.Runner) -> None:
    # A malformed request raises for the whole call before anything reaches the engine, as in
    # every backend; vLLM keeps one token of its context for the one it must generate.
    limit = CONTEXT - 1
    limits = Limits(prompt=limit, generation=limit, scored=limit, vocab=backend._vocab_size)
    run(runner, check_contract(backend.score, backend.generate, limits))


def test_a_prompt_the_engine_fails_fails_alone(
    backend: VLLMBackend, hf_model: Any, runner: asyncio.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = SpanRequest("good", tuple(range(100, 130)), 10, 30)
    requests = [
        good,
        SpanRequest("engine-fails", good.token_ids, 10, 30),
        SpanRequest("good2", good.token_ids, 1, 10),
    ]
    real_generate = backend._engine.generate

    # Keyword arguments pass through, as the engine's own generate takes them.
    def generate(
        prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        if request_id.startswith("engine-fails-"):
            raise EngineGenerateError()
        return real_generate(prompt, params, request_id, **kwargs)

    monkeypatch.setattr(backend._engine, "generate", generate)
    results = run(runner, backend.score(requests))

    kinds = {r.request_id: type(r).__name__ for r in results}
    assert kinds == {
        "good": "SpanLogprobs",
        "engine-fails": "PromptFailure",
        "good2": "SpanLogprobs",
    }
    for result, req in zip(results, requests, strict=True):
        if isinstance(result, SpanLogprobs):
            expected = reference_span(hf_model, req)
            assert max_diff(result.logprobs, expected) <= TOLERANCE


def test_engine_death_raises(
    backend: VLLMBackend, runner: asyncio.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_generate = backend._engine.generate

    async def dying(
        prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        if request_id.startswith("dies-"):
            raise EngineDeadError()
        async for out in real_generate(prompt, params, request_id, **kwargs):
            yield out

    monkeypatch.setattr(backend._engine, "generate", dying)
    ok = SpanRequest("fine", tuple(range(100, 130)), 1, 30)
    with pytest.raises(BackendUnavailable):
        run(runner, backend.score([ok, SpanRequest("dies", ok.token_ids, 1, 30), ok]))
    monkeypatch.undo()
    # The sibling requests were aborted, and the engine (not really dead) still serves.
    assert backend.num_unfinished_requests == 0
    assert isinstance(run(runner, backend.score([ok]))[0], SpanLogprobs)


def test_cancellation_aborts_engine_requests(
    backend: VLLMBackend, runner: asyncio.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    external: list[str] = []
    real_abort = backend._engine.abort

    async def abort(request_ids: Any, internal: bool = False) -> None:
        if not internal:  # internal ids come from vLLM's own generate() cleanup
            external.extend([request_ids] if isinstance(request_ids, str) else request_ids)
        await real_abort(request_ids, internal)

    monkeypatch.setattr(backend._engine, "abort", abort)
    requests = long_requests(backend, count=24)

    async def cancel_mid_flight() -> None:
        task = asyncio.create_task(backend.score(requests))
        await wait_until(lambda: backend.num_unfinished_requests > 0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.num_unfinished_requests == 0

    run(runner, cancel_mid_flight())
    # Every engine request of the call was aborted by its external id (request id + suffix).
    assert sorted(a.rsplit("-", 1)[0] for a in external) == sorted(r.request_id for r in requests)
    monkeypatch.undo()
    assert isinstance(run(runner, backend.score(requests[:1]))[0], SpanLogprobs)


def test_output_checks_on_synthetic_outputs() -> None:
    req = SpanRequest("r", (10, 11, 12, 13), 1, 4)

    def flat(rows: Sequence[dict[int, float] | None]) -> FlatLogprobs:
        out = FlatLogprobs()
        for row in rows:
            out.append(None if row is None else {t: Logprob(v) for t, v in row.items()})
        return out

    good = flat([None, {11: -1.0}, {12: 2e-6}, {13: -3.0}])
    assert span_from_prompt_logprobs(req, good) == SpanLogprobs("r", (-1.0, 0.0, -3.0))
    as_dicts = [None, {11: Logprob(-1.0)}, {12: Logprob(-2.0)}, {13: Logprob(-3.0)}]
    assert span_from_prompt_logprobs(req, as_dicts) == SpanLogprobs("r", (-1.0, -2.0, -3.0))
    bad = {
        "missing": None,
        "short": flat([None, {11: -1.0}]),
        "other token": flat([None, {11: -1.0}, {99: -2.0}, {13: -3.0}]),
        "nan": flat([None, {11: -1.0}, {12: math.nan}, {13: -3.0}]),
        "inf": flat([None, {11: -math.inf}, {12: -1.0}, {13: -3.0}]),
        "positive": flat([None, {11: -1.0}, {12: 10 * POSITIVE_TOLERANCE}, {13: -3.0}]),
    }
    for name, rows in bad.items():
        assert isinstance(span_from_prompt_logprobs(req, rows), PromptFailure), name

    import numpy as np

    assert span_from_token_id_scores(req, np.array([[-1.0], [-2.0], [-3.0]])) == SpanLogprobs(
        "r", (-1.0, -2.0, -3.0)
    )
    for scores in (None, np.zeros((2, 1)), np.zeros((3, 2)), np.array([[-1.0], [np.nan], [0.0]])):
        assert isinstance(span_from_token_id_scores(req, scores), PromptFailure)

    def output(reason: str, ids: list[int], rows: FlatLogprobs | None) -> Any:
        completion = SimpleNamespace(finish_reason=reason, token_ids=ids, logprobs=rows)
        return SimpleNamespace(outputs=[completion])

    ok = generation_from_output("g", output("stop", [5, 6], flat([{5: -0.5}, {6: -0.1}])))
    assert ok == Generation("g", (5, 6), (-0.5, -0.1), "stop")
    fused = with_score_logprobs(ok, SpanLogprobs("g", (-1.0, -2.0)))
    assert fused == Generation("g", (5, 6), (-0.5, -0.1), "stop", score_logprobs=(-1.0, -2.0))
    failed = with_score_logprobs(ok, PromptFailure("g", "engine error"))
    assert failed == PromptFailure("g", "score_ids: engine error")
    gen_failed = PromptFailure("g", "no")
    assert with_score_logprobs(gen_failed, SpanLogprobs("g", (-1.0,))) is gen_failed
    for out in (
        output("abort", [5], flat([{5: -0.5}])),
        output("length", [5, 6], flat([{5: -0.5}])),
        output("length", [5, 6], flat([{5: -0.5}, {7: -0.1}])),
        output("length", [5], None),
    ):
        assert isinstance(generation_from_output("g", out), PromptFailure)


def test_score_mode_follows_what_the_engine_can_run() -> None:
    """``auto`` takes the fast path only where both the runner and the fields exist; asking for
    it elsewhere names what is missing (vLLM 0.26 on CUDA has the runner and not the fields)."""
    table = {
        (True, True): "token_ids",
        (True, False): "prompt_logprobs",
        (False, True): "prompt_logprobs",
        (False, False): "prompt_logprobs",
    }
    for (v2, fields), mode in table.items():
        assert resolve_score_mode("auto", v2_runner=v2, token_id_params=fields) == mode
        assert (
            resolve_score_mode("prompt_logprobs", v2_runner=v2, token_id_params=fields)
            == "prompt_logprobs"
        )
    assert resolve_score_mode("token_ids", v2_runner=True, token_id_params=True) == "token_ids"
    with pytest.raises(ValueError, match="Model Runner V2"):
        resolve_score_mode("token_ids", v2_runner=False, token_id_params=True)
    with pytest.raises(ValueError, match=r"prompt_logprob_token_ids \(vLLM >= 0.32\)"):
        resolve_score_mode("token_ids", v2_runner=True, token_id_params=False)


def test_flashinfer_sampler_off_unless_the_operator_says(backend: VLLMBackend) -> None:
    """Greedy requests never use FlashInfer's top-k/top-p sampler; its start-up JIT must not run
    (scripts/device/README.md, 2026-11-26). An operator's own setting wins."""
    environ: dict[str, str] = {}
    apply_vllm_env_defaults(environ)
    assert environ == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    environ = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    apply_vllm_env_defaults(environ)
    assert environ == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    # The module's engine was started through load(), which applied it to this process.
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") is not None


@pytest.mark.skipif(
    not TOKEN_ID_PARAMS, reason="this vLLM has no prompt_logprob_token_ids (vLLM < 0.32)"
)
def test_token_id_fast_path_requests(backend: VLLMBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU-only fast path, as far as CPU can check it: vLLM accepts the request we build and
    we read its documented output layout back (row i scores prompt token start + i + 1)."""
    monkeypatch.setattr(backend, "_score_mode", "token_ids")
    req = SpanRequest("fast", tuple(range(100, 140)), 10, 25)
    job = backend._score_job(req)
    params = job.params
    assert job.token_ids == req.token_ids[:25]  # cut at span_end
    assert params.prompt_logprobs is None and params.max_tokens == 1
    rows = params.prompt_logprob_token_ids
    # vLLM's own checks: ids in vocabulary, and exactly prompt_len - 1 - start rows.
    params._validate_logprobs(backend._engine.model_config)
    assert rows.shape == (len(job.token_ids) - 1 - params.prompt_logprob_start, 1)
    assert [int(r[0]) for r in rows] == list(req.token_ids[10:25])

    import numpy as np

    values = -np.arange(1, 16, dtype=np.float32)[:, None] / 10
    out = SimpleNamespace(prompt_token_ids=list(job.token_ids), prompt_token_id_logprobs=values)
    parsed = job.parse(out)
    assert isinstance(parsed, SpanLogprobs)
    assert np.allclose(parsed.logprobs, values[:, 0])
    other = SimpleNamespace(prompt_token_ids=[1, 2, 3], prompt_token_id_logprobs=values)
    assert isinstance(job.parse(other), PromptFailure)


@pytest.mark.parametrize(
    ("memory_gib", "name", "tokens"),
    [(141, "NVIDIA H200", 16384), (80, "NVIDIA H100 80GB HBM3", 16384), (24, "NVIDIA L4", 8192)],
)
def test_gpu_engines_get_the_llm_class_step_budget(
    memory_gib: int, name: str, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the engine starts in the ``LLM`` class's usage context, whose step budget vLLM
    sizes for the device; ``AsyncLLM``'s own context has none and ran the H200 of 2026-11-27 at
    2048 tokens per step. vLLM's own table, read as on that GPU."""
    platform = arg_utils.current_platform
    monkeypatch.setattr(platform, "get_device_total_memory", lambda *_a, **_k: memory_gib << 30)
    monkeypatch.setattr(platform, "get_device_name", lambda *_a, **_k: name)
    monkeypatch.setattr(platform, "is_cpu", lambda: False)
    monkeypatch.setattr(platform, "is_tpu", lambda: False)
    budgets, _ = arg_utils.EngineArgs.get_batch_defaults(1)
    assert budgets[vllm_engine.engine_usage_context(on_cpu=False)] == tokens
    assert UsageContext.ENGINE_CONTEXT not in budgets
    assert SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    # The CPU keeps AsyncLLM's context: its measurements were made at 2048.
    assert vllm_engine.engine_usage_context(on_cpu=True) == UsageContext.ENGINE_CONTEXT


def test_load_starts_a_gpu_engine_in_the_llm_class_context(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load() passes that context (the start itself stubbed: this is about the call)."""
    seen: dict[str, Any] = {}

    def start(_args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(vllm_engine.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(vllm_engine.AsyncLLM, "from_engine_args", start)
    with pytest.raises(BackendUnavailable):
        VLLMBackend.load(tiny_model_dir)
    assert seen == {"usage_context": UsageContext.LLM_CLASS}


def test_the_cpu_engine_steps_2048_tokens_by_default(tiny_model_dir: Path) -> None:
    """The step budget load() leaves to vLLM on the CPU, read from the config it would build."""
    args = AsyncEngineArgs(model=str(tiny_model_dir), dtype="float32", enforce_eager=True)
    config = args.create_engine_config(usage_context=vllm_engine.engine_usage_context(on_cpu=True))
    assert config.scheduler_config.max_num_batched_tokens == 2048


def test_score_mode_check_on_this_engine(runner: asyncio.Runner, backend: VLLMBackend) -> None:
    """The start-up check on the real engine. Where it cannot run token_ids (the CPU build, vLLM
    0.26 on a GPU) it says why and keeps prompt_logprobs; where it can (vLLM >= 0.32 on CUDA)
    both modes score the probes and must agree: the first such GPU settles issue 63."""
    check = run(runner, backend.check_score_mode())
    print(f"score mode check: {check}")  # the GPU session's log records it (-s)
    assert check.mode == backend.score_mode
    if backend._engine.vllm_config.use_v2_model_runner and TOKEN_ID_PARAMS:
        assert check.outcome == "agreed", check.detail
        assert check.max_abs_diff is not None and check.max_abs_diff <= check.tolerance
    else:
        assert (check.outcome, check.mode) == ("not_run", "prompt_logprobs")
        assert "cannot run token_ids" in check.detail


def test_score_mode_check_falls_back_on_a_wrong_fast_path(
    runner: asyncio.Runner, backend: VLLMBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's side of the check, with the fast path's rows off by one: scoring goes on
    in prompt_logprobs; set explicitly, token_ids fails the start."""
    real_score_in = backend._score_in

    async def off_by_one(mode: str, reqs: Sequence[SpanRequest]) -> list[Any]:
        got = await real_score_in("prompt_logprobs", reqs)
        if mode == "prompt_logprobs":
            return got
        return [SpanLogprobs(r.request_id, (*r.logprobs[1:], -9.0)) for r in got]  # type: ignore[union-attr]

    monkeypatch.setattr(backend, "_score_in", off_by_one)
    monkeypatch.setattr(backend, "_score_mode", "token_ids")
    monkeypatch.setattr(backend, "_requested_mode", "auto")
    check = run(runner, backend.check_score_mode())
    assert (check.outcome, check.mode, backend.score_mode) == (
        "disagreed",
        "prompt_logprobs",
        "prompt_logprobs",
    )
    monkeypatch.setattr(backend, "_score_mode", "token_ids")
    monkeypatch.setattr(backend, "_requested_mode", "token_ids")
    with pytest.raises(BackendUnavailable, match="token_ids"):
        run(runner, backend.check_score_mode())
