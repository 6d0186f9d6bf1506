"""The context window (issue 93): the budget is never exceeded over random passages, budgets,
rankings and placements (the exact count of the documents block as the prompt renders it),
every passage is either placed or dropped with a reason, a budget below the best passage is
refused, document order, and the near-duplicate rule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backends.base import PromptTokenizer
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from service.context.dedup import jaccard, merge_duplicates, shingles
from service.context.window import (
    ContextBudgetTooSmall,
    ContextOptions,
    build_window,
    document_order,
)
from service.passage import Passage
from service.prompting.templates import get_template

WORDS = [
    "the",
    "river",
    "a",
    "of",
    "1",
    "2",
    "’",
    "é",
    "Loire",
    "東京",
    "flows",
    "north,",
    "west;",
    "12345",
    "...",
    "\n",
    "(Paris)",
    "ok",
]


def rendered_tokens(tok: PromptTokenizer, order: list[int], passages: list[Passage]) -> int:
    tpl = get_template("qa_default")
    text = tpl.separator.join(tpl.render_document(k, passages[i])[0] for k, i in enumerate(order))
    return len(tok.encode(text).ids)


def check_window(tok: PromptTokenizer, passages: list[Passage], budget: int, rnd: random.Random):
    n = len(passages)
    ranking = list(range(n))
    rnd.shuffle(ranking)
    order = list(range(n))
    rnd.shuffle(order)
    top_n = rnd.choice([None, max(1, n // 2)])
    try:
        w = build_window(
            order=order,
            ranking=ranking,
            fit=None,
            passages=passages,
            options=ContextOptions(
                max_context_tokens=budget, order=rnd.choice(["placement", "document"])
            ),
            tokenizer=tok,
            tokenizer_name="t",
            tokenizer_is_generator=True,
            template=get_template("qa_default"),
            top_n=top_n,
        )
    except ContextBudgetTooSmall as exc:
        # Refused only when the best passage alone does not fit, and says by how much.
        assert exc.value == budget and exc.limit > budget
        assert rendered_tokens(tok, [ranking[0]], passages) == exc.limit
        return
    assert w.tokens_used <= budget
    assert w.tokens_used == rendered_tokens(tok, w.order, passages)
    dropped = [d.index for d in w.dropped]
    assert sorted(w.order + dropped) == list(range(n))  # placed or dropped, never both
    assert ranking[0] in w.order  # the best passage always goes in
    assert all(d.reason in ("budget", "top_n") for d in w.dropped)


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=40).map(" ".join).filter(str.strip),
        min_size=1,
        max_size=12,
    ),
    titles=st.booleans(),
    budget=st.integers(min_value=1, max_value=1500),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_budget_never_exceeded_bytes(
    texts: list[str], titles: bool, budget: int, seed: int
) -> None:
    passages = [
        Passage(text=t, title=f"T{k}" if titles else None, source=f"s{k % 3}", offset=k)
        for k, t in enumerate(texts)
    ]
    check_window(ByteTokenizer(), passages, budget, random.Random(seed))


@pytest.mark.slow
def test_budget_never_exceeded_real_tokenizer(smollm2_dir: Path) -> None:
    """With SmolLM2's BPE, whose merges across a separator make a block's count differ from
    its parts' sum."""
    tok = load_prompt_tokenizer(smollm2_dir, name="smollm2")
    rnd = random.Random(7)
    for _ in range(200):
        n = rnd.randint(1, 10)
        passages = [
            Passage(
                text=" ".join(rnd.choices(WORDS, k=rnd.randint(1, 60))) + "x",
                title=rnd.choice([None, "Title " + rnd.choice(WORDS)]),
            )
            for _ in range(n)
        ]
        check_window(tok, passages, rnd.randint(5, 600), rnd)


def test_budget_too_small_names_the_tokens_needed() -> None:
    passages = [Passage(text="a" * 50), Passage(text="b" * 10)]
    with pytest.raises(ContextBudgetTooSmall) as err:
        build_window(
            order=[1, 0],
            ranking=[0, 1],
            fit=None,
            passages=passages,
            options=ContextOptions(max_context_tokens=20),
            tokenizer=ByteTokenizer(),
            tokenizer_name="t",
            tokenizer_is_generator=True,
            template=get_template("qa_default"),
            budget_param="p",
        )
    assert err.value.param == "p"
    assert err.value.value == 20
    assert err.value.limit == rendered_tokens(ByteTokenizer(), [0], passages)
    assert "p is 20, below the" in err.value.message


