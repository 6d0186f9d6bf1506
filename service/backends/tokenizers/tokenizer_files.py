"""A model folder's tokenizer alone, for backends that do not load the weights (``remote``).

Beside the transformers backend, the one place that imports transformers for serving: the
remote backend builds prompts here and sends token ids, so it needs the served model's exact
tokenizer and end-of-sequence ids, not its weights.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.errors import BackendUnavailable


def load_prompt_tokenizer(folder: Path, *, name: str) -> HFPromptTokenizer:
    """The tokenizer of a local model folder, with its generation config's eos ids.

    Raises:
        BackendUnavailable: the folder has no loadable tokenizer.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise BackendUnavailable(
            f"cannot load the tokenizer of {name!r}: {type(exc).__name__}"
        ) from exc
    eos: list[int] = []
    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        config = None  # no generation_config.json: the tokenizer's eos alone
    value = getattr(config, "eos_token_id", None)
    if isinstance(value, int):
        eos = [value]
    elif isinstance(value, list):
        eos = [int(i) for i in value]
    return HFPromptTokenizer(tokenizer, extra_eos_token_ids=eos)
