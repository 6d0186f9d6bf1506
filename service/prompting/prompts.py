"""Prompt building: (query, passages, order) -> token ids plus the spans to score.

Prompts are built here and not in the backends, so every backend receives identical token ids
and their log-probs can be cross-checked on the same requests. The rendered chat is tokenised
ONCE with character offsets, and the query span is located by offsets: docs/method.md
requires the query's token ids to be identical in every permutation, which only holds when the
query starts and ends on token boundaries. Byte-level BPE merges a space into the next word
(" what"), so every template puts the query right after a newline and the chat template's
end-of-turn marker (a special token) right after it; the alignment is checked on every prompt
and a violation is an error, never a silent approximation.

A prompt's size is checked before it is rendered (issue 54): its characters against what the
model's context can hold at ``MAX_CHARS_PER_TOKEN`` characters a token at most, so a prompt that
can never fit is refused without building its text or its token ids. Many prompts are tokenised
a chunk at a time, each chunk's encodings (offsets and all, about 300 bytes a token) dropped as
soon as its prompts are built: what stays is their token ids (about 40 bytes a token), and with
``max_total_tokens`` tokenising stops at the chunk that crosses the request's token limit.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from service.backends.base import ChatMessage, Encoding, PromptTokenizer, SpanRequest
from service.errors import InvalidRequest, LimitExceeded, ServerError
from service.passage import Passage
from service.prompting.templates import PromptTemplate, get_template, template_names

__all__ = [
    "MAX_CHARS_PER_TOKEN",
    "ApiPrompt",
    "BuiltPrompt",
    "PromptAlignmentError",
    "PromptSize",
    "api_prompt",
    "build_generation_prompt",
    "build_prompt",
    "build_prompts",
    "prompt_size",
]


MAX_CHARS_PER_TOKEN = 32
"""Characters one token covers at most, for refusing a prompt before tokenising: one of more
than ``max_tokens x MAX_CHARS_PER_TOKEN`` characters certainly has more than ``max_tokens``
tokens. Gemma-3's longest token is 31 characters (runs of spaces); SmolLM2's vocabulary has a
few longer ones (up to 81: runs of spaces, ``#`` or ``=``), so a prompt made almost entirely
of those could be refused that would have fit; no prose, code or table comes near 32."""

# Characters of rendered prompts tokenised in one batch: large enough for a few prompts a
# call (a fast tokenizer encodes a batch on all cores), small enough that a chunk's encodings
# stay under about 60 MB (300 bytes a token while encoded, 0.2 tokens a character for prose,
# up to 3 for emoji: bench/request_memory.py).
_ENCODE_CHUNK_CHARS = 65_536


class PromptAlignmentError(ServerError):
    """The query is not token-aligned in a prompt, or its tokens differ between permutations.

    A server-side fault: it depends on the template and the tokenizer, and scoring such prompts
    would compare log-probs of different token sequences.
    """

    code = "prompt_misaligned"


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """One rendered and tokenised prompt.

    Spans are half-open token ranges ``[start, end)`` into ``token_ids``. ``query_span`` is
    exactly token-aligned with the (outer-whitespace-stripped) query. ``passage_spans[k]`` is
    the smallest token range covering the text of the passage in slot ``k`` (``order[k]``); it
    may include a separator character when the tokenizer merges it (only the optional ``joint``
    score uses it).
    """

    token_ids: tuple[int, ...]
    query_span: tuple[int, int]
    passage_spans: tuple[tuple[int, int], ...]
    order: tuple[int, ...]
    text: str
    template: str

    @property
    def query_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.query_span[0] : self.query_span[1]]

    def scored_span(self, *, joint: bool = False) -> tuple[int, int]:
        """Token range to request: the query, or from the first passage to the query (joint)."""
        start, end = self.query_span
        if joint and self.passage_spans:
            start = min(start, *(s for s, _ in self.passage_spans))
        return start, end

    def span_request(self, request_id: str, *, joint: bool = False) -> SpanRequest:
        """The backend request scoring this prompt.

        Tokens after the query are dropped: a causal model's log-probs of the query do not
        depend on them, so they would only cost prefill.

        Args:
            request_id: id echoed back by the backend.
            joint: also score the passages' own tokens (docs/method.md, ``joint``).

        Returns:
            A ``SpanRequest`` over ``scored_span(joint=joint)``.
        """
        start, end = self.scored_span(joint=joint)
        return SpanRequest(
            request_id=request_id, token_ids=self.token_ids[:end], span_start=start, span_end=end
        )

    def totals(self, logprobs: Sequence[float], *, joint: bool = False) -> tuple[float, float]:
        """Split a backend answer to ``span_request(joint=joint)`` into its two sums.

        Args:
            logprobs: the per-token log-probs of that request, in order.
            joint: the value used to build the request.

        Returns:
            ``(query log-prob, passages' log-prob)``; the second is 0.0 unless ``joint``.

        Raises:
            ValueError: ``logprobs`` has the wrong length for that span.
        """
        start, end = self.scored_span(joint=joint)
        if len(logprobs) != end - start:
            raise ValueError(f"expected {end - start} log-probs, got {len(logprobs)}")
        q0, q1 = self.query_span
        query = float(sum(logprobs[q0 - start : q1 - start]))
        passages = 0.0
        if joint:
            passages = float(
                sum(sum(logprobs[s - start : e - start]) for s, e in self.passage_spans)
            )
        return query, passages


def build_prompt(
    tokenizer: PromptTokenizer,
    template_name: str,
    query: str,
    passages: Sequence[Passage],
    order: Sequence[int],
    *,
    max_tokens: int | None = None,
) -> BuiltPrompt:
    """Build the scoring prompt showing ``passages[order[0]], passages[order[1]], ...``.

    The chat is rendered without a generation prompt: the scored query is the end of the user
    turn. The query is scored without its outer whitespace (it would otherwise merge with the
    template's separators); nothing is ever truncated.

    Args:
        tokenizer: the scoring model's tokenizer and chat template.
        template_name: a registered template name (``template_names()``).
        query: the question; any Unicode, not blank.
        passages: all passages of the request.
        order: passage indices in slot order; a subset (pruned prompt) is allowed, repeats not.
        max_tokens: if given, the most tokens the prompt may have.

    Returns:
        The prompt's token ids, query span and passage spans.

    Raises:
        InvalidRequest: unknown template, blank query or passage, text that is not valid
            Unicode, or a bad ``order``.
        LimitExceeded: the prompt is longer than ``max_tokens`` (``prompt_chars``: by its
            characters, found before rendering it; ``prompt_tokens``: after tokenising).
        PromptAlignmentError: the query is not token-aligned, or is the prompt's first token.
    """
    template = get_template(template_name)
    clean_query = _check_inputs(query, passages)
    with _unrepresentable_query(tokenizer, query):
        return _build(
            tokenizer,
            template,
            clean_query,
            passages,
            _check_order(order, len(passages)),
            add_generation_prompt=False,
            max_tokens=max_tokens,
        )


def build_prompts(
    tokenizer: PromptTokenizer,
    template_name: str,
    query: str,
    passages: Sequence[Passage],
    orders: Sequence[Sequence[int]],
    *,
    max_tokens: int | None = None,
    max_total_tokens: int | None = None,
) -> list[BuiltPrompt]:
    """Build one scoring prompt per order, checking the query tokens are the same in all.

    Args:
        tokenizer: the scoring model's tokenizer and chat template.
        template_name: a registered template name.
        query: the question.
        passages: all passages of the request.
        orders: one passage-index sequence per prompt (see ``build_prompt``).
        max_tokens: if given, the most tokens any prompt may have.
        max_total_tokens: if given, the most tokens the distinct prompts' span requests may
            have together (a request's ``max_prompt_tokens_x_prompts``): tokenising stops at
            the chunk that crosses it, instead of tokenising every prompt first.

    Returns:
        The prompts, in the order of ``orders``.

    Raises:
        InvalidRequest: as ``build_prompt``.
        LimitExceeded: a prompt is longer than ``max_tokens`` (by its characters, found
            before any prompt is rendered, or by its tokens), or the prompts are longer than
            ``max_total_tokens`` together.
        PromptAlignmentError: a query span is misaligned, or the query's token ids differ
            between two orders (the scores would not be comparable).
    """
    template = get_template(template_name)
    clean_query = _check_inputs(query, passages)
    checked: list[tuple[int, ...]] = []
    for i, order in enumerate(orders):
        try:
            checked.append(_check_order(order, len(passages)))
        except InvalidRequest as exc:
            raise InvalidRequest(f"orders[{i}]: {exc.message}", param="orders") from None
    if max_tokens is not None:
        size = _ContentSize(template, clean_query, passages)
        for order in checked:
            _check_chars(template, size(order), len(order), max_tokens)
    rendered = [
        _render(tokenizer, template, clean_query, passages, order, add_generation_prompt=False)
        for order in checked
    ]
    with _unrepresentable_query(tokenizer, query):
        return _tokenised(tokenizer, template, passages, rendered, max_tokens, max_total_tokens)


def _tokenised(
    tokenizer: PromptTokenizer,
    template: PromptTemplate,
    passages: Sequence[Passage],
    rendered: Sequence[_Rendered],
    max_tokens: int | None,
    max_total_tokens: int | None,
) -> list[BuiltPrompt]:
    """``build_prompts``' prompts from their rendered texts: assembled from segments where
    that gives the same prompts, else each tokenised whole, a chunk at a time."""
    assembled = _assembled(tokenizer, template, passages, rendered, max_tokens, max_total_tokens)
    if assembled is not None:
        return assembled
    built: list[BuiltPrompt] = []
    distinct: set[tuple[int, ...]] = set()
    total = 0
    start = 0
    while start < len(rendered):
        # A chunk at a time, its encodings dropped once its prompts are built (module
        # docstring); each chunk in one call: a fast tokenizer encodes a batch on all cores
        # (bench/prompts.py: 1.6-1.9x faster prompt building on 2 cores, identical prompts).
        end, chars = start, 0
        while end < len(rendered) and (end == start or chars < _ENCODE_CHUNK_CHARS):
            chars += len(rendered[end].text)
            end += 1
        encodings = tokenizer.encode_batch([r.text for r in rendered[start:end]])
        for i, (r, encoding) in enumerate(zip(rendered[start:end], encodings, strict=True)):
            prompt = _finish(tokenizer, template, r, encoding, max_tokens)
            if built and prompt.query_token_ids != built[0].query_token_ids:
                raise PromptAlignmentError(
                    f"template {template.name!r}: the query tokenises differently in "
                    f"orders[{start + i}] than in orders[0] ({len(prompt.query_token_ids)} vs "
                    f"{len(built[0].query_token_ids)} tokens)"
                )
            built.append(prompt)
            if max_total_tokens is not None and r.order not in distinct:
                # What the backend will be sent: each distinct prompt once, up to its query.
                distinct.add(r.order)
                total += prompt.query_span[1]
        del encodings
        if max_total_tokens is not None and total > max_total_tokens:
            raise LimitExceeded(
                "prompt_tokens_x_prompts",
                max_total_tokens,
                total,
                what=f"summed over the first {end} of {len(rendered)} prompts, where "
                "tokenising stopped; send fewer or shorter passages or fewer prompts",
            )
        start = end
    return built


def _assembled(
    tokenizer: PromptTokenizer,
    template: PromptTemplate,
    passages: Sequence[Passage],
    rendered: Sequence[_Rendered],
    max_tokens: int | None,
    max_total_tokens: int | None,
) -> list[BuiltPrompt] | None:
    """``build_prompts``' prompts from token segments, each passage tokenised once a request
    instead of once a prompt; ``None`` where that cannot be shown to give the same prompts,
    and the caller tokenises every prompt whole (which also raises its errors as always).

    A prompt's text is cut before the separator ahead of each document block, where each
    passage's text starts and before the separator ahead of the question: the pieces are the
    chat turns' start with the instruction, each block's separator and head (``Document [k]
    (Title: ...)``), each passage's text, and the question with the chat turns' end. A
    piece's token ids do not depend on the prompt it is in as long as no token crosses a cut,
    which a tokenizer's pre-tokenizer usually guarantees at a line break but a BPE without
    one (Gemma's) need not. That is checked, not assumed: whole prompts, in order, until every
    passage has been shown (so every kind of cut, and every passage's own cut, occurs in
    them) are tokenised whole and must equal their assembly, ids and spans; else ``None``.
    Every cut has template text on one side and, on the other, template text or the start of
    the passage whose cut it is, the same in every prompt (tests/service/test_prompts.py
    checks assemblies against whole prompts on the development questions with both packaged
    tokenizers).
    """
    if not rendered:
        return None
    pieces: list[list[str]] = []
    for r in rendered:
        # A separator goes with what follows it: byte-level BPE splits "\n\nDocument" into
        # "\n", "\n", "Document" but a text ending in "\n\n" into one "\n\n" token.
        sep = len(template.separator)
        cuts = [0]
        for slot, (start, _) in enumerate(r.passage_chars):
            head = template.render_document(slot, passages[r.order[slot]])[1]
            cuts += [start - head - (sep if slot or template.instruction else 0), start]
        before_question = sep if r.passage_chars or template.instruction else 0
        cuts += [r.query_chars[0] - len(template.question_prefix) - before_question, len(r.text)]
        if any(b < a for a, b in itertools.pairwise(cuts)):
            return None
        pieces.append([r.text[a:b] for a, b in itertools.pairwise(cuts)])
    distinct = list(dict.fromkeys(p for ps in pieces for p in ps if p))
    encodings = dict(zip(distinct, tokenizer.encode_batch(distinct), strict=True))
    # The query's span and check, once: the question piece is the same in every prompt.
    question = encodings.get(pieces[0][-1])
    if question is None:
        return None
    first = rendered[0]
    q_at = first.query_chars[0] - (len(first.text) - len(pieces[0][-1]))
    q_chars = (q_at, q_at + first.query_chars[1] - first.query_chars[0])
    q_span = _SpanLocator(question).covering(*q_chars)
    try:
        _check_aligned(
            tokenizer,
            question,
            pieces[0][-1],
            span=q_span,
            chars=q_chars,
            template_name=template.name,
        )
    except PromptAlignmentError:
        return None
    built: list[BuiltPrompt] = []
    for r, ps in zip(rendered, pieces, strict=True):
        if ps[-1] != pieces[0][-1]:
            return None
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, piece in enumerate(ps):
            if i % 2 == 0 and 0 < i < len(ps) - 1:  # a passage's text and its separator
                text_len = r.passage_chars[i // 2 - 1][1] - r.passage_chars[i // 2 - 1][0]
                lo, hi = _SpanLocator(encodings[piece]).covering(0, text_len)
                spans.append((len(ids) + lo, len(ids) + hi))
            if piece:
                ids += encodings[piece].ids
        if max_tokens is not None and len(ids) > max_tokens:
            return None
        at = len(ids) - len(question.ids)
        built.append(
            BuiltPrompt(
                token_ids=tuple(ids),
                query_span=(at + q_span[0], at + q_span[1]),
                passage_spans=tuple(spans),
                order=r.order,
                text=r.text,
                template=template.name,
            )
        )
    if max_total_tokens is not None:
        distinct_orders = {p.order: p.query_span[1] for p in built}
        if sum(distinct_orders.values()) > max_total_tokens:
            return None
    # The check: whole prompts that show every passage must equal their assembly.
    shown: set[int] = set()
    witnesses: list[int] = []
    for i, r in enumerate(rendered):
        if not set(r.order) <= shown or not witnesses:
            witnesses.append(i)
            shown |= set(r.order)
    whole = tokenizer.encode_batch([rendered[i].text for i in witnesses])
    for i, encoding in zip(witnesses, whole, strict=True):
        try:
            reference = _finish(tokenizer, template, rendered[i], encoding, max_tokens)
        except (LimitExceeded, PromptAlignmentError):
            return None
        if reference != built[i]:
            return None
    return built


def build_generation_prompt(
    tokenizer: PromptTokenizer,
    template_name: str,
    query: str,
    passages: Sequence[Passage],
    order: Sequence[int] | None = None,
    *,
    max_tokens: int | None = None,
) -> BuiltPrompt:
    """Build the prompt a generator answers from: same layout, assistant turn left open.

    Args:
        tokenizer: the generating model's tokenizer and chat template.
        template_name: a registered template name.
        query: the question.
        passages: the passages of the request (may be empty: closed-book).
        order: passage indices in slot order; default: all, in the given order.
        max_tokens: if given, the most tokens the prompt may have.

    Returns:
        The prompt; ``token_ids`` end with the chat template's generation prompt. The spans
        are filled as for a scoring prompt.

    Raises:
        InvalidRequest, LimitExceeded, PromptAlignmentError: as ``build_prompt``.
    """
    template = get_template(template_name)
    clean_query = _check_inputs(query, passages)
    chosen = range(len(passages)) if order is None else order
    with _unrepresentable_query(tokenizer, query):
        return _build(
            tokenizer,
            template,
            clean_query,
            passages,
            _check_order(chosen, len(passages)),
            add_generation_prompt=True,
            max_tokens=max_tokens,
        )


def _check_inputs(query: str, passages: Sequence[Passage]) -> str:
    _check_unicode(query, "query")
    clean = query.strip()
    if not clean:
        raise InvalidRequest("query is empty", param="query")
    for i, passage in enumerate(passages):
        _check_unicode(passage.text, f"passages[{i}].text")
        if passage.title is not None:
            _check_unicode(passage.title, f"passages[{i}].title")
        if not passage.text.strip():
            raise InvalidRequest(f"passages[{i}].text is empty", param=f"passages[{i}].text")
    return clean


@contextmanager
def _unrepresentable_query(tokenizer: PromptTokenizer, query: str) -> Iterator[None]:
    """Turn a misaligned query into a 422 where the query itself is the cause: a character
    the model's tokenizer cannot represent (issue 90). SmolLM2's byte-level vocabulary lacks
    the lead bytes of unassigned planes (U+82E9E is F2 82 BA 9E; it has no token for F2 and
    drops it), so the query's tokens decode to other text and no span can be aligned with
    it; the model would read a different question. Misalignment of a query the tokenizer
    reads back as sent stays a server fault (the template's)."""
    try:
        yield
    except PromptAlignmentError:
        refusal = _unrepresentable(tokenizer, query)
        if refusal is not None:
            raise refusal from None
        raise


def _unrepresentable(tokenizer: PromptTokenizer, query: str) -> InvalidRequest | None:
    """The 422 naming the first character of ``query`` that the tokenizer does not read back
    (by code point, as sent), or ``None`` where the query reads back whole. Only on the
    error path: one tokenizer call for the query, one for its distinct non-ASCII characters."""
    clean = query.strip()
    if tokenizer.decode(tokenizer.encode(clean).ids) == clean:
        return None
    chars = list(dict.fromkeys(c for c in query if not c.isascii() and not c.isspace()))
    encoded = tokenizer.encode_batch(chars)
    read = {c: tokenizer.decode(e.ids) for c, e in zip(chars, encoded, strict=True)}
    for i, c in enumerate(query):
        back = read.get(c)
        if back is not None and back != c and back.strip() != c:
            return InvalidRequest(
                f"query[{i}] is U+{ord(c):04X}, a character the model's tokenizer cannot "
                f"represent (it reads it as {back!r}), so the question the model would score "
                "is not the one sent; remove or replace it",
                param="query",
            )
    return InvalidRequest(
        "the query is not read back as sent by the model's tokenizer (it reads "
        f"{len(clean)} characters as {tokenizer.decode(tokenizer.encode(clean).ids)!r}), so "
        "the question the model would score is not the one sent",
        param="query",
    )


def _check_unicode(text: str, param: str) -> None:
    # Lone surrogates (possible from JSON "\ud800") have no UTF-8 form: no tokenizer takes them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{param} is not valid Unicode text", param=param) from None


def _check_order(order: Sequence[int], n_passages: int) -> tuple[int, ...]:
    checked = tuple(int(i) for i in order)
    for i in checked:
        if not 0 <= i < n_passages:
            raise InvalidRequest(
                f"passage index {i} is out of range for {n_passages} passages", param="order"
            )
    if len(set(checked)) != len(checked):
        raise InvalidRequest(f"order {list(checked)} repeats a passage", param="order")
    return checked


@dataclass(frozen=True, slots=True)
class _Rendered:
    """A prompt's text before tokenising, with where the query and each passage sit in it."""

    text: str
    order: tuple[int, ...]
    query_chars: tuple[int, int]
    passage_chars: tuple[tuple[int, int], ...]


def _build(
    tokenizer: PromptTokenizer,
    template: PromptTemplate,
    query: str,
    passages: Sequence[Passage],
    order: tuple[int, ...],
    *,
    add_generation_prompt: bool,
    max_tokens: int | None,
) -> BuiltPrompt:
    if max_tokens is not None:
        size = _ContentSize(template, query, passages)
        _check_chars(template, size(order), len(order), max_tokens)
    rendered = _render(tokenizer, template, query, passages, order, add_generation_prompt)
    encoding = tokenizer.encode(rendered.text)
    return _finish(tokenizer, template, rendered, encoding, max_tokens)


class _ContentSize:
    """Characters of the user message ``_user_content`` would build for an order, computed
    without building it (a document block's head and tail are formatted once per slot and
    passage, the passages' texts only measured)."""

    def __init__(self, template: PromptTemplate, query: str, passages: Sequence[Passage]):
        self._template = template
        self._passages = passages
        self._fixed = len(template.question_prefix) + len(query)
        if template.instruction:
            self._fixed += len(template.instruction) + len(template.separator)
        self._blocks: dict[tuple[int, int], int] = {}

    def __call__(self, order: Sequence[int]) -> int:
        template = self._template
        total = self._fixed + len(template.separator) * len(order)
        for slot, index in enumerate(order):
            block = self._blocks.get((slot, index))
            if block is None:
                passage = self._passages[index]
                fmt = template.document if passage.title else template.untitled_document
                head, tail = fmt.split("{text}")
                title = passage.title or ""
                block = (
                    len(head.format(index=slot + 1, title=title))
                    + len(passage.text)
                    + len(tail.format(index=slot + 1, title=title))
                )
                self._blocks[slot, index] = block
            total += block
        return total


def _check_chars(template: PromptTemplate, chars: int, n_passages: int, max_tokens: int) -> None:
    """``LimitExceeded`` for a prompt whose ``chars`` certainly make more than ``max_tokens``
    tokens (``MAX_CHARS_PER_TOKEN``), before it is rendered."""
    limit = max_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise LimitExceeded(
            "prompt_chars",
            limit,
            chars,
            what=f"{n_passages} passages with template {template.name!r}: more than "
            f"{max_tokens} tokens at {MAX_CHARS_PER_TOKEN} characters a token at most; send "
            "fewer or shorter passages",
        )


def _user_content(
    template: PromptTemplate, query: str, passages: Sequence[Passage], order: Sequence[int]
) -> tuple[str, list[tuple[int, int]], int]:
    """The user message, where each passage's text sits in it, and where the query starts."""
    parts: list[str] = []
    length = 0
    passage_chars: list[tuple[int, int]] = []

    def add(part: str) -> int:
        nonlocal length
        start = length
        parts.append(part)
        length += len(part)
        return start

    if template.instruction:
        add(template.instruction)
        add(template.separator)
    for slot, index in enumerate(order):
        block, text_offset = template.render_document(slot, passages[index])
        start = add(block) + text_offset
        passage_chars.append((start, start + len(passages[index].text)))
        add(template.separator)
    query_start = add(template.question_prefix) + len(template.question_prefix)
    add(query)
    return "".join(parts), passage_chars, query_start


@dataclass(frozen=True, slots=True)
class ApiPrompt:
    """A prompt for a generator behind an API that applies its own chat template: the chat
    messages (a chat template) or the completion text (a ``completion`` template)."""

    messages: tuple[ChatMessage, ...] | None
    text: str | None


def api_prompt(
    template: PromptTemplate, query: str, passages: Sequence[Passage], order: Sequence[int]
) -> ApiPrompt:
    """``template``'s prompt for ``passages`` in ``order`` as an API takes it: the same user
    message ``build_prompt`` renders inside the model's chat template, without that template
    (the server applies its own), or a completion template's text with its answer prefix."""
    content, _, _ = _user_content(template, query, passages, order)
    if template.completion:
        return ApiPrompt(messages=None, text=content + template.answer_prefix)
    messages = [ChatMessage(role="user", content=content)]
    if template.system is not None:
        messages.insert(0, ChatMessage(role="system", content=template.system))
    return ApiPrompt(messages=tuple(messages), text=None)


def _render(
    tokenizer: PromptTokenizer,
    template: PromptTemplate,
    query: str,
    passages: Sequence[Passage],
    order: tuple[int, ...],
    add_generation_prompt: bool,
) -> _Rendered:
    content, passage_chars, query_start = _user_content(template, query, passages, order)

    if template.completion:
        suffix = template.answer_prefix if add_generation_prompt else ""
        text = tokenizer.render_completion(content + suffix)
    else:
        messages = [ChatMessage(role="user", content=content)]
        if template.system is not None:
            messages.insert(0, ChatMessage(role="system", content=template.system))
        try:
            text = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            # A base model (no chat template) with a chat layout: the request can name a
            # completion template, so say which.
            completion = [n for n in template_names() if get_template(n).completion]
            raise InvalidRequest(
                f"template {template.name!r} renders inside the model's chat template, which "
                f"this model does not have ({exc}); use a completion template: "
                f"{', '.join(completion)}",
                param="template",
            ) from None
    base = text.find(content)
    if base < 0 or text.find(content, base + 1) >= 0:
        raise PromptAlignmentError(
            f"template {template.name!r}: the chat template does not reproduce the user "
            "message verbatim exactly once, so the query cannot be located"
        )
    return _Rendered(
        text=text,
        order=order,
        query_chars=(base + query_start, base + query_start + len(query)),
        passage_chars=tuple((base + s, base + e) for s, e in passage_chars),
    )


def _finish(
    tokenizer: PromptTokenizer,
    template: PromptTemplate,
    rendered: _Rendered,
    encoding: Encoding,
    max_tokens: int | None,
) -> BuiltPrompt:
    """Check the tokenised prompt (length, query alignment) and locate its spans."""
    if max_tokens is not None and len(encoding.ids) > max_tokens:
        raise LimitExceeded(
            "prompt_tokens",
            max_tokens,
            len(encoding.ids),
            what=f"{len(rendered.order)} passages with template {template.name!r}",
        )
    locator = _SpanLocator(encoding)
    query_span = locator.covering(*rendered.query_chars)
    _check_aligned(
        tokenizer,
        encoding,
        rendered.text,
        span=query_span,
        chars=rendered.query_chars,
        template_name=template.name,
    )
    return BuiltPrompt(
        token_ids=encoding.ids,
        query_span=query_span,
        passage_spans=tuple(locator.covering(s, e) for s, e in rendered.passage_chars),
        order=rendered.order,
        text=rendered.text,
        template=template.name,
    )


def _check_aligned(
    tokenizer: PromptTokenizer,
    encoding: Encoding,
    text: str,
    *,
    span: tuple[int, int],
    chars: tuple[int, int],
    template_name: str,
) -> None:
    start, end = span
    first = encoding.offsets[start] if start < end else None
    last = encoding.offsets[end - 1] if start < end else None
    if first is None or last is None or first[0] != chars[0] or last[1] != chars[1]:
        got = (first[0] if first else None, last[1] if last else None)
        raise PromptAlignmentError(
            f"template {template_name!r}: the query is not token-aligned (query characters "
            f"{chars}, its tokens cover {got}); a token merges the query with its surroundings"
        )
    if start == 0:
        raise PromptAlignmentError(
            f"template {template_name!r}: the query is the first token of the prompt, "
            "which has no log-prob"
        )
    # Offsets can hide a merged separator (a tokenizer that trims offsets); decoding cannot.
    decoded = tokenizer.decode(encoding.ids[start:end])
    if decoded != text[chars[0] : chars[1]]:
        raise PromptAlignmentError(
            f"template {template_name!r}: the query's tokens decode to a different text "
            f"({len(decoded)} vs {chars[1] - chars[0]} characters); the span is not aligned"
        )


class _SpanLocator:
    """Maps character ranges to the smallest covering token range of one encoding."""

    def __init__(self, encoding: Encoding) -> None:
        self._offsets = encoding.offsets

    def covering(self, start: int, end: int) -> tuple[int, int]:
        """Token range ``[i, j)`` of the non-empty tokens overlapping chars ``[start, end)``."""
        offsets = self._offsets
        # Tokenizers report non-decreasing offsets, so bisect finds the range in O(log T); the
        # neighbours are checked, and a tokenizer that breaks the order gets the linear scan.
        i = bisect.bisect_right(offsets, start, key=lambda o: o[1])
        j = bisect.bisect_left(offsets, end, key=lambda o: o[0])
        while i < j and offsets[i][0] == offsets[i][1]:
            i += 1
        inner_ok = i >= j or (offsets[i][1] > start and offsets[j - 1][0] < end)
        outer_ok = (i == 0 or offsets[i - 1][1] <= start) and (
            j == len(offsets) or offsets[j][0] >= end
        )
        if inner_ok and outer_ok:
            return (i, j) if i < j else (i, i)
        hits = [k for k, (s, e) in enumerate(offsets) if s < e and s < end and e > start]
        return (hits[0], hits[-1] + 1) if hits else (0, 0)


@dataclass(frozen=True)
class PromptSize:
    """What a request's prompts cost in tokens, before any prompt is built: admission
    estimates the whole request from it (issue 62)."""

    fixed: int
    """Tokens of a prompt with no passage: chat turns, instruction, question."""
    passages: tuple[int, ...]
    """Tokens each passage's document block (header, title, text, separator) adds."""

    def tokens(self, k: int) -> int:
        """Tokens of a prompt of ``k`` passages: all of them when ``k`` is their number, else
        ``k`` of average length (designs and shuffles use every passage about equally)."""
        n = len(self.passages)
        if n == 0 or k <= 0:
            return self.fixed
        if k == n:
            return self.fixed + sum(self.passages)
        return self.fixed + math.ceil(k * sum(self.passages) / n)


def prompt_size(
    tokenizer: PromptTokenizer,
    template_name: str,
    query: str,
    passages: Sequence[Passage],
    *,
    generation: bool = False,
) -> PromptSize:
    """Tokens of the request's prompt without passages, and of each passage's block.

    One prompt rendered and each block tokenised once (a block in slot 1; the slot number
    changes a token or two): far less than building the prompts, and the same tokenizer.
    ``generation``: the prompt ends in the assistant turn (``build_generation_prompt``), whose
    header (or a completion template's answer prefix) adds a few tokens.

    Raises:
        InvalidRequest: as ``build_prompt`` (an empty query, a chat layout on a base model).
    """
    template = get_template(template_name)
    clean_query = _check_inputs(query, passages)
    rendered = _render(tokenizer, template, clean_query, passages, (), generation)
    blocks = [template.render_document(0, p)[0] + template.separator for p in passages]
    encoded = tokenizer.encode_batch([rendered.text, *blocks])
    return PromptSize(fixed=len(encoded[0].ids), passages=tuple(len(e.ids) for e in encoded[1:]))
