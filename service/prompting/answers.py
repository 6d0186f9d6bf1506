"""Answers: SQuAD-style normalisation, the QA metrics, and the majority vote.

Shared by the answering strategies (``lore``, ``self_consistency``) and the evaluation harness,
so a vote and a score always compare answers by the same rule. Pure Python, no I/O.

Rules (the official SQuAD v1.1 / lost-in-the-middle scripts, plus the choices they leave open):

- ``normalize``: lowercase, drop ASCII punctuation (``string.punctuation``, as the official
  scripts; typographic marks such as ``’`` or ``—`` stay), replace the whole words a/an/the by
  a space, collapse whitespace.
- ``nq_accuracy``: the response is cut at its first newline (models otherwise "answer" by
  copying the context, which contains the gold answer), then 1.0 when any normalised gold
  answer is a plain substring of the normalised response ("1937" matches "19370", as in the
  reference script).
- ``exact_match`` and ``f1`` score the whole response (no newline cut; apply ``first_line``
  first where a benchmark wants it) and take the maximum over the gold answers. ``f1`` is
  SQuAD v1.1's bag-of-tokens F1; HotpotQA's official script additionally gives 0 when exactly
  one side is yes/no/noanswer and they differ; this module does not.
- A gold answer that normalises to the empty string (``"The."``) never matches: as a
  substring it would match every response. No gold answer at all is a ``ValueError``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_ANSWER_TOKENS",
    "Tally",
    "exact_match",
    "f1",
    "first_line",
    "majority_vote",
    "normalize",
    "nq_accuracy",
    "tally",
]

DEFAULT_MAX_ANSWER_TOKENS = 32
"""Default generation budget of one answer (``lore``, ``self_consistency``, the harness)."""

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> str:
    """SQuAD normalisation: lowercase, no ASCII punctuation, no articles, single spaces."""
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", no_punct).split())


def first_line(response: str) -> str:
    """The response up to its first newline (NQ-Open's rule before matching)."""
    return response.split("\n", 1)[0]


def _golds(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of strings, not one string")
    if not answers:
        raise ValueError("no gold answers to compare with")
    return [g for g in (normalize(a) for a in answers) if g]


def nq_accuracy(response: str, answers: Sequence[str]) -> float:
    """NQ-Open accuracy: 1.0 when a normalised gold answer is a substring of the normalised
    first line of ``response``, else 0.0.

    Raises:
        ValueError: ``answers`` is empty.
    """
    pred = normalize(first_line(response))
    return 1.0 if any(g in pred for g in _golds(answers)) else 0.0


def exact_match(response: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised response equals a normalised gold answer, else 0.0.

    Raises:
        ValueError: ``answers`` is empty.
    """
    pred = normalize(response)
    return 1.0 if any(g == pred for g in _golds(answers)) else 0.0


def f1(response: str, answers: Sequence[str]) -> float:
    """SQuAD token F1 between the normalised response and each gold answer, the maximum.

    Tokens are the normalised words, counted as a multiset; no common token gives 0.0.

    Raises:
        ValueError: ``answers`` is empty.
    """
    pred = normalize(response).split()
    best = 0.0
    for gold in _golds(answers):
        truth = gold.split()
        common = sum((Counter(pred) & Counter(truth)).values())
        if common == 0:
            continue
        precision = common / len(pred)
        recall = common / len(truth)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True, slots=True)
class Tally:
    """One distinct normalised answer among a set of sampled answers."""

    form: str
    """The normalised answer (may be empty: an empty or all-punctuation answer)."""
    text: str
    """The first sampled raw answer with this form."""
    votes: int
    first: int
    """Index of the first sample with this form."""


def tally(answers: Sequence[str]) -> list[Tally]:
    """Votes per normalised answer, most votes first; ties: the earliest first sample first.

    Every answer counts, an empty one included (its form is ``""``).
    """
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of strings, not one string")
    counts: dict[str, list[int]] = {}  # form -> [votes, first index]
    for i, answer in enumerate(answers):
        entry = counts.setdefault(normalize(answer), [0, i])
        entry[0] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
    return [
        Tally(form=form, text=answers[first], votes=votes, first=first)
        for form, (votes, first) in ranked
    ]


def majority_vote(answers: Sequence[str]) -> tuple[str, int]:
    """The most frequent answer by normalised form, and its votes.

    Ties: among the forms with the most votes, the one sampled earliest wins. The text
    returned is the first raw answer of the winning form (not its normalised form).

    Raises:
        ValueError: ``answers`` is empty.
    """
    if not answers:
        raise ValueError("no answers to vote on")
    top = tally(answers)[0]
    return top.text, top.votes
