"""``self_consistency``: majority vote over answers to random permutations (the MoI paper's
black-box inference-scaling baseline, section 4.1: 30 permutations, the most frequent answer).

K = ``samples`` (default 30) seeded uniform permutations of all passages (``rng_for``: the
seed mixed with the query), one greedy answer to each (the request's template,
``max_answer_tokens`` budget), then a majority vote (``service.prompting.answers.majority_vote``).

Rules, including those the paper leaves loose:

- Answers are compared by their SQuAD-normalised form (``service.prompting.answers.normalize``); an
  empty answer is a form like any other. Ties: the form sampled earliest wins. The answer's
  text is the first raw answer of the winning form, ``votes`` the permutations that gave that
  form, ``samples`` the answers counted, ``probability`` the mean over the winning samples of
  their mean token probability (end-of-turn token excluded, as for ``lore``).
- order = ranking = the first sampled permutation whose answer has the winning form: an order
  that, fed to the same generator, gave the voted answer. Self-consistency judges answers,
  not passages, so there are no per-passage scores (``scores`` is None).
- Duplicate permutations (likely for small N: N = 3 has 6) are generated once (greedy decoding
  is deterministic; ``usage.generations`` counts distinct prompts) but each counts as a vote:
  a vote is a sample of the permutation distribution, not a distinct prompt. ``usage.prompts``
  is K.
- A failed generation is dropped from the vote, with a warning; all failed: ``ScoringFailed``.

``details``: ``samples`` (K), ``counted``, ``distinct_answers``, ``votes`` (the top forms:
their first raw text and votes) and ``permutation`` (the index of the sample used as order).

Cost: K planned generations of N passages each (a repeated permutation is generated once), at
most ``max_answer_tokens`` tokens each; no scored prompt. The prompts' tokens count against
``max_prompt_tokens_x_prompts`` like scored prompts.
"""

from __future__ import annotations

import numpy as np

from service.config.settings import Settings
from service.errors import InvalidRequest
from service.prompting.answers import normalize, tally
from service.strategies.lore import answer_budget
from service.strategies.protocol import Reference
from service.strategies.request import (
    Answer,
    Calls,
    Cost,
    Outcome,
    ReorderRequest,
    VotedAnswer,
    need_scores,
    rng_for,
)
from service.strategies.work import Work

DEFAULT_SAMPLES = 30  # the MoI paper, section 4.1
TOP_VOTES = 5  # distinct answers listed in details


class SelfConsistency:
    """``self_consistency``: the rules and the cost are in the module docstring."""

    name = "self_consistency"
    reference = Reference(
        source="the MoI paper's black-box baseline",
        rule="greedy answers to K seeded permutations, majority vote",
        calls="K generations of N passages",
        returns="`answer` (the voted one, with `votes` and `samples`)",
        options_note="`samples`: K, default 30",
    )
    options = frozenset({"samples", "seed", "max_answer_tokens"})
    uses_design = False
    ranks = False

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        budget = answer_budget(request)
        # Identical permutations are generated once: count the distinct ones (few for few
        # passages: 2 of 30 samples for 2 passages).
        perms = _permutations(request, settings)
        calls = Calls(
            len(perms), len(request.passages), new_tokens=budget, distinct=len(set(perms))
        )
        return Cost((calls,), param="samples")

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        k = _samples(request)
        budget = answer_budget(request)
        perms = _permutations(request, work.settings)
        # Build each distinct order once; every sample still goes to ``generate`` (the ledger
        # counts K planned calls, ``generate`` sends each distinct prompt once).
        distinct = list(dict.fromkeys(perms))
        built = await work.generation_prompts(
            request.query, request.passages, distinct, room=budget
        )
        by_order = dict(zip(distinct, built, strict=True))
        answers = await work.generate([by_order[p] for p in perms], max_new_tokens=budget)
        need_scores(answers, "permutation answers")

        counted = [(s, a) for s, a in enumerate(answers) if a is not None]
        votes = tally([a.text for _, a in counted])
        top = votes[0]
        winners: list[Answer] = [a for _, a in counted if normalize(a.text) == top.form]
        chosen = counted[top.first][0]
        order = list(perms[chosen])
        warnings: list[str] = []
        failed = k - len(counted)
        if failed:
            warnings.append(f"{failed} of {k} permutation answers failed and were not counted")
        return Outcome(
            order=order,
            ranking=list(order),
            answer=VotedAnswer(
                text=top.text,
                votes=top.votes,
                samples=len(counted),
                probability=float(np.mean([a.mean_probability for a in winners])),
            ),
            details={
                "samples": k,
                "counted": len(counted),
                "distinct_answers": len(votes),
                "votes": [{"answer": v.text, "votes": v.votes} for v in votes[:TOP_VOTES]],
                "permutation": chosen,
            },
            warnings=tuple(warnings),
        )


def _permutations(request: ReorderRequest, settings: Settings) -> list[tuple[int, ...]]:
    """The K permutations the request answers, from its seeded random stream."""
    n = len(request.passages)
    rng = rng_for(request, settings)
    return [tuple(int(i) for i in rng.permutation(n)) for _ in range(_samples(request))]


def _samples(request: ReorderRequest) -> int:
    k = request.options.samples
    if k is None:
        return DEFAULT_SAMPLES
    if k < 1:
        raise InvalidRequest(f"samples must be >= 1, not {k}", param="samples")
    return k
