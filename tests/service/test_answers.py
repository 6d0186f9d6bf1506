"""Answer normalisation, the QA metrics and the majority vote, on hand-worked examples."""

from __future__ import annotations

import pytest

from service.prompting.answers import (
    exact_match,
    f1,
    first_line,
    majority_vote,
    normalize,
    nq_accuracy,
    tally,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   apple,  a pear and THE plum. ", "apple pear and plum"),
        ("Theatre at the end", "theatre at end"),  # articles are whole words only
        ("U.S.A.", "usa"),
        ("rock-n-roll", "rocknroll"),  # ASCII punctuation is deleted, not spaced
        ("l’été", "l’été"),  # typographic apostrophe is not ASCII punctuation (as SQuAD)
        ("a\tb\nc", "b c"),
        ("The.", ""),
        ("", ""),
    ],
)
def test_normalize_follows_squad(text: str, expected: str) -> None:
    assert normalize(text) == expected


def test_first_line_cuts_at_the_first_newline_only() -> None:
    assert first_line("Paris\nBecause the context says Paris.") == "Paris"
    assert first_line("no newline") == "no newline"
    assert first_line("\nleading") == ""


def test_nq_accuracy_is_substring_of_the_first_line() -> None:
    assert nq_accuracy("It was J. R. R. Tolkien.", ["Tolkien"]) == 1.0
    assert nq_accuracy("The answer is the Beatles", ["Beatles", "The Beatles"]) == 1.0
    # Only the first line counts: copying the context on line two earns nothing.
    assert nq_accuracy("I am not sure.\nTolkien wrote it.", ["Tolkien"]) == 0.0
    # Plain substring after normalisation, as the lost-in-the-middle script: 1937 in 19370.
    assert nq_accuracy("19370", ["1937"]) == 1.0
    assert nq_accuracy("Lewis", ["C. S. Lewis"]) == 0.0
    # A gold answer that normalises to nothing never matches (it would match everything).
    assert nq_accuracy("anything", ["The", "?"]) == 0.0


def test_exact_match_takes_the_best_gold_answer() -> None:
    assert exact_match("the Beatles.", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("The Beatles were a band", ["Beatles"]) == 0.0
    # No newline cut for EM: the whole response is compared.
    assert exact_match("Beatles\nmore", ["Beatles"]) == 0.0
    assert exact_match("", ["The"]) == 0.0


def test_f1_is_squad_token_f1_max_over_golds() -> None:
    # pred: [new, york, city], gold: [york, city, centre]: common 2, P 2/3, R 2/3, F1 2/3.
    assert f1("New York City", ["York City Centre"]) == pytest.approx(2 / 3, abs=1e-12)
    # Multiset overlap: pred [x, x, y], gold [x, y]: common 2, P 2/3, R 1.
    assert f1("x x y", ["x y"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1), abs=1e-12)
    # Max over golds: "paris" vs ["paris france" (F1 2/3), "paris" (1)].
    assert f1("Paris", ["Paris, France", "Paris"]) == 1.0
    assert f1("London", ["Paris"]) == 0.0
    assert f1("", ["Paris"]) == 0.0
    assert f1("the", ["a"]) == 0.0  # both normalise to nothing: no token in common


def test_metrics_need_gold_answers() -> None:
    for metric in (nq_accuracy, exact_match, f1):
        with pytest.raises(ValueError, match="no gold answers"):
            metric("x", [])
        with pytest.raises(TypeError):
            metric("x", "x")


def test_majority_vote_counts_normalised_forms_and_returns_the_first_raw_text() -> None:
    answers = ["Paris.", "London", "the paris", "PARIS", "London"]
    assert majority_vote(answers) == ("Paris.", 3)
    assert tally(answers)[1].text == "London" and tally(answers)[1].votes == 2


def test_majority_vote_ties_go_to_the_earliest_sampled_form() -> None:
    # London (first at 0) and Paris (first at 1) both have 2 votes: London was sampled first.
    assert majority_vote(["London", "Paris", "paris", "london."]) == ("London", 2)
    assert majority_vote(["y", "x"]) == ("y", 1)
    ranked = tally(["z", "y", "x", "y", "x"])
    assert [(t.form, t.votes, t.first) for t in ranked] == [("y", 2, 1), ("x", 2, 2), ("z", 1, 0)]


def test_empty_answers_form_their_own_group() -> None:
    # "", "..." and the bare article "a" all normalise to "".
    assert majority_vote(["", "...", "x", "a"]) == ("", 3)


def test_majority_vote_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        majority_vote([])
