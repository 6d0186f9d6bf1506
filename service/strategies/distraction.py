"""``max_relevance`` and ``min_distraction``: placements by a measured positional profile
(Cuconasu et al. section 5, strategies (iv) and (v)).

Both read the profile stored for (model, the request's template, N slots) by ``rag-reorder
calibrate-positions`` (``offline.positions``); without one the request is refused
(``UnidentifiableRequest``, 422) before any model call. A profile is measured, never assumed.
With a single passage there is nothing to place: no profile is needed (it is reported when
stored).

``max_relevance`` (004 (iv)): slots sorted by decreasing positional accuracy (ties: the earlier
slot first); the retriever's rank-r passage (``retriever_ranking``) goes into the r-th best
slot. With 004 footnote 7's profile order 5, 1, 4, 3, 2 the retriever's best passage goes last,
its second first, and so on. No model call; ``ranking`` is the retriever's, no ``scores``.

``min_distraction`` (004 (v)): every passage's single-passage distracting effect
DE = 1 - P(NO-RESPONSE | query, passage) under ``qa_abstain`` (N scored prompts; reported as
``distracting_effect``); passages by decreasing DE (ties: retriever order) fill the slots by
increasing positional DE (ties: the earlier slot first), so the most distracting passage takes
the slot where a distractor does least harm. Decided here:

- 004 does not measure DE at request time: it assumes the retriever ranks by decreasing DE and
  places the retriever's order. This strategy measures it instead. The consequence: DE is the
  model's readiness to answer, so a passage that contains the answer has a high DE too (004
  sets DE = 0 for relevant passages only because its judge labels them). A relevant passage is
  therefore placed like a hard distractor, into the least influential slots; this is the
  strategy as specified, and the reason 004 finds it no better than a shuffle.
- ``ranking`` is the retriever's, and there are no ``scores``: DE orders distraction, not
  relevance (by -DE the passage with the answer would come last, by DE the hardest distractor
  first), so it is no "best first" judgement and a ``top_n`` cut or a rerank by it would drop
  the wrong passages. The DE order is in ``details.distraction_ranking``.
- A passage whose DE prompt failed (DE null) is ranked after every measured one, in retriever
  order among themselves; the request fails (``ScoringFailed``) only when all N failed.
- DE prompts always use ``qa_abstain`` (the measurement's instruction); the request's template
  only selects the profile, which was measured for the answering template it names.

Distracting effect. ``DE_q(p) = 1 - P("NO-RESPONSE" | q, p)`` under the ``qa_abstain``
template (``service.prompting.prompts``: answer from the documents or reply NO-RESPONSE; Amiraz et
al. 2025 as used by 004). ``P`` is read by teacher forcing, never by sampling: the text
``NO-RESPONSE``, tokenised on its own, is appended to the generation prompt (the assistant turn
left open) and ``P = exp(sum of its tokens' log-probs)`` (``Work.continuation_logprobs``).
Rules the papers leave loose, decided here:

- The end-of-turn token is NOT part of the event: ``P`` is the probability that the reply
  starts with ``NO-RESPONSE``, not that it is exactly ``NO-RESPONSE`` and stops. A model that
  abstains with ``NO-RESPONSE.`` or ``NO-RESPONSE\\n(explanation)`` has abstained; the stricter
  event would count those as answers and inflate DE. No real answer starts with that string,
  so the looser event does not count answers as abstentions. (The stop event is also not one
  token: a chat model has several end tokens, whose probabilities would have to be summed.)
- Only the canonical tokenisation of ``NO-RESPONSE`` is scored; other tokenisations of the
  same text carry (negligible) probability that is not added, so ``P`` is a lower bound and DE
  an upper bound, by the same margin for every passage of a model.
- DE is computed for one passage (the strategies, the choice of weak and hard distractors) or
  for a whole ordered set (004 footnote 6: the distracting-effect profile). It is the model's
  readiness to answer, so a relevant passage has a high DE too (004 sets DE = 0 for relevant
  passages only because it knows which they are; the service does not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from service.config.settings import Settings
from service.errors import UnidentifiableRequest
from service.passage import Passage
from service.state.positional_store import PositionalRecord, PositionalStore
from service.strategies.protocol import Reference
from service.strategies.request import (
    Calls,
    Cost,
    Outcome,
    PositionalProfile,
    ReorderRequest,
    descending,
    need_scores,
    retriever_ranking,
)
from service.strategies.work import Work

NO_RESPONSE = "NO-RESPONSE"
"""The abstention the ``qa_abstain`` template asks for."""
ABSTAIN_TEMPLATE = "qa_abstain"
HARD_DE = 0.8
"""004: a distractor with DE above this is hard."""
WEAK_DE = 0.2
"""004: a distractor with DE below this is weak."""


def distracting_effect(logprobs: Sequence[float] | None) -> float:
    """``1 - exp(sum(logprobs))``: DE from the log-probs of the tokens of ``NO-RESPONSE``;
    NaN for a failed prompt (``None``). In [0, 1]: backends clip log-probs to <= 0."""
    if logprobs is None:
        return math.nan
    return float(-math.expm1(min(math.fsum(logprobs), 0.0)))


async def set_effects(
    work: Work,
    query: str,
    passages: Sequence[Passage],
    orders: Sequence[Sequence[int]],
) -> np.ndarray:
    """DE of each ordered set of passages: one ``qa_abstain`` prompt per order.

    Returns:
        One DE per order, NaN where the prompt failed.

    Raises:
        InvalidRequest, LimitExceeded, PromptAlignmentError: as prompt building.
    """
    if not orders:
        return np.zeros(0)
    room = len(work.backend.tokenizer.encode(NO_RESPONSE).ids)
    prompts = await work.generation_prompts(
        query, passages, orders, template=ABSTAIN_TEMPLATE, room=room
    )
    rows = await work.continuation_logprobs(prompts, NO_RESPONSE)
    return np.asarray([distracting_effect(r) for r in rows], dtype=np.float64)


async def passage_effects(
    work: Work, query: str, passages: Sequence[Passage], indices: Sequence[int] | None = None
) -> np.ndarray:
    """Single-passage DE of ``passages[i]`` for each ``i`` in ``indices`` (default: all).

    Returns:
        One DE per index, NaN where the prompt failed.
    """
    chosen = range(len(passages)) if indices is None else indices
    return await set_effects(work, query, passages, [(i,) for i in chosen])


def slot_preference(values: Sequence[float], *, best: Literal["high", "low"]) -> list[int]:
    """Slots best first: by decreasing value (``best="high"``) or increasing (``"low"``);
    ties (and only ties) keep the earlier slot first."""
    sign = -1.0 if best == "high" else 1.0
    return sorted(range(len(values)), key=lambda j: (sign * float(values[j]), j))


def fill_slots(passages_best_first: Sequence[int], slots_best_first: Sequence[int]) -> list[int]:
    """The order that puts the r-th passage into the r-th slot."""
    order = [-1] * len(slots_best_first)
    for passage, slot in zip(passages_best_first, slots_best_first, strict=True):
        order[slot] = passage
    return order


def as_profile(
    record: PositionalRecord, kind: Literal["accuracy", "distracting_effect"]
) -> PositionalProfile:
    """The stored record's ``accuracy`` or ``distracting_effect`` profile, as reported."""
    means = record.accuracy if kind == "accuracy" else record.distracting_effect
    return PositionalProfile(
        kind=kind,
        model=record.model,
        template=record.template,
        slots=record.slots,
        values=means.values,
        questions=means.questions,
    )


