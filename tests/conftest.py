"""Session fixtures: real model folders built once per run (SmolLM2 once per machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network; a missing file must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.support.models import build_tiny_llama, embedded_model_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct (cached under ~/.cache/rag-reorder)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)
