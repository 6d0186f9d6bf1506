"""Which tokenizer counts the context budget: the generator's when configured
(``generator_tokenizer``), else the scoring model's, and whether that is the generator's."""

from __future__ import annotations

import functools
from pathlib import Path

from service.backends.base import PromptTokenizer
from service.config.settings import Settings


@functools.lru_cache(maxsize=4)
def _load(name: str) -> PromptTokenizer:
    # Loaded once per process and name (a tokenizer takes ~0.1-1 s to load), lazily: only
    # requests with a context budget need it.
    from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer

    return load_prompt_tokenizer(Path(name), name=name)


def budget_tokenizer(
    settings: Settings, scorer: PromptTokenizer, scorer_name: str
) -> tuple[PromptTokenizer, str, bool]:
    """The tokenizer that counts, its name, and whether it is the generator's.

    Raises:
        BackendUnavailable: ``generator_tokenizer`` is set and cannot be loaded.
    """
    if settings.generator_tokenizer is not None:
        return _load(settings.generator_tokenizer), settings.generator_tokenizer, True
    is_generator = settings.generator_model is None or settings.generator_model == settings.model
    return scorer, scorer_name, is_generator
