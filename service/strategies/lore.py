"""``lore``: Logit-Ranked Retriever Ensemble (the LoRE paper, docs/method.md).

One greedy answer per passage, generated from the query and that passage alone (the request's
template, ``max_answer_tokens`` budget), then per passage ``d``::

    LoR(d) = probability_weight * mean_prob(d) + rank_weight / context_rank(d)

Rules, including those the paper leaves loose:

- ``mean_prob`` is ``Answer.mean_probability``: the mean over the answer's tokens of the
  chosen token's softmax probability (paper 3.3.2). The end-of-turn token that ends the answer
  is excluded (it is not part of the answer); an empty answer (end of turn first) has 0.
- ``context_rank`` comes from reciprocal rank fusion of the input rankings,
  ``RRF(d) = sum_i 1 / (rrf_k + rank_i(d))`` with 1-based ranks (paper 3.1.3). The input
  rankings are ``options.rankings`` (passage indices, best first; each may list a subset, no
  index twice, at least one index) or, by default, the single retriever ranking
  (``retriever_ranking``: scores, else input order). Given rankings replace the retriever's:
  to fuse with it, pass it as one of them. A passage absent from a ranking gets no term from
  it (the paper's rank infinity), so one absent from all has RRF 0. ``context_rank(d)`` is
  d's 1-based position when passages are sorted by descending RRF, ties by retriever order;
  RRF is compared exactly (as fractions), so equal sums tie whatever the float rounding.
  (The LoRE paper's worked example, Table 5, mis-adds its sums; the formula is what counts:
  [D1, D2, D3, D4] and [D3, D1, D5, D2] fuse to D1, D3, D2, D5, D4.)
- order = ranking = passages by descending LoR, ties by context rank. ``scores`` are the LoR
  values (``score_name="lor"``).
- The answer is the answer of the highest-LoR passage: the paper ranks the per-passage
  answers by LoR and "selects the most appropriate one" (3.3.4, 5). ``passage`` is its index,
  ``probability`` its mean token probability.
- A failed generation leaves its passage without a score: LoR NaN, placed after every scored
  passage (by context rank among themselves), with a warning. No evidence is not low
  confidence: probability 0 would still let the rank term lift a failed passage above scored
  ones. All failed: ``ScoringFailed``.

``details``: per passage ``mean_probability`` (null where failed), ``context_rank`` and
``rrf``, and ``input_rankings`` (how many were fused).

Cost: N generations (one per passage; passages with identical text are generated once), no
scored prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from service.config.settings import Settings
from service.errors import InvalidRequest
from service.prompting.answers import DEFAULT_MAX_ANSWER_TOKENS
from service.strategies.protocol import Reference
from service.strategies.request import (
    Calls,
    Cost,
    Outcome,
    ReorderRequest,
    VotedAnswer,
    descending,
    need_scores,
    retriever_ranking,
)
from service.strategies.work import Work

DEFAULT_PROBABILITY_WEIGHT = 0.8
DEFAULT_RANK_WEIGHT = 0.2
DEFAULT_RRF_K = 60


def check_rankings(rankings: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Validated input rankings.

    Raises:
        InvalidRequest: no ranking, an empty ranking, an index out of range or repeated.
    """
    if not rankings:
        raise InvalidRequest("rankings must hold at least one ranking", param="rankings")
    checked: list[list[int]] = []
    for r, ranking in enumerate(rankings):
        param = f"rankings[{r}]"
        if not ranking:
            raise InvalidRequest(f"{param} is empty", param=param)
        seen: set[int] = set()
        for idx in ranking:
            if isinstance(idx, bool) or not isinstance(idx, int | np.integer):
                raise InvalidRequest(f"{param} holds {idx!r}, not a passage index", param=param)
            if not 0 <= idx < n:
                raise InvalidRequest(
                    f"{param} lists passage {idx}, out of range for {n} passages", param=param
                )
            if idx in seen:
                raise InvalidRequest(f"{param} lists passage {idx} twice", param=param)
            seen.add(int(idx))
        checked.append([int(i) for i in ranking])
    return checked


def rrf_scores(rankings: Sequence[Sequence[int]], n: int, k: int) -> list[Fraction]:
    """Exact ``RRF(d) = sum_i 1 / (k + rank_i(d))`` (1-based ranks; absent: no term)."""
    scores = [Fraction(0)] * n
    for ranking in rankings:
        for pos, idx in enumerate(ranking, start=1):
            scores[idx] += Fraction(1, k + pos)
    return scores


