"""``fit_passages``' cut where the limit's boundary splits a character (issue 94, item 4): on
the byte tokenizer every UTF-8 byte is a token, so a cut inside a character must move back
to the character's start, and the report must count the tokens kept, not the limit."""

from __future__ import annotations

import pytest

from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage
from service.prompting.truncation import fit_passages


def test_a_cut_inside_a_character_moves_back_to_a_boundary_and_counts_it() -> None:
    tokenizer = ByteTokenizer()
    text = "ab\U0001f600cd"  # a, b, four bytes of the emoji, c, d: 8 tokens
    passages = [Passage("ok"), Passage(text, title="T", id="x")]
    fitted, cuts = fit_passages(tokenizer, passages, 4, truncate=True)
    assert [(c.index, c.tokens, c.tokens_kept, c.tokens_cut, c.chars_kept) for c in cuts] == [
        (1, 8, 2, 6, 2)
    ]
    assert fitted[0] == passages[0] and fitted[1] == Passage("ab", title="T", id="x")
    fitted, cuts = fit_passages(tokenizer, passages, 6, truncate=True)
    assert fitted[1].text == "ab\U0001f600" and cuts[0].tokens_kept == 6
    with pytest.raises(LimitExceeded) as refused:
        fit_passages(tokenizer, passages, 4, truncate=False)
    assert refused.value.param == "passages[1]" and refused.value.value == 8


def test_a_passage_that_cannot_be_cut_is_a_422_naming_it() -> None:
    with pytest.raises(InvalidRequest) as refused:
        fit_passages(ByteTokenizer(), [Passage("\U0001f600 rest")], 2, truncate=True)
    assert refused.value.param == "passages[0]"
