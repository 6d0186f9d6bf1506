"""Session fixtures: real model folders built once per run (SmolLM2 once per machine), and
vLLM's OpenAI server on the embedded SmolLM2, started once per session (~2.5 min on the CPU) for
every module that talks to a real server (tests/service, tests/offline)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests never reach the network; a missing file must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.server_process import wait_until_up
from service.config.settings import EMBEDDED_MODEL
from tests.app.processes import ROOT, free_port
from tests.support.models import build_tiny_llama, embedded_model_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct (cached under ~/.cache/rag-reorder)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


@pytest.fixture(scope="session")
def vllm_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no vLLM in {VLLM_VENV}: run scripts/vllm-venv.sh (`make test` builds it)",
            pytrace=False,
        )
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    env.pop("PYTHONPATH", None)
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(smollm2_dir),
        "--served-model-name",
        EMBEDDED_MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, f"{url}/v1/models", log_path, ready_s=900, poll_s=1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