def test_budget_skips_a_long_passage_for_a_shorter_one_that_fits() -> None:
    passages = [Passage(text="best"), Passage(text="long " * 40), Passage(text="short")]
    tok = ByteTokenizer()
    budget = rendered_tokens(tok, [0, 2], passages)
    w = build_window(
        order=[0, 1, 2],
        ranking=[0, 1, 2],
        fit=None,
        passages=passages,
        options=ContextOptions(max_context_tokens=budget),
        tokenizer=tok,
        tokenizer_name="t",
        tokenizer_is_generator=True,
        template=get_template("qa_default"),
    )
    assert w.order == [0, 2]
    assert [(d.index, d.reason) for d in w.dropped] == [(1, "budget")]


def test_document_order_groups_sources_in_offset_order() -> None:
    p = [
        Passage("a", source="A", offset=5),
        Passage("b", source="B", offset=9),
        Passage("c", source="A", offset=1),
        Passage("d"),
        Passage("e", source="B", offset=2),
        Passage("f", source="A"),
    ]
    # Placement 3, 1, 0, 4, 2, 5: sources by first appearance (3 alone, B, A).
    assert document_order([3, 1, 0, 4, 2, 5], p) == [3, 4, 1, 2, 0, 5]


def test_dedup_merges_near_identical_not_overlapping_chunks() -> None:
    words = [f"w{i}" for i in range(200)]
    a = " ".join(words[:100])
    near = " ".join(words[:100]).upper().replace(" ", ",  ")  # same words, other case and marks
    edited = " ".join([*words[:97], "x", "y", "z"])  # one sentence changed
    half = " ".join(words[50:150])  # a chunk overlapping a by half
    plan = merge_duplicates([Passage(a), Passage(near), Passage(edited), Passage(half)], 0.8)
    assert plan.kept == (0, 3)
    assert [(m.index, m.into) for m in plan.merges] == [(1, 0), (2, 0)]
    assert plan.merges[0].similarity == 1.0
    assert 0.8 <= plan.merges[1].similarity < 1.0
    assert jaccard(shingles(a), shingles(half)) == pytest.approx(46 / 146, abs=0.01)
    assert merge_duplicates([Passage(a), Passage(near)], None).kept == (0, 1)


def brute_force(
    passages: list[Passage], threshold: float
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    sets = [shingles(p.text) for p in passages]
    kept: list[int] = []
    merges: list[tuple[int, int]] = []
    for j, sj in enumerate(sets):
        into = next((i for i in kept if jaccard(sets[i], sj) >= threshold), None)
        if into is None:
            kept.append(j)
        else:
            merges.append((j, into))
    return tuple(kept), merges


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8, 1.0])
def test_dedup_prefix_filter_finds_every_pair_the_brute_force_finds(threshold: float) -> None:
    rnd = random.Random(threshold)
    base = [
        " ".join(f"w{rnd.randint(0, 40)}" for _ in range(rnd.randint(1, 30))) for _ in range(15)
    ]
    texts = []
    for _ in range(120):  # edited copies of a few texts: many pairs near any threshold
        words = rnd.choice(base).split()
        for _ in range(rnd.randint(0, 4)):
            words[rnd.randrange(len(words))] = f"x{rnd.randint(0, 9)}"
        texts.append(" ".join(words))
    passages = [Passage(t) for t in texts]
    plan = merge_duplicates(passages, threshold)
    kept, merges = brute_force(passages, threshold)
    assert plan.kept == kept
    assert [(m.index, m.into) for m in plan.merges] == merges


def test_dedup_of_the_largest_request_is_fast() -> None:
    """MAX_PASSAGES (4096) distinct passages of 100 words: a caller cannot make the service
    compare every pair (8 million Jaccards)."""
    import time

    rnd = random.Random(0)
    passages = [
        Passage(" ".join(f"w{rnd.randint(0, 50_000)}" for _ in range(100))) for _ in range(4096)
    ]
    t0 = time.process_time()  # CPU seconds: the wall clock here depends on the neighbours
    plan = merge_duplicates(passages, 0.8)
    assert len(plan.kept) == 4096
    assert time.process_time() - t0 < 10.0  # 2.0 CPU s measured here