def stored_record(work: Work, strategy: str, n: int) -> PositionalRecord | None:
    """The positional profiles for (model, the request's template, ``n`` slots).

    Returns:
        The record; ``None`` only when ``n`` is 1 and none is stored.

    Raises:
        UnidentifiableRequest: ``n`` > 1 and no profile is stored (names the command to run).
        CorruptPositionalProfile: the stored file is unreadable.
    """
    record = PositionalStore.beside(work.profiles).get(work.model_id, work.template, n)
    if record is None and n > 1:
        raise UnidentifiableRequest(
            f"strategy {strategy!r} needs a positional profile measured for model "
            f"{work.model_id!r}, template {work.template!r} and {n} slots, and none is stored; "
            f"run `rag-reorder calibrate-positions --data FILE --max-passages {n} "
            f"--template {work.template}` on a QA set with gold labels",
            param="strategy",
        )
    return record


class MaxRelevance:
    """004 (iv): the retriever's best passages into the slots of highest positional accuracy."""

    name = "max_relevance"
    reference = Reference(
        source="Cuconasu et al., iv",
        rule=(
            "the retriever's r-th passage into the r-th best slot of the measured positional "
            "accuracy profile"
        ),
        calls="0 (needs a stored profile for N slots)",
        returns="`positional_profile`",
    )
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = False

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        return Cost()

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        n = len(request.passages)
        record = stored_record(work, self.name, n)
        ranking = retriever_ranking(request.passages)
        if record is None:
            return Outcome(order=list(ranking), ranking=ranking, slots=n)
        slots = slot_preference(record.accuracy.values, best="high")
        return Outcome(
            order=fill_slots(ranking, slots),
            ranking=ranking,
            slots=n,
            positional_profile=as_profile(record, "accuracy"),
            details={
                "slot_preference": slots,
                "answer_logprob_profile": list(record.answer_logprob.values),
            },
        )


class MinDistraction:
    """004 (v): the most distracting passages into the slots of lowest positional DE."""

    name = "min_distraction"
    reference = Reference(
        source="Cuconasu et al., v",
        rule=(
            "passages by decreasing distracting effect (DE) into slots by increasing measured "
            "positional DE"
        ),
        calls="N scored prompts of 1 passage (`qa_abstain`)",
        returns="`passages[].distracting_effect`, `positional_profile`",
    )
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = False

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        # One abstain prompt per passage, NO-RESPONSE teacher-forced after it
        # (``passage_effects``), whatever the request's template.
        calls = Calls(len(request.passages), 1, template=ABSTAIN_TEMPLATE, continuation=NO_RESPONSE)
        return Cost((calls,))

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        passages = request.passages
        n = len(passages)
        record = stored_record(work, self.name, n)  # refuse before any model call
        de = await passage_effects(work, request.query, passages)
        need_scores([None if np.isnan(d) else d for d in de], "distracting-effect prompts")
        ranking = retriever_ranking(passages)
        by_de = descending(de, ranking)
        warnings: list[str] = []
        failed = int(np.isnan(de).sum())
        if failed:
            warnings.append(
                f"{failed} distracting-effect prompt(s) failed; those passages were ranked as "
                "the least distracting"
            )
        details: dict[str, object] = {"distraction_ranking": by_de, "de_template": ABSTAIN_TEMPLATE}
        if record is None:
            return Outcome(
                order=list(by_de),
                ranking=ranking,
                slots=n,
                distracting_effect=de,
                details=details,
                warnings=tuple(warnings),
            )
        slots = slot_preference(record.distracting_effect.values, best="low")
        details["slot_preference"] = slots
        return Outcome(
            order=fill_slots(by_de, slots),
            ranking=ranking,
            slots=n,
            positional_profile=as_profile(record, "distracting_effect"),
            distracting_effect=de,
            details=details,
            warnings=tuple(warnings),
        )
