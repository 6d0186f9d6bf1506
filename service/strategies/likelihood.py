"""``query_likelihood``, ``convex_score``: question likelihood as a gauge (Liu et al.).

Both read only prompt log-probs (no generation) with the request's scoring template: the
passages in some order, then the question, whose per-token log-probs are summed. The
question's token ids are identical in every prompt of a request (``service.prompting.prompts``), so
a per-token mean is the sum over a constant count: it changes no comparison within a request,
and it makes the numbers comparable across questions of different lengths, the unit Liu et al.
reports throughout ("log p(question) per token", its 4.1 and Figure 2). Both strategies use it.

Both draw their random orders from ``rng_for`` (``options.seed``, else the configured seed,
mixed with the query): reproducible per (seed, question), different across questions.
Identical prompts are scored once (``Work``), so ``prompts_scored`` can be below the planned
count; the planned count is what the request limit checks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from service.config.settings import Settings
from service.errors import InvalidRequest, ScoringFailed
from service.strategies.protocol import Reference
from service.strategies.request import (
    Calls,
    Cost,
    Outcome,
    PromptScore,
    ReorderRequest,
    descending,
    need_scores,
    retriever_ranking,
    rng_for,
)
from service.strategies.work import Work


def _orders_up_to(n: int, cap: int) -> int:
    """``min(n!, cap)`` without computing a huge factorial."""
    count = 1
    for k in range(2, n + 1):
        count *= k
        if count >= cap:
            return cap
    return min(count, cap)


def distinct_shuffles(n: int, k: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """``min(k, n!)`` distinct orders of ``n`` passages, uniform without replacement.

    With ``k >= n!``: every order, in lexicographic order (an exhaustive search; no randomness
    used). With ``n! <= 2 k``: the ``k`` orders at ``rng.permutation(n!)[:k]`` of the
    lexicographic list. Otherwise: permutations ``rng.permutation(n)`` in the order drawn, a
    draw equal to an earlier one skipped (fewer than 2 draws per order on average).
    """
    total = _orders_up_to(n, 2 * k + 1)
    if total <= 2 * k:
        every = list(itertools.permutations(range(n)))
        if total <= k:
            return every
        return [every[int(j)] for j in rng.permutation(total)[:k]]
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < k:
        seen.setdefault(tuple(int(p) for p in rng.permutation(n)), None)
    return list(seen)


def position_orders(n: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """ConvexScore's ``n * n`` prompt orders; row ``d * n + i`` puts passage ``d`` in slot ``i``.

    For each passage ``d`` in index order, one draw ``rng.permutation(n - 1)`` orders the other
    passages (ascending indices, ``d`` removed); passage ``d`` is then inserted at each slot of
    that one order.
    """
    orders: list[tuple[int, ...]] = []
    for d in range(n):
        others = [j for j in range(n) if j != d]
        rest = [others[int(k)] for k in rng.permutation(n - 1)]
        orders.extend(tuple([*rest[:i], d, *rest[i:]]) for i in range(n))
    return orders


def convex_score(loglik: np.ndarray) -> np.ndarray:
    """Liu et al. eq. 3 per passage: ``2 (l[d, 1] + l[d, k] - sum_{i=2..k-1} l[d, i])``.

    Args:
        loglik: ``(n, k)``: l~ of passage ``d`` at 1-based position ``i`` in ``[d, i - 1]``;
            NaN where unknown (the passage's score is then NaN).

    Returns:
        One score per passage. For ``k = 1`` positions 1 and k coincide: ``4 l[d, 1]``; for
        ``k = 2`` the middle sum is empty: ``2 (l[d, 1] + l[d, 2])``.
    """
    return np.asarray(
        2.0 * (loglik[:, 0] + loglik[:, -1] - loglik[:, 1:-1].sum(axis=1)), dtype=np.float64
    )


def _per_token(scores: Sequence[PromptScore | None]) -> np.ndarray:
    return np.asarray(
        [np.nan if s is None else float(s.query.mean()) for s in scores], dtype=np.float64
    )


class QueryLikelihood:
    """``query_likelihood`` (Liu et al., method 1): the shuffle with the most likely question.

    Rules, including those the paper leaves loose:

    - K = ``options.samples`` (>= 1), default N, the number of passages (the paper shuffles k
      times for k documents). The shuffles are distinct: ``min(K, N!)`` of them, all N! orders
      when K >= N! (``distinct_shuffles``); a repeated shuffle would only re-score a prompt.
    - Random shuffles only: the input (retriever) order is not added as a candidate. The paper
      samples shuffles only, and its baseline is the mean over those shuffles; adding the input
      order would mix in a different method (it can still be drawn by chance).
    - The chosen shuffle has the highest per-token mean log p(question) (sum over the question's
      tokens / their count); ties go to the shuffle drawn first. order = ranking = that shuffle.
    - ``scores`` is None: the method judges whole prompts, not passages. A per-passage number
      (say, the mean likelihood of the shuffles a passage opened) would be a different,
      unvalidated method.
    - ``details``: ``loglik_chosen`` (the chosen shuffle's per-token log-likelihood),
      ``loglik_mean``, ``loglik_std`` (population standard deviation) and ``loglik_min`` over the
      scored shuffles, ``samples`` (shuffles drawn) and ``samples_scored``. The question
      likelihood is itself the paper's performance gauge, so it is also reported for N = 1.
    - A failed prompt drops its shuffle, with a warning; all failed: ``ScoringFailed``.

    Cost: ``min(K, N!)`` scored prompts of N passages each; no generation.
    """

    name = "query_likelihood"
    reference = Reference(
        source="[Liu et al.](method.md#references), method 1",
        rule="among K distinct shuffles, the one with the highest per-token mean log p(question)",
        calls="min(K, N!) scored prompts of N passages",
        returns="`diagnostics.details.loglik_*`",
        options_note="`samples`: K, default N",
    )
    options = frozenset({"samples", "seed"})
    uses_design = False
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        n = len(request.passages)
        return Cost((Calls(_orders_up_to(n, self._samples(request)), n),), param="samples")

    @staticmethod
    def _samples(request: ReorderRequest) -> int:
        k = request.options.samples
        if k is None:
            return len(request.passages)
        if k < 1:
            raise InvalidRequest(f"samples must be >= 1, got {k}", param="samples")
        return k

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        n = len(request.passages)
        orders = distinct_shuffles(n, self._samples(request), rng_for(request, work.settings))
        prompts = await work.scoring_prompts(request.query, request.passages, orders)
        scored = await work.score_prompts(prompts)
        need_scores(scored, "shuffles")
        loglik = _per_token(scored)
        ok = loglik[np.isfinite(loglik)]
        best = int(np.nanargmax(loglik))  # the first maximum: the earliest drawn
        warnings: list[str] = []
        if len(ok) < len(orders):
            warnings.append(
                f"{len(orders) - len(ok)} of {len(orders)} shuffles failed to score and were "
                "dropped"
            )
        order = list(orders[best])
        return Outcome(
            order=order,
            ranking=list(order),
            details={
                "loglik_chosen": float(loglik[best]),
                "loglik_mean": float(ok.mean()),
                "loglik_std": float(ok.std()),
                "loglik_min": float(ok.min()),
                "samples": len(orders),
                "samples_scored": len(ok),
            },
            warnings=tuple(warnings),
        )


class ConvexScore:
    """``convex_score`` (Liu et al., method 2, eq. 3): find the most relevant passage, put it first.

    Rules, including those the paper leaves loose:

    - ``l~(d, i)``, passage d at 1-based position i of k = N, is the per-token mean
      log p(question) (module docstring: the sum gives the same order, scaled by the constant
      question length; the mean keeps scores comparable across questions).
    - "The rest in random order": one random order of the other passages per passage d, shared
      by d's k prompts (``position_orders``), so d's curve over positions compares prompts that
      differ only in where d sits (the gold-document sweep behind Liu et al.'s Figure 2 moves
      one document through fixed distractors), not k independent draws of the others' order.
    - ConvexScore_d = 2 (l~(d,1) + l~(d,k) - sum_{i=2..k-1} l~(d,i)), eq. 3 as written. (Its eq.
      2 derives it as InitScore + the summed second differences, but the second differences
      telescope to l~(d,1) - l~(d,2) - l~(d,k-1) + l~(d,k); eq. 3, the one implemented here,
      is what is computed.) Only differences between passages of one request mean anything:
      a part of l~ common to all prompts enters with weight 2 (4 - k) for k >= 2.
    - N = 1: positions 1 and k coincide; one prompt and ConvexScore = 4 l~(d, 1). N = 2: the
      middle sum is empty and both passages are scored on the same two prompts ([0, 1] and
      [1, 0]), so their scores are equal and the order is the retriever's (2 prompts scored,
      4 planned).
    - ranking = descending ConvexScore, ties by retriever order (``retriever_ranking``);
      order = the top passage first, then the others in retriever order (the paper moves only
      the top document; the rest keep the input ranking).
    - ``scores`` = ConvexScore (``score_name="convex_score"``); ``details``: ``top`` (the
      passage moved first) and ``position_loglik``, the mean l~ per position over the passages
      (the model's measured positional curve for this question).
    - A failed prompt leaves every passage that needed it without a score: NaN, ranked after
      the scored ones (by retriever order among themselves), with a warning. No passage scored
      (every prompt failed, or each passage lost one): ``ScoringFailed``.

    Cost: N * N planned prompts of N passages each (fewer scored when orders repeat: the
    estimate counts the distinct orders); no generation. The request limit
    (``max_prompts_per_request``) refuses large N before any scoring.
    """

    name = "convex_score"
    reference = Reference(
        source="Liu et al., method 2",
        rule=(
            "ConvexScore_d = 2 (l(d,1) + l(d,N) - sum_{i=2..N-1} l(d,i)); the top passage goes "
            "first"
        ),
        calls="N² scored prompts of N passages (repeats scored once)",
        returns="`passages[].score`; `details.top`, `details.position_loglik`",
    )
    options = frozenset({"seed"})
    uses_design = False
    ranks = True

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        n = len(request.passages)
        # The orders ``run`` draws, from the same stream: few passages repeat orders (N = 2
        # has 2 of 4), and ``Work`` scores each distinct one once.
        distinct = len(set(position_orders(n, rng_for(request, settings))))
        return Cost((Calls(n * n, n, distinct=distinct),))

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        passages = request.passages
        n = len(passages)
        orders = position_orders(n, rng_for(request, work.settings))
        prompts = await work.scoring_prompts(request.query, passages, orders)
        scored = await work.score_prompts(prompts)
        need_scores(scored, "position prompts")
        loglik = _per_token(scored).reshape(n, n)
        scores = convex_score(loglik)
        missing = int(np.count_nonzero(~np.isfinite(scores)))
        if missing == n:
            raise ScoringFailed(
                f"{int(np.count_nonzero(~np.isfinite(loglik)))} of {n * n} position prompts "
                "failed and no passage has all of its positions scored; nothing to order by"
            )
        retr = retriever_ranking(passages)
        ranking = descending(scores, retr)
        top = ranking[0]
        warnings: list[str] = []
        if missing:
            warnings.append(
                f"{missing} passage(s) have no convex_score because some of their position "
                "prompts failed; they are ranked last"
            )
        curve = [
            float(np.mean(col[np.isfinite(col)])) if np.isfinite(col).any() else float("nan")
            for col in loglik.T
        ]
        return Outcome(
            order=[top, *(i for i in retr if i != top)],
            ranking=ranking,
            score_name="convex_score",
            scores=scores,
            details={"top": top, "position_loglik": curve},
            warnings=tuple(warnings),
        )
