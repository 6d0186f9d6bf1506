"""Prompt building: token-aligned query spans, identical across permutations, clear errors."""

from __future__ import annotations

import itertools
import json
import random
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backends.base import ChatMessage, Encoding, PromptTokenizer
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.config.settings import DEFAULT_TEMPLATE
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage
from service.prompting.prompts import (
    MAX_CHARS_PER_TOKEN,
    BuiltPrompt,
    PromptAlignmentError,
    build_generation_prompt,
    build_prompt,
    build_prompts,
)
from service.prompting.templates import (
    PromptTemplate,
    get_template,
    register_template,
    template_names,
)

NQ_DEV = Path("/work/shared/data/nq_open_dev.jsonl")

PASSAGES = [
    Passage("Paris is the capital of France.", title="Paris", id="p0"),
    Passage("Berlin is the capital of Germany.", title=None, id="p1"),
    Passage("Das Brandenburger Tor steht in Berlin — 1791 erbaut, 日本語も.", title="Tor", id="p2"),
    Passage("Cats sleep a lot.", title="Cat", id="p3"),
]
QUERY = "what is the capital of france"


def check_prompt(
    tokenizer: PromptTokenizer, prompt_passages: Sequence[Passage], query: str, prompt: object
) -> None:
    """Shared checks: aligned query span, passage spans decode to the passages in slot order."""
    from service.prompting.prompts import BuiltPrompt

    assert isinstance(prompt, BuiltPrompt)
    start, end = prompt.query_span
    assert 1 <= start < end <= len(prompt.token_ids)
    assert tokenizer.decode(prompt.query_token_ids) == query.strip()
    assert len(prompt.passage_spans) == len(prompt.order)
    for (s, e), index in zip(prompt.passage_spans, prompt.order, strict=True):
        assert tokenizer.decode(prompt.token_ids[s:e]) == prompt_passages[index].text
    assert tokenizer.encode(prompt.text).ids == prompt.token_ids


# --- templates -------------------------------------------------------------------------------


def test_registry_has_the_named_templates() -> None:
    names = template_names()
    assert {"qa_default", "qa_plain", "qa_system"} <= set(names)
    assert DEFAULT_TEMPLATE == "qa_default"
    assert get_template("qa_default").name == "qa_default"


def test_unknown_template_is_a_client_error_naming_the_known_ones() -> None:
    with pytest.raises(InvalidRequest) as info:
        build_prompt(ByteTokenizer(), "nope", QUERY, PASSAGES, [0])
    assert info.value.param == "template"
    assert "qa_default" in info.value.message


def test_register_template_refuses_duplicates_unless_replacing() -> None:
    template = PromptTemplate(
        name="test_custom",
        instruction="Answer.",
        document="[{index}] {title}: {text}",
        untitled_document="[{index}] {text}",
    )
    register_template(template, replace=True)
    with pytest.raises(ValueError, match="already registered"):
        register_template(template)
    register_template(template, replace=True)
    assert get_template("test_custom") is template


@pytest.mark.parametrize(
    ("document", "untitled"),
    [
        ("Document {index}", "{text}"),  # no {text}
        ("{text} {text}", "{text}"),  # two {text}
        ("{oops} {text}", "{text}"),  # unknown placeholder
        ("{text}", "{title} {text}"),  # untitled with a title
    ],
)
def test_bad_template_definitions_fail_at_construction(document: str, untitled: str) -> None:
    with pytest.raises(ValueError):
        PromptTemplate(name="bad", instruction="", document=document, untitled_document=untitled)


def test_qa_default_renders_titles_and_qa_plain_does_not() -> None:
    tok = ByteTokenizer()
    default = build_prompt(tok, "qa_default", QUERY, PASSAGES, [0, 1])
    plain = build_prompt(tok, "qa_plain", QUERY, PASSAGES, [0, 1])
    assert "Document [1] (Title: Paris)\nParis is the capital" in default.text
    assert "Document [2]\nBerlin is" in default.text  # untitled passage: no title line
    assert "Title:" not in plain.text
    assert "Document [1]\nParis is the capital" in plain.text
    assert default.text.startswith("<|bos|><|user|>\nAnswer the question based on the documents")
    assert default.text.endswith(f"Question:\n{QUERY}<|end|>\n")