def context_ranks(rrf: Sequence[Fraction], tiebreak: Sequence[int]) -> list[int]:
    """1-based position of each passage by descending RRF, ties in ``tiebreak`` order."""
    where = {idx: pos for pos, idx in enumerate(tiebreak)}
    fused = sorted(range(len(rrf)), key=lambda i: (-rrf[i], where[i]))
    ranks = [0] * len(rrf)
    for pos, idx in enumerate(fused, start=1):
        ranks[idx] = pos
    return ranks


class Lore:
    """``lore`` (the LoRE paper): the rules and the cost are in the module docstring."""

    name = "lore"
    reference = Reference(
        source="[LoRE](method.md#references)",
        rule=(
            "one greedy answer per passage alone; LoR = 0.8 mean token probability + 0.2 / context "
            "rank, context rank by reciprocal rank fusion (k = 60) of the input rankings"
        ),
        calls="N generations of 1 passage",
        returns="`answer` (the best passage's); `passages[].answer`, `passages[].score` (LoR)",
        options_note="`max_answer_tokens`: default 32",
    )
    options = frozenset(
        {"rankings", "probability_weight", "rank_weight", "rrf_k", "max_answer_tokens"}
    )
    uses_design = False
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        params = _Params.of(request)
        return Cost((Calls(len(request.passages), 1, new_tokens=params.max_answer_tokens),))

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        params = _Params.of(request)
        passages = request.passages
        n = len(passages)
        retriever = retriever_ranking(passages)
        rankings = params.rankings if params.rankings is not None else [retriever]
        rrf = rrf_scores(rankings, n, params.rrf_k)
        ranks = context_ranks(rrf, retriever)

        prompts = await work.generation_prompts(
            request.query, passages, [[i] for i in range(n)], room=params.max_answer_tokens
        )
        answers = await work.generate(prompts, max_new_tokens=params.max_answer_tokens)
        need_scores(answers, "passage answers")

        prob = np.asarray(
            [np.nan if a is None else a.mean_probability for a in answers], dtype=np.float64
        )
        lor = params.probability_weight * prob + params.rank_weight / np.asarray(
            ranks, dtype=np.float64
        )
        by_context = sorted(range(n), key=lambda i: ranks[i])
        ranking = descending(lor, by_context)
        best = ranking[0]
        best_answer = answers[best]
        assert best_answer is not None  # need_scores: some passage scored; NaN sorts last
        warnings: list[str] = []
        failed = sum(a is None for a in answers)
        if failed:
            warnings.append(
                f"{failed} of {n} passage answers failed to generate; those passages have no "
                "LoR score and are placed last, by context rank"
            )
        return Outcome(
            order=list(ranking),
            ranking=ranking,
            score_name="lor",
            scores=lor,
            answer=VotedAnswer(
                text=best_answer.text, passage=best, probability=best_answer.mean_probability
            ),
            passage_answers=tuple(None if a is None else a.text for a in answers),
            details={
                "mean_probability": prob.tolist(),
                "context_rank": ranks,
                "rrf": [float(s) for s in rrf],
                "input_rankings": len(rankings),
            },
            warnings=tuple(warnings),
        )


@dataclass(frozen=True)
class _Params:
    """The request's LoRE options, defaults applied and validated."""

    rankings: list[list[int]] | None
    probability_weight: float
    rank_weight: float
    rrf_k: int
    max_answer_tokens: int

    @classmethod
    def of(cls, request: ReorderRequest) -> _Params:
        """Raises: InvalidRequest: an option out of its range, or bad rankings."""
        opts = request.options
        n = len(request.passages)
        rankings = None if opts.rankings is None else check_rankings(opts.rankings, n)
        weights: dict[str, float] = {}
        for name, value, default in (
            ("probability_weight", opts.probability_weight, DEFAULT_PROBABILITY_WEIGHT),
            ("rank_weight", opts.rank_weight, DEFAULT_RANK_WEIGHT),
        ):
            w = default if value is None else float(value)
            if not (math.isfinite(w) and w >= 0):
                raise InvalidRequest(f"{name} must be finite and >= 0, not {w}", param=name)
            weights[name] = w
        rrf_k = DEFAULT_RRF_K if opts.rrf_k is None else opts.rrf_k
        if rrf_k < 0:
            raise InvalidRequest(f"rrf_k must be >= 0, not {rrf_k}", param="rrf_k")
        budget = answer_budget(request)
        return cls(rankings, weights["probability_weight"], weights["rank_weight"], rrf_k, budget)


def answer_budget(request: ReorderRequest) -> int:
    """``max_answer_tokens`` or the default.

    Raises:
        InvalidRequest: below 1.
    """
    budget = request.options.max_answer_tokens
    if budget is None:
        return DEFAULT_MAX_ANSWER_TOKENS
    if budget < 1:
        raise InvalidRequest(
            f"max_answer_tokens must be >= 1, not {budget}", param="max_answer_tokens"
        )
    return budget
