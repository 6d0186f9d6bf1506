"""Convert a GGUF checkpoint into a plain transformers folder (float32 safetensors + tokenizer).

Beside the model assets that call it, not in the backend that later loads the folder: with
``service.backends.engines.transformers_backend`` the only module that imports torch and
transformers (an import-linter contract keeps it so), and imported lazily by
``service.model_assets`` so that resolving a path stays cheap.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def convert_gguf(gguf_path: Path, dst: Path) -> None:
    """Convert a GGUF checkpoint into a transformers folder: float32 safetensors + tokenizer.

    Quantised GGUF weights are dequantised (transformers does it on load); the dense copy is
    saved without any quantisation config, so later loads are plain and fast.

    Args:
        gguf_path: the ``.gguf`` file.
        dst: an existing, empty folder to write into.

    Raises:
        ValueError: transformers cannot map the GGUF tensors onto a dense model.
    """
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        # The GGUF loader marks the model as GGUF-quantised even when every weight was
        # dequantised, and refuses to save it; a fresh dense model with a strict state-dict
        # load both drops that mark and proves no packed weight is left.
        del config.quantization_config
    dense = type(loaded)(config)
    dense.load_state_dict(loaded.state_dict(), strict=True)
    dense.generation_config = loaded.generation_config
    dense.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))


def probe_ids(folder: Path, text: str) -> list[int]:
    """``text``'s token ids (special tokens included) by ``folder``'s saved tokenizer."""
    ids: list[int] = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    return ids
