"""The paced benchmark engine: GPU-measured forward times, no CPU, deterministic scores."""

from __future__ import annotations

import asyncio
import time
import typing

import pytest

from service.backends.base import GenerationRequest, SpanLogprobs, SpanRequest
from service.backends.factory import resolve_backend
from service.backends.fakes.paced import PROFILES, PacedBackend, PacedProfile
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded
from tests.support.prompt_contract import Limits, check_contract

FAST = PacedProfile(
    "test", tokens_per_s=10_000.0, overhead_s=0.01, padded=True, decode_step_s=0.005, source="test"
)


def backend(profile: PacedProfile = FAST, budget: int = 4096) -> PacedBackend:
    return PacedBackend(
        ByteTokenizer(),
        profile,
        model="m",
        max_model_len=512,
        vocab_size=259,
        batch_token_budget=budget,
    )


def req(i: int, n: int = 100) -> SpanRequest:
    ids = tuple((i * 7 + k) % 200 + 3 for k in range(n))
    return SpanRequest(f"r{i}", ids, n - 5, n)


def test_settings_name_every_profile_and_auto_never_picks_it() -> None:
    names = typing.get_args(Settings.model_fields["paced_profile"].annotation)
    assert set(names) == set(PROFILES)
    assert resolve_backend(Settings(backend="auto")) != "paced"
    assert resolve_backend(Settings(backend="paced")) == "paced"


def test_forward_cost_model() -> None:
    assert FAST.forward_s([100, 50]) == pytest.approx(0.01 + 200 / 10_000)  # padded: 2 x 100
    summed = PacedProfile("s", 10_000.0, 0.0, padded=False, decode_step_s=0.0, source="")
    assert summed.forward_s([100, 50]) == pytest.approx(150 / 10_000)


def test_scores_are_deterministic_per_prompt_and_take_the_paced_time_without_cpu() -> None:
    slow = PacedProfile("slow", 1_000.0, 0.0, padded=True, decode_step_s=0.0, source="test")

    async def main() -> tuple[list, list, float, float]:
        b = backend(slow)
        # This thread's CPU (other tests' threads may still run in the process).
        wall, cpu = time.perf_counter(), time.thread_time()
        first = await b.score([req(1), req(2)])
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        again = await b.score([req(2), req(1)])
        return first, again, wall, cpu

    first, again, wall, cpu = asyncio.run(main())
    assert all(isinstance(r, SpanLogprobs) and len(r.logprobs) == 5 for r in first)
    assert all(-4.0 <= v <= 0 for r in first for v in r.logprobs)  # type: ignore[union-attr]
    assert first[0].logprobs == again[1].logprobs and first[1].logprobs == again[0].logprobs  # type: ignore[union-attr]
    assert first[0].logprobs != first[1].logprobs  # type: ignore[union-attr]
    expected = slow.forward_s([100, 100])  # 0.2 s
    assert wall >= expected * 0.95
    assert cpu < expected / 4  # it slept: the engine's time is not the service's CPU


def test_concurrent_calls_share_forwards_through_the_scheduler() -> None:
    async def main() -> tuple[float, float]:
        b = backend()
        t = time.perf_counter()
        await asyncio.gather(*(b.score([req(i)]) for i in range(8)))
        return time.perf_counter() - t, b.busy_s

    wall, busy = asyncio.run(main())
    # 8 prompts of 100 tokens: one forward of 800 padded tokens after the first lone one,
    # far less than 8 forwards' overheads.
    assert busy < 8 * FAST.forward_s([100])
    assert wall == pytest.approx(busy, rel=0.5)


def test_bad_prompts_are_refused_like_a_real_engine() -> None:
    b = backend()
    with pytest.raises(LimitExceeded):
        asyncio.run(b.score([req(1, n=600)]))
    with pytest.raises(InvalidRequest):
        asyncio.run(b.score([SpanRequest("x", (1, 2, 999), 1, 3)]))


def test_generation_takes_prefill_and_decode_steps() -> None:
    async def main() -> tuple[list, float]:
        b = backend()
        out = await b.generate([GenerationRequest("g", req(1).token_ids, 3, score_ids=(5, 6))])
        return out, b.busy_s

    out, busy = asyncio.run(main())
    assert len(out[0].token_ids) == 3 and out[0].score_logprobs is not None  # type: ignore[union-attr]
    assert busy == pytest.approx(FAST.forward_s([100]) + 3 * FAST.decode_step_s)


def test_the_prompt_contract_of_every_backend() -> None:
    b = backend()
    limits = Limits(prompt=512, generation=511, scored=512, vocab=259)
    asyncio.run(check_contract(b.score, b.generate, limits))
