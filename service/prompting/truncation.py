"""The per-passage token limit (issue 94, item 4): a passage whose text has more of the scoring
model's tokens than the limit is refused, or, only where the request asks for it, cut to its
first tokens, and every cut is reported.

Tokens are counted on the passage's text alone, tokenised on its own with the tokenizer the
prompts are built with (as the rerank routes' ``max_tokens_per_doc`` always counted them); the
title is not counted or cut (``max_passage_chars`` bounds it). A cut falls on a token boundary
and keeps a prefix of the text whose own tokens are exactly the first ``tokens_kept`` tokens of
the whole text, so the report counts the tokens the caller's text lost in the same tokens the
limit is stated in. Byte-level BPE can split one character over several tokens, and a BPE may
merge a word's prefix differently on its own, so the first boundary tried (the limit's) need
not give that: the cut then moves back a token at a time, at most ``MAX_BACKOFF`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from service.backends.base import PromptTokenizer
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage

__all__ = ["MAX_BACKOFF", "Cut", "fit_passages"]

ENCODE_CHUNK_CHARS: Final = 65_536
"""Characters of passages tokenised in one batch: as prompt building's chunks
(``service.prompting.prompts``), a few long passages a call, under about 60 MB encoded."""

MAX_BACKOFF: Final = 16
"""Tokens a cut may move back from the limit to find a prefix that tokenises to exactly the
kept tokens: a character spans at most 4 byte tokens, and a BPE's re-merge of a cut word
reaches back a token or two; past this the passage is refused (422), never cut elsewhere."""


@dataclass(frozen=True, slots=True)
class Cut:
    """One passage cut to the limit: its text was ``tokens`` tokens, the first ``tokens_kept``
    are scored (its text's first ``chars_kept`` characters)."""

    index: int
    tokens: int
    tokens_kept: int
    chars_kept: int

    @property
    def tokens_cut(self) -> int:
        return self.tokens - self.tokens_kept


def fit_passages(
    tokenizer: PromptTokenizer,
    passages: Sequence[Passage],
    limit: int,
    *,
    truncate: bool,
    param: str = "passages",
    limit_name: str = "max_passage_tokens",
) -> tuple[list[Passage], list[Cut]]:
    """Hold every passage's text to ``limit`` tokens: refuse the first one over it, or, with
    ``truncate``, cut each one over it to a token prefix.

    Args:
        tokenizer: the scoring model's tokenizer (the one the prompts are built with).
        passages: the request's passages.
        limit: the most tokens a passage's text may have.
        truncate: cut (the request's ``truncate: "end"``) instead of refusing.
        param: the wire name of the passage list, for error messages.
        limit_name: the limit's wire or setting name, for the refusal's message.

    Returns:
        The passages to score (those over the limit replaced by their cut copies; id, title
        and score kept) and one ``Cut`` per passage cut, in passage order.

    Raises:
        LimitExceeded: without ``truncate``, the first passage over ``limit`` (its index, the
            limit and its tokens).
        InvalidRequest: with ``truncate``, a passage with no prefix of at most ``limit``
            tokens within ``MAX_BACKOFF`` tokens of it that tokenises to its own first tokens.
    """
    over = _over(tokenizer, passages, limit, first_only=not truncate)
    if not over:
        return list(passages), []
    if not truncate:
        head = over[0]
        raise LimitExceeded(
            f"{param}[{head.index}]",
            limit,
            head.tokens,
            what=f'tokens over {limit_name}; not truncated unless the request sets truncate "end"',
        )
    # The limit's own boundary first, for every long passage in one call (a fast tokenizer
    # encodes a batch on all cores); the rare miss then moves back one passage at a time.
    firsts = [passages[h.index].text[: h.ends[-1]] for h in over]
    fitted = list(passages)
    cuts: list[Cut] = []
    tried = tokenizer.encode_batch(firsts)
    for head, first, first_tokens in zip(over, firsts, tried, strict=True):
        text = passages[head.index].text
        cut = (limit, len(first)) if first_tokens.ids == head.ids else _cut(tokenizer, text, head)
        if cut is None or not text[: cut[1]].strip():
            raise InvalidRequest(
                f"{param}[{head.index}] ({head.tokens} tokens) cannot be cut to {limit_name} "
                f"({limit}): "
                + (
                    f"no prefix of its text of {max(limit - MAX_BACKOFF, 0) + 1} to {limit} "
                    "tokens tokenises to the text's own first tokens (the limit splits a "
                    "character)"
                    if cut is None
                    else f"its first {cut[0]} tokens are blank"
                )
                + "; raise the limit or send it shorter",
                param=f"{param}[{head.index}]",
            )
        kept, chars = cut
        fitted[head.index] = replace(passages[head.index], text=text[:chars])
        cuts.append(Cut(head.index, head.tokens, tokens_kept=kept, chars_kept=chars))
    return fitted, cuts


@dataclass(frozen=True, slots=True)
class _Head:
    """What a cut needs of a passage over the limit: its tokens, its first ``limit`` ids and
    where each of the last ``MAX_BACKOFF`` of those ends (``ends[-1]``: the ``limit``-th)."""

    index: int
    tokens: int
    ids: tuple[int, ...]
    ends: tuple[int, ...]


def _over(
    tokenizer: PromptTokenizer, passages: Sequence[Passage], limit: int, *, first_only: bool
) -> list[_Head]:
    """The passages over ``limit`` tokens (with ``first_only``, the first, if any), tokenised
    a chunk at a time and each chunk's encodings dropped at once: a request's passages may be
    a hundred of ``max_passage_chars``, and an encoding holds about 300 bytes a token."""
    heads: list[_Head] = []
    start = 0
    while start < len(passages):
        end, chars = start, 0
        while end < len(passages) and (end == start or chars < ENCODE_CHUNK_CHARS):
            chars += len(passages[end].text)
            end += 1
        texts = [p.text for p in passages[start:end]]
        for i, e in enumerate(tokenizer.encode_batch(texts), start):
            if len(e.ids) > limit:
                ends = tuple(b for _, b in e.offsets[max(limit - MAX_BACKOFF, 0) : limit])
                heads.append(_Head(i, len(e.ids), e.ids[:limit], ends))
                if first_only:
                    return heads
        start = end
    return heads


def _cut(tokenizer: PromptTokenizer, text: str, head: _Head) -> tuple[int, int] | None:
    """``(tokens kept, characters kept)`` of the longest prefix of ``text`` that ends at a
    token boundary before the limit's (``fit_passages`` tried that one), at most
    ``MAX_BACKOFF`` back, and whose own tokens are the text's first ones; ``None`` if none is."""
    limit = len(head.ids)
    for back in range(2, len(head.ends) + 1):
        kept = limit - back + 1
        # The end of the last kept token's characters: a character split over several byte
        # tokens ends every one of them, so a cut through it re-tokenises longer, and fails.
        chars = head.ends[-back]
        if tokenizer.encode(text[:chars]).ids == head.ids[:kept]:
            return kept, chars
    return None
