"""Starting vLLM's in-process engine (``AsyncLLM``) for the vLLM backend: the environment it
needs, the usage context that picks its step budget, and the engine arguments.

Apart from ``vllm_backend`` (scoring and generation on a started engine) and
``vllm_requests`` (what each request asks of the engine and how its output is read).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Literal

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

from service.errors import BackendUnavailable

logger = logging.getLogger(__name__)

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]

# Every request of ours is greedy, so vLLM's FlashInfer top-k/top-p sampler never samples; but
# Model Runner V2 warms it up at start, and flashinfer-python from PyPI (without its prebuilt
# kernels) then compiles them with nvcc. On the H200 of 2026-11-26 the engine sat with the GPU
# idle after its CUDA graphs until the stage's limit (scripts/device/README.md). Off unless the
# operator sets it.
_VLLM_ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def apply_vllm_env_defaults(environ: MutableMapping[str, str]) -> None:
    """Set vLLM's environment settings this backend needs where the operator has not."""
    for name, value in _VLLM_ENV_DEFAULTS.items():
        environ.setdefault(name, value)


def engine_usage_context(*, on_cpu: bool) -> UsageContext:
    """The usage context the engine is started with: it picks vLLM's default step budget.

    ``AsyncLLM``'s own context (``ENGINE_CONTEXT``) has no entry in vLLM's table of defaults
    and falls back to 2048 tokens per step; its ``LLM`` class, offline throughput work like
    this backend's (prefill only), gets 16384 on an H100/H200 and 8192 on other GPUs. On an
    H200 (2026-11-27, vLLM 0.26, results/bench/gpu_h200_20261127_2) the scoring benchmark ran
    at 2048 tokens per step, 8 steps for a query's 20 prompts. The CPU keeps 2048 (the LLM
    class would take 4096), which every CPU measurement and bench/remote.py were made with.
    ``max_num_batched_tokens`` (RAG_REORDER_MAX_NUM_BATCHED_TOKENS) overrides either.
    """
    return UsageContext.ENGINE_CONTEXT if on_cpu else UsageContext.LLM_CLASS


def start_engine(
    folder: Path,
    *,
    model_id: str | None,
    dtype: DtypeName,
    max_model_len: int | None,
    max_num_batched_tokens: int | None,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    enforce_eager: bool | None,
) -> AsyncLLM:
    """Start an engine on a local model folder (``VLLMBackend.load`` says what each argument
    does). Blocks for seconds.

    Raises:
        BackendUnavailable: the engine cannot start (bad folder, not enough memory, ...).
    """
    on_cpu = bool(current_platform.is_cpu())
    # Read by vLLM in the EngineCore process, which inherits this environment.
    apply_vllm_env_defaults(os.environ)
    if dtype == "auto":
        dtype = "float32" if on_cpu else "bfloat16"
    sizing: dict[str, Any] = {}
    # Passed only when set: vLLM derives the missing ones (the model's own context, the
    # step budget, a KV cache from the utilisation share).
    if max_model_len is not None:
        sizing["max_model_len"] = max_model_len
    if max_num_batched_tokens is not None:
        sizing["max_num_batched_tokens"] = max_num_batched_tokens
    if kv_cache_memory_bytes is not None:
        sizing["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    args = AsyncEngineArgs(
        model=str(folder),
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
        # vLLM's neutral sampling defaults: the model's generation_config.json must not slip
        # a temperature or repetition penalty into greedy decoding.
        generation_config="vllm",
        # Prompts are user passages: never log them (docs/operations.md).
        enable_log_requests=False,
        **sizing,
    )
    try:
        engine = AsyncLLM.from_engine_args(args, usage_context=engine_usage_context(on_cpu=on_cpu))
    except Exception as exc:
        # vLLM reports start failures as RuntimeError/ValueError/pydantic errors; the
        # message names paths and sizes, so it goes to the log and not to clients.
        logger.error("vLLM engine failed to start: %s", exc)
        raise BackendUnavailable(
            f"cannot start the vLLM engine for {model_id or folder.name!r}: {type(exc).__name__}"
        ) from exc
    return engine
