"""A tokenizer with one token per UTF-8 byte: the fake backend's tokenizer.

Part of the backend contract (like the fake itself): it needs no model files, is exact and
deterministic, and exercises the same span logic as a real tokenizer, multi-byte characters
included (a character of k bytes becomes k tokens that all carry that character's offsets, as
byte-level BPE tokenizers report them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from service.backends.base import ChatMessage, Encoding

BOS_ID: Final = 256
EOS_ID: Final = 257
END_OF_TURN_ID: Final = 258
SYSTEM_ID: Final = 259
USER_ID: Final = 260
ASSISTANT_ID: Final = 261

SPECIAL_TOKENS: Final[dict[str, int]] = {
    "<|bos|>": BOS_ID,
    "<|eos|>": EOS_ID,
    "<|end|>": END_OF_TURN_ID,
    "<|system|>": SYSTEM_ID,
    "<|user|>": USER_ID,
    "<|assistant|>": ASSISTANT_ID,
}
_SPECIAL_BY_ID: Final = {i: s for s, i in SPECIAL_TOKENS.items()}
_SPECIAL_RE: Final = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
_ROLE_TOKENS: Final = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


class ByteTokenizer:
    """``PromptTokenizer`` with ids 0-255 for bytes and 256-261 for special tokens.

    Chat template (deterministic, ChatML-like)::

        <|bos|><|user|>\\n{content}<|end|>\\n ... [<|assistant|>\\n]

    Special-token strings inside any text encode as their special ids (as with real
    tokenizers that parse added tokens); ``decode`` gives the same strings back, so
    ``decode(encode(t).ids) == t`` for every valid Unicode ``t``.
    """

    vocab_size: Final = 256 + len(SPECIAL_TOKENS)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID, END_OF_TURN_ID})

    @property
    def line_break_ids(self) -> frozenset[int]:
        """The newline byte: no other id's text contains one."""
        return frozenset({ord("\n")})

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """Render ``messages`` with the template above.

        Raises:
            ValueError: a role other than system, user or assistant.
        """
        parts = ["<|bos|>"]
        for message in messages:
            role = _ROLE_TOKENS.get(message.role)
            if role is None:
                raise ValueError(f"ByteTokenizer chat template has no role {message.role!r}")
            parts.append(f"{role}\n{message.content}<|end|>\n")
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def render_completion(self, text: str) -> str:
        """``<|bos|>`` then ``text``: a completion prompt, no chat turns."""
        return "<|bos|>" + text

    def encode(self, text: str) -> Encoding:
        """One id per UTF-8 byte, special-token strings as one id; offsets in characters.

        Raises:
            UnicodeEncodeError: ``text`` holds a lone surrogate (not valid Unicode).
        """
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        position = 0
        for match in _SPECIAL_RE.finditer(text):
            self._encode_plain(text, position, match.start(), ids, offsets)
            ids.append(SPECIAL_TOKENS[match.group()])
            offsets.append((match.start(), match.end()))
            position = match.end()
        self._encode_plain(text, position, len(text), ids, offsets)
        return Encoding(ids=tuple(ids), offsets=tuple(offsets))

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """``encode`` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of ``encode``; a cut multi-byte character decodes to U+FFFD.

        Raises:
            ValueError: an id outside the vocabulary.
        """
        out: list[str] = []
        pending = bytearray()
        for token in ids:
            if 0 <= token < 256:
                pending.append(token)
                continue
            special = _SPECIAL_BY_ID.get(token)
            if special is None:
                raise ValueError(f"token id {token} is outside the ByteTokenizer vocabulary")
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(special)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    @staticmethod
    def _encode_plain(
        text: str, start: int, end: int, ids: list[int], offsets: list[tuple[int, int]]
    ) -> None:
        segment = text[start:end]
        if segment.isascii():
            ids.extend(segment.encode("ascii"))
            offsets.extend((i, i + 1) for i in range(start, end))
            return
        for i, char in enumerate(segment, start):
            data = char.encode("utf-8")
            ids.extend(data)
            offsets.extend([(i, i + 1)] * len(data))
