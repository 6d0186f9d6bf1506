"""``PromptTokenizer`` over any Hugging Face tokenizer object, duck-typed.

Does not import transformers: the transformers backend passes an ``AutoTokenizer`` and the vLLM
backend passes vLLM's own tokenizer (a transformers tokenizer underneath), and both must give
byte-identical token ids for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from service.backends.base import ChatMessage, Encoding

# End-of-turn markers of common chat templates. One counts as an end-of-sequence id only when the
# model's chat template actually writes it and the vocabulary has it as a single token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: SmolLM2, Qwen
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3 tool calls
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<|endoftext|>",
    "</s>",
)


class HFTokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer that this adapter calls."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> object: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
    ) -> object: ...

    def __call__(
        self, text: str | list[str], *, return_offsets_mapping: bool, add_special_tokens: bool
    ) -> Mapping[str, object]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> object: ...

    def batch_decode(self, sequences: list[list[int]], *, skip_special_tokens: bool) -> object: ...

    def __len__(self) -> int: ...

    def convert_tokens_to_ids(self, tokens: str) -> object: ...

    def convert_ids_to_tokens(self, ids: int) -> object: ...


class HFPromptTokenizer:
    """Adapts a Hugging Face (fast) tokenizer to ``PromptTokenizer``.

    ``decode`` keeps special tokens, so ``decode(encode(t).ids) == t`` for template output;
    callers that want answer text drop ids in ``eos_token_ids`` first.
    """

    def __init__(self, tokenizer: HFTokenizerLike, *, extra_eos_token_ids: Iterable[int] = ()):
        """Wrap ``tokenizer``.

        Args:
            tokenizer: a Hugging Face tokenizer with a fast (Rust) backend; offsets need it.
            extra_eos_token_ids: more ids that end generation, e.g. the model's
                ``generation_config.eos_token_id``.
        """
        self._tok = tokenizer
        self._eos_ids = frozenset(_eos_ids(tokenizer) | {int(i) for i in extra_eos_token_ids})
        self._completion_prefix: str | None = None
        self._line_break_ids: frozenset[int] | None = None

    @property
    def hf_tokenizer(self) -> HFTokenizerLike:
        """The wrapped tokenizer object."""
        return self._tok

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's eos id plus the chat template's end-of-turn ids (if they differ)."""
        return self._eos_ids

    @property
    def line_break_ids(self) -> frozenset[int]:
        """Ids whose decoded text contains ``\\n``, found once by decoding the whole vocabulary
        (one batched call in Rust: 0.4 s for SmolLM2's 49k ids, 2.4 s for Gemma-3's 262k on
        this project's busy 2-core CPU; 129 and 32 ids). Decoding, not the token strings, because
        byte-level BPE writes a newline as ``Ċ`` and SentencePiece as ``\\n`` or ``<0x0A>``."""
        if self._line_break_ids is None:
            size = len(self._tok)
            texts = self._tok.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
            if not isinstance(texts, list) or len(texts) != size:
                raise TypeError("batch_decode did not return one text per id")
            self._line_break_ids = frozenset(
                i for i, text in enumerate(texts) if isinstance(text, str) and "\n" in text
            )
        return self._line_break_ids

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """Apply the model's chat template to ``messages`` and return the text.

        Args:
            messages: the conversation, in order.
            add_generation_prompt: append the header that opens the assistant's turn.

        Returns:
            The rendered prompt text (not tokenised).

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not self._tok.chat_template:
            raise ValueError("the model's tokenizer has no chat template")
        rendered = self._tok.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, not str")
        return rendered

    def render_completion(self, text: str) -> str:
        """What the tokenizer itself puts before plain text (Gemma: ``<bos>``), then ``text``.

        ``encode`` adds no special tokens but recognises them written in the text, so writing
        the prefix out keeps the prompt as the model was trained (a base Gemma degrades
        without its BOS). SmolLM2's tokenizer adds nothing, so its prompt is ``text`` alone.
        """
        if self._completion_prefix is None:
            plain = _ids(self._tok("a", return_offsets_mapping=False, add_special_tokens=False))
            full = _ids(self._tok("a", return_offsets_mapping=False, add_special_tokens=True))
            # The leading ids the tokenizer adds on its own (none, or a BOS).
            added = (
                full[: len(full) - len(plain)] if full[len(full) - len(plain) :] == plain else []
            )
            self._completion_prefix = "".join(
                str(self._tok.convert_ids_to_tokens(int(i))) for i in added
            )
        return self._completion_prefix + text

    def encode(self, text: str) -> Encoding:
        """Tokenise ``text`` as the model sees it: no special tokens added, with char offsets.

        Args:
            text: the full prompt text (special tokens written in the text are recognised).

        Returns:
            Token ids and the ``[start, end)`` character span of each token.

        Raises:
            ValueError: the tokenizer cannot report offsets (a slow, pure-Python tokenizer).
        """
        (encoding,) = self.encode_batch([text])
        return encoding

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """``encode`` of each text, in one tokenizer call: a fast tokenizer encodes a batch in
        parallel in Rust (``bench/prompts.py``: building 240 scoring prompts is 1.6-1.9x faster
        than with one call per prompt, on this project's 2-core CPU, identical prompts).

        Raises:
            ValueError: as ``encode``.
        """
        if not texts:
            return []
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            # The Rust tokenizer itself: the same ids and offsets as the call below without
            # transformers' per-encoding conversion in Python (16% of the service's CPU at GPU
            # speed went to tokenising, a third of it that wrapper; issue 57), and it lets the
            # event loop run beside it (bench/gil_release.py: 0.96x against 0.86x).
            done = backend.encode_batch(list(texts), add_special_tokens=False)
            if len(done) != len(texts):
                raise ValueError(f"{len(texts)} texts but {len(done)} encodings")
            return [Encoding(ids=tuple(e.ids), offsets=tuple(e.offsets)) for e in done]
        try:
            out = self._tok(list(texts), return_offsets_mapping=True, add_special_tokens=False)
        except NotImplementedError as exc:
            raise ValueError("offsets need a fast (Rust-backed) tokenizer") from exc
        all_ids = out.get("input_ids")
        all_offsets = out.get("offset_mapping")
        if not isinstance(all_ids, Sequence) or not isinstance(all_offsets, Sequence):
            raise ValueError("tokenizer returned no input_ids/offset_mapping")
        if len(all_ids) != len(texts) or len(all_offsets) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(all_ids)} encodings")
        encodings: list[Encoding] = []
        for ids, offsets in zip(all_ids, all_offsets, strict=True):
            if len(ids) != len(offsets):
                raise ValueError(f"{len(ids)} ids but {len(offsets)} offsets")
            # The Rust tokenizer hands back Python ints already; a per-element int() was
            # a fifth of prompt building.
            encodings.append(Encoding(ids=tuple(ids), offsets=tuple(map(tuple, offsets))))
        return encodings

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens kept.

        Args:
            ids: token ids.

        Returns:
            The decoded text.

        Raises:
            TypeError: the tokenizer returned something other than one string.
        """
        text = self._tok.decode(list(ids), skip_special_tokens=False)
        if not isinstance(text, str):
            raise TypeError(f"decode returned {type(text).__name__}, not str")
        return text


def _eos_ids(tok: HFTokenizerLike) -> set[int]:
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    template = tok.chat_template
    # Some tokenizers keep several named templates in a dict; any of them may end turns.
    texts = template.values() if isinstance(template, dict) else [template]
    joined = "\n".join(t for t in texts if isinstance(t, str))
    for token in END_OF_TURN_TOKENS:
        if token not in joined:
            continue
        token_id = tok.convert_tokens_to_ids(token)
        # Unknown tokens map to the unk id (or None); the round trip tells a real one apart.
        if isinstance(token_id, int) and tok.convert_ids_to_tokens(token_id) == token:
            ids.add(token_id)
    return ids


def _ids(encoded: Mapping[str, object]) -> list[int]:
    ids = encoded["input_ids"]
    if not isinstance(ids, list):
        raise TypeError(f"tokenizer returned input_ids of type {type(ids).__name__}, not list")
    return [int(i) for i in ids]
