"""Loading a transformers model for ``TransformersBackend``: device and dtype, a distilled
adapter merged into the weights, the context length, the eos ids, the default batch budget,
and the probe of which LM-head mode the model supports.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, TypeVar, cast

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from service.backends.scheduling.batching import HeadMode
from service.errors import BackendUnavailable

logger = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
_Model = TypeVar("_Model", bound=torch.nn.Module)

# Padded prompt tokens per forward batch when the settings leave it open. A GPU needs large
# batches to stay busy; a CPU does not, and there a large padded batch is slower
# (results/bench/batch_budget.json: SmolLM2 on 2 cores, 4096 against 16384).
_CUDA_BATCH_TOKENS = 16384
_CPU_BATCH_TOKENS = 4096
_DEFAULT_CONTEXT = 2048


def merged(model: _Model, adapter: Path) -> _Model:
    """``model`` with a LoRA adapter folded into its weights: a merged model runs at the base
    model's speed (no extra low-rank matmuls per layer) and keeps every forward path
    (``logits_to_keep``, the KV cache) of the base class."""
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BackendUnavailable(
            f"cannot load adapter {adapter.name!r}: {type(exc).__name__}"
        ) from exc
    # merge_and_unload returns the base model object itself, its LoRA layers folded in.
    return cast(_Model, peft_model.merge_and_unload())


def set_torch_threads(threads: int) -> None:
    """torch's intra-op threads for this process (``service.backends.factory.size_threads``)."""
    if torch.get_num_threads() != threads:
        logger.info("torch intra-op threads: %d (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def default_batch_token_budget(device: torch.device) -> int:
    """The forward-batch budget for ``device`` when the settings leave it open."""
    return _CUDA_BATCH_TOKENS if device.type == "cuda" else _CPU_BATCH_TOKENS


def probe_head(
    model: PreTrainedModel, device: torch.device, accepts_logits_to_keep: bool
) -> tuple[list[HeadMode], int]:
    """Head modes this model supports (best first) and the head's width, by tiny forwards."""
    ids = torch.zeros((2, 3), dtype=torch.long, device=device)
    with torch.inference_mode():
        head_vocab = int(model(input_ids=ids, use_cache=False).logits.shape[-1])
    if not accepts_logits_to_keep:
        return ["full"], head_vocab
    modes: list[HeadMode] = []
    # Three kept rows in a batch of two: a flattened (3, vocab) output proves per-row selection.
    keep = torch.tensor([[False, True, False], [True, False, True]], device=device)
    with torch.inference_mode():
        try:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
            if logits.ndim == 2 and logits.shape[0] == 3:
                modes.append("mask")
        except (RuntimeError, IndexError, TypeError, ValueError):
            pass
        try:
            positions = torch.tensor([0, 2], device=device)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=positions).logits
            if logits.ndim == 3 and tuple(logits.shape[:2]) == (2, 2):
                modes.append("positions")
        except (RuntimeError, IndexError, TypeError, ValueError):
            pass
    modes.append("full")
    return modes, head_vocab


def weight_rows(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise BackendUnavailable("the model's input embeddings have no weight matrix")
    return int(weight.shape[0])


def resolve_device(device: DeviceName) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("device 'cuda' requested but no CUDA device is visible")
    return torch.device(device)


def resolve_dtype(dtype: DtypeName, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # CPU kernels are fastest and exact in float32; bfloat16 halves GPU memory and time.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def generation_eos_ids(model: PreTrainedModel) -> list[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def context_length(model: PreTrainedModel, requested: int | None) -> int:
    native = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(native, int):
        native = None
    if requested is None:
        if native is None:
            logger.warning("model declares no context length; using %d", _DEFAULT_CONTEXT)
        return native or _DEFAULT_CONTEXT
    if native is not None and requested > native:
        logger.warning(
            "max_model_len %d is over the model's context %d; using %d", requested, native, native
        )
        return native
    return requested
