"""Orders that need no model: ``retriever``, ``inverse``, ``shuffle``, ``litm``.

They cost nothing (no prompt is scored or generated) and are the baselines every evaluation
compares against (Cuconasu et al.: Sequential, Inverse, Shuffle; the lost-in-the-middle reorder as
libraries ship it). "Retriever order" is ``retriever_ranking``: descending ``score`` when every
passage has one, else the input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import solver
from service.config.settings import Settings
from service.strategies.protocol import Reference
from service.strategies.request import Cost, Outcome, ReorderRequest, retriever_ranking, rng_for
from service.strategies.work import Work


def litm_order(ranking: Sequence[int]) -> list[int]:
    """Best passages at both ends, weakest in the middle.

    Rule: the passage of rank ``k`` (0 = best) goes to the front half when ``k`` is even and to
    the back half when ``k`` is odd; the front fills left to right, the back right to left. So
    ``[r0, r2, r4, ..., r5, r3, r1]``: the best passage is always first and the second best
    always last, whatever the list's length. (LangChain's ``LongContextReorder`` alternates
    from the worst passage instead, so for an even length its best passage lands last and for
    an odd length first.)
    """
    return solver.place_ranking(ranking, "litm")


class _Placement:
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = False

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        return Cost()


class Retriever(_Placement):
    """The retriever's order (Cuconasu et al.'s Sequential)."""

    name = "retriever"
    reference = Reference(
        source="Cuconasu et al.'s Sequential",
        rule="the retriever order",
        calls="0",
    )
    ranks = True

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        ranking = retriever_ranking(request.passages)
        return Outcome(order=list(ranking), ranking=ranking)


class Inverse(_Placement):
    """The retriever's order reversed: its best passage is the last, next to the question
    (every template puts the question after the documents)."""

    name = "inverse"
    reference = Reference(
        rule="the retriever order reversed: its best passage next to the question",
        calls="0",
    )

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        ranking = retriever_ranking(request.passages)
        return Outcome(order=ranking[::-1], ranking=ranking)


class Shuffle(_Placement):
    """A seeded uniform permutation; reproducible per (seed, query) (``rng_for``)."""

    name = "shuffle"
    reference = Reference(
        rule="a seeded uniform permutation",
        calls="0",
    )
    options = frozenset({"seed"})

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        order = [int(i) for i in rng_for(request, work.settings).permutation(len(request.passages))]
        return Outcome(order=order, ranking=list(order))


class Litm(_Placement):
    """Lost-in-the-middle: the retriever's best passages at both ends (``litm_order``)."""

    name = "litm"
    reference = Reference(
        rule="lost in the middle: the best passages at both ends",
        calls="0",
    )

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        ranking = retriever_ranking(request.passages)
        return Outcome(order=litm_order(ranking), ranking=ranking)
