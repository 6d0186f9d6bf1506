"""Task metrics of one generated answer, and where the gold passages ended up.

NQ-Open accuracy, HotpotQA EM and F1 come from ``service.prompting.answers`` (SQuAD normalisation;
NQ cuts the response at its first newline). EM and F1 are scored on the response's first line
too: the generator is told to reply with a short answer, and what follows a newline is
commentary that would otherwise zero EM for an answer that is right. ROUGE-L (MS MARCO) is
``rouge-score``'s ``rougeL`` F-measure of the whole response with its default tokenizer
(lowercase, alphanumeric tokens) and the Porter stemmer; with several references the best one
counts, as for EM and F1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from rouge_score import rouge_scorer  # type: ignore[import-untyped]

from service.prompting.answers import exact_match, f1, first_line, nq_accuracy

MetricName = Literal["accuracy", "em", "f1", "rouge_l"]
METRICS: tuple[MetricName, ...] = ("accuracy", "em", "f1", "rouge_l")


@dataclass(frozen=True)
class AnswerScores:
    """One response scored against the gold answers (each in [0, 1])."""

    accuracy: float  # NQ-Open: a normalised gold answer is a substring of the response
    em: float
    f1: float
    rouge_l: float

    def as_dict(self) -> dict[str, float]:
        return {m: float(getattr(self, m)) for m in METRICS}


@lru_cache(maxsize=1)
def _rouge() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """Best ROUGE-L F-measure of ``prediction`` over ``references`` (0.0 without any)."""
    scorer = _rouge()
    return max(
        (float(scorer.score(ref, prediction)["rougeL"].fmeasure) for ref in references),
        default=0.0,
    )


def score_answer(response: str, answers: Sequence[str]) -> AnswerScores:
    """Every task metric of ``response`` against the gold ``answers``."""
    line = first_line(response)
    return AnswerScores(
        accuracy=float(nq_accuracy(response, answers)),
        em=float(exact_match(line, answers)),
        f1=float(f1(line, answers)),
        rouge_l=rouge_l(response, answers),
    )


def gold_ranks(order: Sequence[int], gold: Sequence[int]) -> tuple[int | None, float | None]:
    """1-based slots of the gold passages in ``order``: the best (smallest) and their mean.

    Returns:
        ``(None, None)`` when the question has no gold passage.
    """
    slot = {p: k + 1 for k, p in enumerate(order)}
    ranks = [slot[g] for g in gold if g in slot]
    if not ranks:
        return None, None
    return min(ranks), sum(ranks) / len(ranks)


def default_metric(gold_counts: Sequence[int]) -> MetricName:
    """The task metric of a data set: EM when questions have several gold passages (HotpotQA,
    two-hop), else NQ-Open accuracy."""
    return "em" if any(c > 1 for c in gold_counts) else "accuracy"
