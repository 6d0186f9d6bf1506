"""Model folders for tests: the converted embedded SmolLM2, and a tiny random Llama beside it.

The tiny models keep a real architecture (Llama: RoPE, GQA, RMSNorm, SwiGLU; Gemma-3: the
same with sliding-window layers beside full-attention ones) and the real SmolLM2 tokenizer and
chat template, so fast tests exercise the same code paths as production at a fraction of the
cost. Weights are random but fixed by the seed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.config.settings import EMBEDDED_MODEL, Settings
from service.model_assets import resolve_model

TINY_SEED = 1234


def cache_dir_for_tests() -> Path:
    """Stable cache for converted models, shared by test runs (first conversion ~25 s).

    ``RAG_REORDER_TEST_CACHE_DIR`` overrides ``~/.cache/rag-reorder``.
    """
    override = os.environ.get("RAG_REORDER_TEST_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "rag-reorder"


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting it on first use."""
    return resolve_model(
        Settings(model=EMBEDDED_MODEL, cache_dir=cache_dir or cache_dir_for_tests())
    )


def _save_random(dst: Path, tokenizer: Any, model_class: Any, config: Any, seed: int) -> Path:
    """Initialise ``model_class(config)`` from ``seed`` and save it with ``tokenizer`` in
    ``dst`` (created); the tiny builders' common tail."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
    return dst


def build_tiny_llama(dst: Path, tokenizer_dir: Path, *, seed: int = TINY_SEED) -> Path:
    """Save a tiny random Llama (hidden 64, 2 layers, 2 heads of 32) with a real tokenizer.

    Args:
        dst: folder to write (created).
        tokenizer_dir: a model folder whose tokenizer (and vocabulary size) to reuse.
        seed: weight initialisation seed.

    Returns:
        ``dst``.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention, like SmolLM2
        head_dim=32,  # vLLM's CPU attention needs >= 32
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        # Wider than the usual 0.02: peaked next-token distributions keep greedy argmax far from
        # ties, so cached and uncached decoding cannot flip on rounding noise.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # The generation config (bos/eos/pad ids) is derived from the model config.
    return _save_random(dst, tokenizer, LlamaForCausalLM, config, seed)


def build_tiny_gemma3(dst: Path, tokenizer_dir: Path, *, seed: int = TINY_SEED) -> Path:
    """Save a tiny random Gemma-3 text model with a real tokenizer: a sliding-window layer
    (window of 8 tokens, so short prompts already overflow it), a full-attention one, and
    another sliding one, like Gemma-3-270m's 5:1 pattern in small. Its KV cache mixes both
    layer kinds, which is what cache handling (copies, crops) must survive.

    Args:
        dst: folder to write (created).
        tokenizer_dir: a model folder whose tokenizer (and vocabulary size) to reuse.
        seed: weight initialisation seed.

    Returns:
        ``dst``.
    """
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaked distributions, as for the tiny Llama
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return _save_random(dst, tokenizer, Gemma3ForCausalLM, config, seed)
