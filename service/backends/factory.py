"""Choose and build the scoring backend from settings.

``auto`` takes vLLM when vLLM is installed and an NVIDIA GPU is visible, else transformers (the
embedded CPU default). Backend modules are imported lazily: only the chosen one pulls in its
heavy dependencies.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Literal

from service.backends.base import LogprobBackend
from service.config.settings import Settings
from service.runtime.cpus import CpuBudget

log = logging.getLogger(__name__)

ResolvedBackend = Literal["vllm", "transformers", "remote", "paced"]


def gpu_visible() -> bool:
    """An NVIDIA device node exists (checked without importing torch or initialising CUDA)."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(settings: Settings) -> ResolvedBackend:
    """The backend ``settings.backend`` stands for on this machine."""
    if settings.backend != "auto":
        return settings.backend
    return "vllm" if gpu_visible() and vllm_installed() else "transformers"


def size_threads(settings: Settings, budget: CpuBudget) -> None:
    """Size torch's intra-op threads to the CPUs the process may use (``service.runtime.cpus``),
    before any model loads: torch's default is the host's core count, which in a pod limited
    to 2 CPUs of a 64-core node runs 64 threads on 2 CPUs of quota. vLLM sizes its own
    (``VLLM_CPU_OMP_THREADS_BIND`` on a CPU) and the paced engine runs none; the dense
    encoder shares torch's setting with the transformers backend."""
    if resolve_backend(settings) in ("vllm", "paced") or importlib.util.find_spec("torch") is None:
        return
    from service.backends.engines.transformers_loading import set_torch_threads

    set_torch_threads(budget.torch_threads)


def create_backend(settings: Settings) -> LogprobBackend:
    """Build the configured backend. Blocks while the model loads (run it in a thread).

    Raises:
        BackendUnavailable: the model or the engine cannot be loaded.
    """
    kind = resolve_backend(settings)
    log.info("loading backend %s for model %s", kind, settings.model)
    if kind == "paced":
        from service.backends.fakes.paced import PacedBackend

        log.warning("backend paced: no model, benchmark log-probs at a GPU's measured pace")
        return PacedBackend.from_settings(settings)
    if kind == "remote":
        from service.backends.engines.remote_backend import RemoteBackend

        return RemoteBackend.from_settings(settings)
    if kind == "vllm":
        from service.backends.engines.vllm_backend import VLLMBackend

        return VLLMBackend.from_settings(
            settings, kv_cache_memory_bytes=settings.vllm_kv_cache_bytes
        )
    from service.backends.engines.transformers_backend import TransformersBackend

    return TransformersBackend.from_settings(settings)
