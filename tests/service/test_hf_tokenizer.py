"""HFPromptTokenizer over the real SmolLM2 tokenizer: template text, offsets, end-of-turn ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from service.backends.base import ChatMessage, PromptTokenizer
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer

IM_START, IM_END, ENDOFTEXT = 1, 2, 0
MESSAGES = [ChatMessage("system", "Be brief."), ChatMessage("user", "Café in 日本? ok")]


@pytest.fixture(scope="module")
def hf_tok(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_render_chat_is_the_model_template(hf_tok: Any) -> None:
    tok = HFPromptTokenizer(hf_tok)
    assert isinstance(tok, PromptTokenizer)
    text = tok.render_chat(MESSAGES, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCafé in 日本? ok<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.render_chat(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_encode_adds_no_special_tokens_and_offsets_cover_the_text(hf_tok: Any) -> None:
    tok = HFPromptTokenizer(hf_tok)
    text = tok.render_chat(MESSAGES, add_generation_prompt=True)
    enc = tok.encode(text)
    assert enc.ids[0] == IM_START and enc.ids.count(IM_END) == 2  # written by the template only
    assert tok.encode("Hello").ids == tuple(hf_tok("Hello", add_special_tokens=False)["input_ids"])
    assert len(enc.offsets) == len(enc.ids)
    assert enc.offsets[0][0] == 0 and enc.offsets[-1][1] == len(text)
    assert all(start <= end for start, end in enc.offsets)
    assert tok.decode(enc.ids) == text  # special tokens kept


def test_encode_batch_is_encode_of_each_text(hf_tok: Any) -> None:
    tok = HFPromptTokenizer(hf_tok)
    texts = [
        tok.render_chat(MESSAGES, add_generation_prompt=True),
        "Hello",
        "a much longer text " * 50 + "with   odd   spacing\n\n and Ünïcödé 日本語",
        "<|im_start|>user\nshort<|im_end|>",
    ]
    expected = []
    for text in texts:
        out = hf_tok(text, return_offsets_mapping=True, add_special_tokens=False)
        expected.append((tuple(out["input_ids"]), tuple(tuple(o) for o in out["offset_mapping"])))
    got = tok.encode_batch(texts)
    assert [(e.ids, e.offsets) for e in got] == expected  # padding-free, in order
    assert [tok.encode(t) for t in texts] == got
    assert tok.encode_batch([]) == []


def test_eos_ids_include_the_templates_end_of_turn(hf_tok: Any) -> None:
    assert HFPromptTokenizer(hf_tok).eos_token_ids == {IM_END}
    # A tokenizer whose eos is not the end-of-turn token still stops at <|im_end|>.
    other = AutoTokenizer.from_pretrained(hf_tok.name_or_path)
    other.eos_token = "<|endoftext|>"
    tok = HFPromptTokenizer(other, extra_eos_token_ids=[7])
    assert tok.eos_token_ids == {ENDOFTEXT, IM_END, 7}


def test_missing_chat_template_is_a_clear_error(hf_tok: Any) -> None:
    bare = AutoTokenizer.from_pretrained(hf_tok.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        HFPromptTokenizer(bare).render_chat(MESSAGES, add_generation_prompt=True)


def test_render_completion_adds_what_the_tokenizer_adds_itself(hf_tok: Any) -> None:
    # SmolLM2's tokenizer adds no BOS to plain text: the completion prompt is the text alone.
    assert HFPromptTokenizer(hf_tok).render_completion("Question:\nx") == "Question:\nx"
    # A tokenizer that adds a BOS itself (as Gemma's does): the prompt starts with it as text,
    # and encoding that text gives the ids the tokenizer itself gives for the plain text.
    tok = HFPromptTokenizer(_bos_tokenizer())
    text = tok.render_completion("Question: x")
    assert text == "<s>Question: x"
    assert list(tok.encode(text).ids) == _bos_tokenizer()("Question: x")["input_ids"] == [0, 2, 3]


def _bos_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "Question:": 2, "x": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>")