def test_qa_system_puts_the_instruction_in_a_system_message() -> None:
    prompt = build_prompt(ByteTokenizer(), "qa_system", QUERY, PASSAGES, [1, 0])
    assert prompt.text.startswith("<|bos|><|system|>\nAnswer the question")
    check_prompt(ByteTokenizer(), PASSAGES, QUERY, prompt)


# --- spans -----------------------------------------------------------------------------------


def test_qa_completion_is_plain_text_after_bos_for_base_models() -> None:
    tok = ByteTokenizer()
    score = build_prompt(tok, "qa_completion", QUERY, PASSAGES, [0, 1])
    assert score.text == (
        "<|bos|>Answer the question based on the documents below. Some documents may be "
        "irrelevant. Reply with a short answer only.\n\n"
        "Document [1] (Title: Paris)\nParis is the capital of France.\n\n"
        "Document [2]\nBerlin is the capital of Germany.\n\n"
        f"Question:\n{QUERY}"
    )
    check_prompt(tok, PASSAGES, QUERY, score)
    answer = build_generation_prompt(tok, "qa_completion", QUERY, PASSAGES, [1, 0])
    assert answer.text.endswith(f"Question:\n{QUERY}\nAnswer:\n")
    assert "<|user|>" not in answer.text and "<|assistant|>" not in answer.text
    check_prompt(tok, PASSAGES, QUERY, answer)


def test_chat_layout_on_a_model_without_chat_template_names_the_completion_template() -> None:
    class NoChat(ByteTokenizer):
        def render_chat(
            self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool
        ) -> str:
            raise ValueError("the model's tokenizer has no chat template")

    with pytest.raises(InvalidRequest, match="use a completion template: qa_completion") as info:
        build_prompt(NoChat(), "qa_default", QUERY, PASSAGES, [0])
    assert info.value.param == "template"
    assert build_prompt(NoChat(), "qa_completion", QUERY, PASSAGES, [0]).text.startswith("<|bos|>")


def test_completion_template_cannot_have_a_system_turn() -> None:
    with pytest.raises(ValueError, match="no system turn"):
        PromptTemplate(
            name="x",
            instruction="i",
            document="{text}",
            untitled_document="{text}",
            system="s",
            completion=True,
        )


@pytest.mark.parametrize("template", ["qa_default", "qa_plain", "qa_system", "qa_completion"])
def test_query_span_is_aligned_and_identical_across_all_permutations(template: str) -> None:
    tok = ByteTokenizer()
    orders = list(itertools.permutations(range(len(PASSAGES))))
    prompts = build_prompts(tok, template, QUERY, PASSAGES, orders)
    assert len(prompts) == 24
    for prompt, order in zip(prompts, orders, strict=True):
        assert prompt.order == order
        assert prompt.template == template
        check_prompt(tok, PASSAGES, QUERY, prompt)
    assert len({p.query_token_ids for p in prompts}) == 1
    # Full permutations of the same passages have the same length, so the same query span.
    assert len({p.query_span for p in prompts}) == 1


def test_pruned_orders_keep_the_query_tokens() -> None:
    tok = ByteTokenizer()
    orders = [[3], [2, 0], [0, 1, 2, 3], []]
    prompts = build_prompts(tok, "qa_default", QUERY, PASSAGES, orders)
    assert len({p.query_token_ids for p in prompts}) == 1
    for prompt in prompts:
        check_prompt(tok, PASSAGES, QUERY, prompt)
    assert prompts[-1].passage_spans == ()


def test_query_outer_whitespace_is_stripped_not_truncated() -> None:
    tok = ByteTokenizer()
    prompt = build_prompt(tok, "qa_default", "  \n what is it?\t ", PASSAGES, [0])
    assert tok.decode(prompt.query_token_ids) == "what is it?"
    assert prompt.text.endswith("Question:\nwhat is it?<|end|>\n")


def test_multibyte_characters_give_one_token_per_byte_and_aligned_spans() -> None:
    tok = ByteTokenizer()
    query = "¿Qué es 日本語? 🙂"
    prompt = build_prompt(tok, "qa_default", query, PASSAGES, [2, 0])
    assert len(prompt.query_token_ids) == len(query.encode("utf-8"))
    check_prompt(tok, PASSAGES, query, prompt)


_TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40).filter(
    lambda t: bool(t.strip())
)


@settings(max_examples=60, deadline=None)
@given(
    query=_TEXT,
    texts=st.lists(_TEXT, min_size=1, max_size=5),
    titles=st.lists(st.one_of(st.none(), _TEXT), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_any_unicode_query_and_passages_are_aligned(
    query: str, texts: list[str], titles: list[str | None], seed: int
) -> None:
    tok = ByteTokenizer()
    passages = [Passage(t, title=titles[i]) for i, t in enumerate(texts)]
    rng = random.Random(seed)
    orders = [rng.sample(range(len(texts)), len(texts)) for _ in range(3)]
    prompts = build_prompts(tok, "qa_default", query, passages, orders)
    assert len({p.query_token_ids for p in prompts}) == 1
    for prompt in prompts:
        start, end = prompt.query_span
        assert start >= 1
        assert tok.decode(prompt.token_ids[start:end]) == query.strip()
        for (s, e), index in zip(prompt.passage_spans, prompt.order, strict=True):
            assert tok.decode(prompt.token_ids[s:e]) == passages[index].text


# --- requests and joint scoring --------------------------------------------------------------


def test_span_request_scores_the_query_and_drops_later_tokens() -> None:
    prompt = build_prompt(ByteTokenizer(), "qa_default", QUERY, PASSAGES, [1, 3])
    request = prompt.span_request("r1")
    start, end = prompt.query_span
    assert (request.span_start, request.span_end) == (start, end)
    assert request.token_ids == prompt.token_ids[:end]
    assert request.request_id == "r1"


def test_joint_span_starts_at_the_first_passage_and_totals_split_it() -> None:
    prompt = build_prompt(ByteTokenizer(), "qa_default", QUERY, PASSAGES, [1, 3])
    request = prompt.span_request("j", joint=True)
    assert request.span_start == prompt.passage_spans[0][0]
    assert request.span_end == prompt.query_span[1]
    # Mark each token with -1 if in a passage, -10 if in the query, -100 elsewhere.
    values = []
    for k in range(request.span_start, request.span_end):
        if any(s <= k < e for s, e in prompt.passage_spans):
            values.append(-1.0)
        elif prompt.query_span[0] <= k:
            values.append(-10.0)
        else:
            values.append(-100.0)
    query_total, passage_total = prompt.totals(values, joint=True)
    assert query_total == -10.0 * len(QUERY)
    assert passage_total == -1.0 * sum(e - s for s, e in prompt.passage_spans)
    assert prompt.totals([-0.5] * len(QUERY)) == (-0.5 * len(QUERY), 0.0)
    with pytest.raises(ValueError, match="expected"):
        prompt.totals([-1.0])


def test_generation_prompt_opens_the_assistant_turn() -> None:
    tok = ByteTokenizer()
    prompt = build_generation_prompt(tok, "qa_default", QUERY, PASSAGES)
    assert prompt.text.endswith("<|end|>\n<|assistant|>\n")
    assert prompt.order == (0, 1, 2, 3)
    check_prompt(tok, PASSAGES, QUERY, prompt)
    single = build_generation_prompt(tok, "qa_plain", QUERY, PASSAGES, [2])
    assert single.order == (2,)
    closed_book = build_generation_prompt(tok, "qa_default", QUERY, [])
    assert "Document" not in closed_book.text


# --- input errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "passages", "order", "param"),
    [
        ("  \t", PASSAGES, [0], "query"),
        (QUERY, [Passage("   ")], [0], "passages[0].text"),
        ("bad \ud800 surrogate", PASSAGES, [0], "query"),
        (QUERY, [Passage("ok", title="\udfff")], [0], "passages[0].title"),
        (QUERY, PASSAGES, [0, 4], "order"),
        (QUERY, PASSAGES, [-1], "order"),
        (QUERY, PASSAGES, [1, 2, 1], "order"),
    ],
)
def test_bad_inputs_are_client_errors(
    query: str, passages: list[Passage], order: list[int], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        build_prompt(ByteTokenizer(), "qa_default", query, passages, order)
    assert info.value.param == param


def test_bad_order_in_a_batch_names_its_index() -> None:
    with pytest.raises(InvalidRequest, match=r"orders\[1\]") as info:
        build_prompts(ByteTokenizer(), "qa_default", QUERY, PASSAGES, [[0, 1], [2, 2]])
    assert info.value.param == "orders"


def test_prompt_over_max_tokens_is_refused_not_truncated() -> None:
    tok = ByteTokenizer()
    full = build_prompt(tok, "qa_default", QUERY, PASSAGES, [0, 1, 2, 3])
    assert build_prompt(
        tok, "qa_default", QUERY, PASSAGES, [0, 1, 2, 3], max_tokens=len(full.token_ids)
    )
    with pytest.raises(LimitExceeded) as info:
        build_prompts(
            tok,
            "qa_default",
            QUERY,
            PASSAGES,
            [[0], [0, 1, 2, 3]],
            max_tokens=len(full.token_ids) - 1,
        )
    assert info.value.value == len(full.token_ids)


class SpyTokenizer(ByteTokenizer):
    """Counts the prompts rendered, the texts tokenised and the sizes of the batches."""

    def __init__(self) -> None:
        self.rendered = 0
        self.encoded = 0
        self.batches: list[int] = []

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        self.rendered += 1
        return super().render_chat(messages, add_generation_prompt=add_generation_prompt)

    def render_completion(self, text: str) -> str:
        self.rendered += 1
        return super().render_completion(text)

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        self.batches.append(len(texts))
        return super().encode_batch(texts)

    def encode(self, text: str) -> Encoding:
        self.encoded += 1
        return super().encode(text)


@pytest.mark.parametrize("builder", ["build_prompts", "build_prompt", "build_generation_prompt"])
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_is_rendered(
    builder: str,
) -> None:
    # Issue 54: a prompt of 100 passages of 32,768 characters (3.3 M characters) was rendered
    # and tokenised, 512 times over (20 GB here), before its length was checked against a
    # context of 8,192 tokens. The same at a small scale: 10 passages of 1,000 characters
    # against a context of 256 tokens (8,192 characters at most).
    tok = SpyTokenizer()
    passages = [Passage("word " * 200) for _ in range(10)]
    order = list(range(10))
    with pytest.raises(LimitExceeded) as refused:
        if builder == "build_prompts":
            build_prompts(tok, "qa_default", QUERY, passages, [order] * 64, max_tokens=256)
        elif builder == "build_prompt":
            build_prompt(tok, "qa_default", QUERY, passages, order, max_tokens=256)
        else:
            build_generation_prompt(tok, "qa_default", QUERY, passages, order, max_tokens=256)
    assert refused.value.param == "prompt_chars"
    assert refused.value.limit == 256 * MAX_CHARS_PER_TOKEN
    assert refused.value.value > 10 * 1000
    assert tok.rendered == 0 and tok.encoded == 0


@pytest.mark.parametrize("template", ["qa_default", "qa_plain", "qa_system", "qa_completion"])
def test_the_characters_checked_before_rendering_are_the_user_message_s(template: str) -> None:
    from service.prompting.prompts import _ContentSize, _user_content

    passages = [*PASSAGES, Passage("x" * 40, title="A title")]
    size = _ContentSize(get_template(template), QUERY, passages)
    for order in ([0, 1, 2, 3, 4], [4, 2], [], list(range(5))[::-1]):
        content, _, _ = _user_content(get_template(template), QUERY, passages, order)
        assert size(order) == len(content)
    # A prompt exactly at the bound is built (and then checked by its tokens).
    prompt = build_prompt(ByteTokenizer(), template, QUERY, passages, [4, 2])
    content, _, _ = _user_content(get_template(template), QUERY, passages, [4, 2])
    fits = -(-len(content) // MAX_CHARS_PER_TOKEN)
    with pytest.raises(LimitExceeded) as refused:
        build_prompt(ByteTokenizer(), template, QUERY, passages, [4, 2], max_tokens=fits)
    assert refused.value.param == "prompt_tokens"  # past the character check
    assert len(prompt.token_ids) > fits


def test_many_prompts_are_tokenised_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 54: one batch of all prompts held every prompt's encoding (offsets and all) at
    # once; a chunk at a time, only one chunk's are alive, and the prompts are the same.
    # The whole-prompt path: what runs where assembling prompts from segments is not shown to
    # give the same prompts (and on a request over its token budget).
    monkeypatch.setattr("service.prompting.prompts._assembled", lambda *args: None)
    orders = [list(p) for p in itertools.permutations(range(4))]
    whole = build_prompts(ByteTokenizer(), "qa_default", QUERY, PASSAGES, orders)
    tok = SpyTokenizer()
    one = len(whole[0].text)
    monkeypatch.setattr("service.prompting.prompts._ENCODE_CHUNK_CHARS", 5 * one)
    chunked = build_prompts(tok, "qa_default", QUERY, PASSAGES, orders)
    assert chunked == whole
    assert tok.batches == [5, 5, 5, 5, 4]


def test_tokenising_stops_at_the_chunk_that_crosses_the_requests_token_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    orders = [list(p) for p in itertools.permutations(range(4))]
    whole = build_prompts(ByteTokenizer(), "qa_default", QUERY, PASSAGES, orders)
    sent = [p.query_span[1] for p in whole]  # each order is distinct: all are sent
    monkeypatch.setattr("service.prompting.prompts._ENCODE_CHUNK_CHARS", 4 * len(whole[0].text))
    assert build_prompts(
        ByteTokenizer(), "qa_default", QUERY, PASSAGES, orders, max_total_tokens=sum(sent)
    )
    tok = SpyTokenizer()
    with pytest.raises(LimitExceeded) as refused:
        build_prompts(tok, "qa_default", QUERY, PASSAGES, orders, max_total_tokens=sum(sent[:9]))
    assert refused.value.param == "prompt_tokens_x_prompts"
    assert refused.value.value == sum(sent[:12])  # the third chunk of 4 crossed it
    # The segments first (each passage once: a request's size, not its prompts'), then the
    # whole prompts a chunk at a time, which raise as always.
    assert tok.batches[1:] == [4, 4, 4]
    # A repeated order is sent once, so it counts once.
    same = build_prompts(
        ByteTokenizer(), "qa_default", QUERY, PASSAGES, [orders[0]] * 24, max_total_tokens=sent[0]
    )
    assert len(same) == 24


# --- prompts assembled from token segments ---------------------------------------------------


def _whole(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[BuiltPrompt]]:
    """``build_prompts`` on the whole-prompt path (every prompt tokenised whole)."""

    def build(*args: Any, **kwargs: Any) -> list[BuiltPrompt]:
        with monkeypatch.context() as m:
            m.setattr("service.prompting.prompts._assembled", lambda *a: None)
            return build_prompts(*args, **kwargs)

    return build


def _assembled_spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``build_prompts`` call since took the segments' prompts."""
    from service.prompting import prompts

    taken: list[bool] = []
    real = prompts._assembled

    def spy(*args: Any) -> list[BuiltPrompt] | None:
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(prompts, "_assembled", spy)
    return taken


@pytest.mark.parametrize("template", ["qa_default", "qa_plain", "qa_system", "qa_completion"])
def test_prompts_from_segments_are_the_whole_prompts(
    template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _whole(monkeypatch)
    taken = _assembled_spy(monkeypatch)
    passages = [*PASSAGES, Passage("untitled text", title=None)]
    assert len(passages) == 5
    orders = [[0, 2, 4], [1, 3], [4, 3, 2, 1, 0], [2], [3, 0]]
    tok = SpyTokenizer()
    got = build_prompts(tok, template, QUERY, passages, orders)
    assert taken == [True]
    assert got == whole(ByteTokenizer(), template, QUERY, passages, orders)
    # Each piece once, then whole prompts until every passage is shown (the check).
    assert len(tok.batches) == 2 and tok.batches[1] == 2


class MergingTokenizer(ByteTokenizer):
    """A tokenizer whose tokens cross the cut before a passage's text: a line break merges
    into the capitalised word after it (a BPE without a pre-tokenizer can do that)."""

    _PIECE = re.compile(r"\n[A-Z]\w*|<\|[a-z]+\|>|\w+|\s|[^\s\w]")

    def __init__(self) -> None:
        self._vocab: dict[str, int] = {}

    def encode(self, text: str) -> Encoding:
        ids, offsets = [], []
        for match in self._PIECE.finditer(text):
            ids.append(self._vocab.setdefault(match.group(), len(self._vocab)))
            offsets.append((match.start(), match.end()))
        return Encoding(ids=tuple(ids), offsets=tuple(offsets))

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        pieces = {i: p for p, i in self._vocab.items()}
        return "".join(pieces[i] for i in ids)


def test_a_token_across_a_segment_cut_is_found_and_the_prompts_tokenised_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole = _whole(monkeypatch)
    taken = _assembled_spy(monkeypatch)
    passages = [Passage("Paris is the capital.", title="Paris"), Passage("Lyon is a city.")]
    orders = [[0, 1], [1, 0], [1]]
    tok = MergingTokenizer()
    got = build_prompts(tok, "qa_default", QUERY, passages, orders)
    assert taken == [False]
    assert got == whole(tok, "qa_default", QUERY, passages, orders)
    assert any(tok.decode([t]).startswith("\nParis") for t in got[0].token_ids)


def _gemma_tokenizer_dir() -> Path:
    """Gemma-3-270m's tokenizer from the packaged GGUF, saved once under the tests' cache
    (reading it from the GGUF takes about a minute; the weights are not converted)."""
    from transformers import AutoTokenizer

    from service.config.settings import GEMMA_MODEL
    from service.model_assets import PACKAGED_MODELS, _join_chunks, gguf_sources
    from tests.support.models import cache_dir_for_tests

    folder = cache_dir_for_tests() / "tokenizers" / "gemma-3-270m"
    if not (folder / "tokenizer.json").exists():
        packaged = PACKAGED_MODELS[GEMMA_MODEL]
        with tempfile.TemporaryDirectory() as tmp:
            joined = _join_chunks(gguf_sources(packaged), Path(tmp), packaged)
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=joined.name)
            staging = Path(tempfile.mkdtemp(dir=folder.parent.parent))
            tok.save_pretrained(staging)
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "templates"),
    [("smollm2", ("qa_default", "qa_plain", "qa_system")), ("gemma", ("qa_completion",))],
)
def test_segments_equal_whole_prompts_on_the_dev_set_with_the_packaged_tokenizers(
    model: str, templates: tuple[str, ...], smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default design's prompts (pruned random) and full-length shuffles of the first
    development questions, 10 and 20 passages: assembled from segments they are the whole
    prompts, ids and spans, and with both packaged tokenizers the segments are taken."""
    from transformers import AutoTokenizer

    import solver
    from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer

    folder = smollm2_dir if model == "smollm2" else _gemma_tokenizer_dir()
    tok = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    whole = _whole(monkeypatch)
    taken = _assembled_spy(monkeypatch)
    rows = [json.loads(line) for line in NQ_DEV.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(0)
    for row in rows[:12]:
        for n in (10, 20):
            passages = [
                Passage(p["text"], title=p.get("title"), id=p["id"]) for p in row["passages"][:n]
            ]
            plan = solver.plan("pruned_random", n, seed=0)
            orders = [[int(i) for i in r if i >= 0] for r in plan]
            orders += [rng.sample(range(n), n) for _ in range(2)]
            for template in templates:
                got = build_prompts(tok, template, row["question"], passages, orders)
                assert got == whole(tok, template, row["question"], passages, orders)
    assert taken and all(taken)


# --- alignment errors, with tokenizers that behave like real BPE ---------------------------


class WordTokenizer:
    """GPT-2-like pre-tokenisation: a word swallows the space before it (" what")."""

    _PIECE = re.compile(r"<\|[a-z]+\|>| ?\w+| ?[^\s\w]+|\s")

    def __init__(self, *, trim_offsets: bool = False) -> None:
        self._vocab: dict[str, int] = {}
        self._trim = trim_offsets

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset()

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        return ByteTokenizer().render_chat(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> Encoding:
        ids, offsets = [], []
        for match in self._PIECE.finditer(text):
            ids.append(self._vocab.setdefault(match.group(), len(self._vocab)))
            start = match.start()
            # Like a tokenizer with trim_offsets: the swallowed space is hidden from the offsets.
            if self._trim and match.group().startswith(" ") and len(match.group()) > 1:
                start += 1
            offsets.append((start, match.end()))
        return Encoding(ids=tuple(ids), offsets=tuple(offsets))

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        pieces = {i: p for p, i in self._vocab.items()}
        return "".join(pieces[i] for i in ids)


def test_newline_separator_aligns_word_level_bpe() -> None:
    tok = WordTokenizer()
    orders = list(itertools.permutations(range(3)))
    prompts = build_prompts(tok, "qa_default", QUERY, PASSAGES[:3], orders)
    assert len({p.query_token_ids for p in prompts}) == 1
    assert tok.decode(prompts[0].query_token_ids) == QUERY


def test_space_before_the_query_is_reported_as_misaligned() -> None:
    register_template(
        PromptTemplate(
            name="test_space_prefix",
            instruction="Answer.",
            document="Document [{index}] {text}",
            untitled_document="Document [{index}] {text}",
            question_prefix="Question: ",
        ),
        replace=True,
    )
    with pytest.raises(PromptAlignmentError, match="not token-aligned"):
        build_prompt(WordTokenizer(), "test_space_prefix", QUERY, PASSAGES, [0])
    # Trimmed offsets hide the merged space; decoding the span still exposes it.
    with pytest.raises(PromptAlignmentError, match="decode"):
        build_prompt(WordTokenizer(trim_offsets=True), "test_space_prefix", QUERY, PASSAGES, [0])
    # The byte tokenizer never merges, so the same template is fine there.
    build_prompt(ByteTokenizer(), "test_space_prefix", QUERY, PASSAGES, [0])


class ContextSensitiveTokenizer(ByteTokenizer):
    """Encodes the query with other ids (same text) when a given passage opens the prompt."""

    def encode(self, text: str) -> Encoding:
        encoding = super().encode(text)
        if "Document [1] (Title: Cat)" not in text:
            return encoding
        cut = len(text[: text.rindex("Question:\n") + len("Question:\n")].encode())
        ids = tuple(i + 1000 if k >= cut and i < 256 else i for k, i in enumerate(encoding.ids))
        return Encoding(ids=ids, offsets=encoding.offsets)

    def decode(self, ids: Sequence[int]) -> str:
        return super().decode([i - 1000 if i >= 1000 else i for i in ids])


def test_query_tokens_that_differ_between_orders_are_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The whole-prompt path's check. Assembled from segments the query's ids are one piece's
    # in every prompt; this tokenizer's effect at a distance (a passage changes the query's
    # ids) is beyond what the segments' check samples (_assembled: every cut's context is
    # local), so it is exercised where the prompts are tokenised whole.
    monkeypatch.setattr("service.prompting.prompts._assembled", lambda *a: None)
    tok = ContextSensitiveTokenizer()
    build_prompt(tok, "qa_default", QUERY, PASSAGES, [3, 0])  # each prompt alone is aligned
    with pytest.raises(PromptAlignmentError, match=r"orders\[1\]"):
        build_prompts(tok, "qa_default", QUERY, PASSAGES, [[0, 3], [3, 0]])


class BareTokenizer(ByteTokenizer):
    """A chat template that adds nothing: the user message is the whole prompt."""

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        return "".join(m.content for m in messages)


class UpperTokenizer(ByteTokenizer):
    """A chat template that rewrites the content."""

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        return super().render_chat(
            [ChatMessage(m.role, m.content.upper()) for m in messages],
            add_generation_prompt=add_generation_prompt,
        )


def test_query_as_first_token_is_an_error() -> None:
    register_template(
        PromptTemplate(
            name="test_bare",
            instruction="",
            document="{text}",
            untitled_document="{text}",
            question_prefix="",
        ),
        replace=True,
    )
    with pytest.raises(PromptAlignmentError, match="first token"):
        build_prompt(BareTokenizer(), "test_bare", QUERY, PASSAGES, [])


def test_chat_template_that_rewrites_content_is_an_error() -> None:
    with pytest.raises(PromptAlignmentError, match="verbatim"):
        build_prompt(UpperTokenizer(), "qa_default", QUERY, PASSAGES, [0])


# --- the real SmolLM2 tokenizer and chat template --------------------------------------------


@pytest.mark.slow
def test_smollm2_query_span_is_aligned_and_identical_across_permutations(
    smollm2_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer

    tok = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    rows = [json.loads(line) for line in NQ_DEV.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(0)
    for row in rng.sample(rows, 20):
        passages = [Passage(p["text"], title=p.get("title"), id=p["id"]) for p in row["passages"]]
        n = len(passages)
        orders = [rng.sample(range(n), n) for _ in range(4)] + [rng.sample(range(n), n // 2)]
        for template in ("qa_default", "qa_plain"):
            prompts = build_prompts(tok, template, row["question"], passages, orders)
            assert len({p.query_token_ids for p in prompts}) == 1
            for prompt in prompts:
                start, end = prompt.query_span
                assert start >= 1
                assert tok.decode(prompt.token_ids[start:end]) == row["question"].strip()
                # The chat template's end-of-turn special token follows the query directly.
                assert prompt.token_ids[end] in tok.eos_token_ids
                for (s, e), index in zip(prompt.passage_spans, prompt.order, strict=True):
                    assert passages[index].text in tok.decode(prompt.token_ids[s:e])
        generation = build_generation_prompt(tok, "qa_default", row["question"], passages)
        assert generation.text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_query_with_a_character_it_cannot_represent_is_a_422_naming_it(
    smollm2_dir: Path,
) -> None:
    """Issue 90: SmolLM2's byte-level vocabulary has no token for F2, the lead byte of
    U+82E9E (an unassigned plane-8 code point), so it drops that byte and the query's tokens
    decode to other text: that was a 500 ``prompt_misaligned``. It is the input's doing, so a
    422 naming the character and where it is; the same character in a passage or a title is
    read as the tokenizer reads it (no span of theirs is scored as text), and an emoji, which
    the vocabulary has, is aligned as before."""
    from transformers import AutoTokenizer

    from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer

    tok = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    rare = "\U00082e9e"
    passages = [Passage(f"Paris {rare} is the capital", title=f"t{rare}"), Passage("Lyon")]
    for query, at in ((f"  what is {rare} here", 10), (rare, 0), (f"\U0001f600{rare}", 1)):
        for build in (
            lambda q: build_prompts(tok, "qa_default", q, passages, [[0, 1], [1, 0]]),
            lambda q: [build_prompt(tok, "qa_default", q, passages, [1, 0])],
            lambda q: [build_generation_prompt(tok, "qa_default", q, passages)],
        ):
            with pytest.raises(InvalidRequest, match=rf"query\[{at}\] is U\+82E9E") as caught:
                build(query)
            assert caught.value.param == "query"
    prompts = build_prompts(
        tok, "qa_default", "what is \U0001f600 here", passages, [[0, 1], [1, 0]]
    )
    assert tok.decode(prompts[0].query_token_ids) == "what is \U0001f600 here"
    assert prompts[0].query_token_ids == prompts[1].query_token_ids
