"""Positional profiles: the controlled measurement of Cuconasu et al. section 4, offline.

``rag-reorder calibrate-positions`` runs it; the distracting effect it reads is defined and
computed in ``service.strategies.distraction`` (the strategies that use the profiles).

Positional profiles (004 section 4, the controlled setting), per (model, answering template,
slot count k), measured on a QA set with gold labels (``service.batch.dataset``) and stored by
``service.state.positional_store``. Per question:

1. Every non-gold passage of the question (all of them, not only the first k) gets its
   single-passage DE. Passages whose prompt failed are left out of the pool.
2. The pool sorted by (DE, index): the k-1 lowest are the weak distractors, kept in their
   input (retriever) order for every prompt; the highest of the rest is the hard distractor.
   004 requires DE < 0.2 (weak) and DE > 0.8 (hard); when a question has fewer qualifying
   passages the lowest / highest available are used anyway (a small model rarely reaches 0.8),
   and the record counts the questions that did qualify (``weak_distractors``,
   ``hard_distractors``), so a profile built from soft distractors says so.
3. Accuracy profile: the gold passage (the first gold index: the retriever's best relevant
   passage) rotated through slots 1..k among the weak distractors, ``order = weak[:j] +
   [gold] + weak[j:]``; the greedy answer under the answering template scored by
   ``service.prompting.answers.nq_accuracy``; and the mean per-token log-likelihood of the first
   gold answer, teacher forced after the same prompt (informative when a small model's accuracy is
   flat).
4. Distracting-effect profile: the hard distractor rotated the same way among the same weak
   distractors; DE of the whole set of k passages under ``qa_abstain`` (footnote 6).

A question is used when it has a gold passage, gold answers and at least k measured non-gold
passages (k-1 weak plus one hard); others are skipped and counted. Each profile is the mean
over the used questions of its per-slot values, with the standard error of that mean; a
question whose prompts failed in one profile is left out of that profile only (all its slots,
so every slot averages the same questions).

Cost per question of P non-gold passages: P short scored prompts, k generations (each also
scores the gold answer from its prefill: ``Work.generate_and_score``) and k scored prompts
(the DE of the set).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.batch.dataset import Example
from service.errors import InvalidRequest, LimitExceeded
from service.pipeline import Reorderer
from service.prompting.answers import DEFAULT_MAX_ANSWER_TOKENS, nq_accuracy
from service.state.positional_store import PositionalRecord, PositionalStore, SlotMeans, now_fields
from service.strategies.distraction import (
    ABSTAIN_TEMPLATE,
    HARD_DE,
    WEAK_DE,
    passage_effects,
    set_effects,
)
from service.strategies.work import Work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PositionalReport:
    record: PositionalRecord
    prompts: int
    """Model calls: scored prompts and generations."""
    prompts_failed: int
    generated_tokens: int


@dataclass
class _Sums:
    """Per-question rows of one profile; a question with a failed prompt adds no row."""

    rows: list[list[float]]

    def means(self, slots: int) -> SlotMeans | None:
        if not self.rows:
            return None
        a = np.asarray(self.rows, dtype=np.float64).reshape(-1, slots)
        n = a.shape[0]
        err: tuple[float | None, ...] = (
            tuple(float(e) for e in a.std(axis=0, ddof=1) / math.sqrt(n))
            if n >= 2
            else (None,) * slots
        )
        return SlotMeans(values=tuple(float(v) for v in a.mean(axis=0)), stderr=err, questions=n)


def rotations(fixed: Sequence[int], moving: int) -> list[tuple[int, ...]]:
    """``moving`` in each slot 0..len(fixed) with ``fixed`` in its own order around it."""
    return [(*fixed[:j], moving, *fixed[j:]) for j in range(len(fixed) + 1)]


async def calibrate_positions(
    reorderer: Reorderer,
    examples: Sequence[Example],
    *,
    max_passages: int,
    template: str | None = None,
    max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS,
    source: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> PositionalReport:
    """Measure and store the accuracy and distracting-effect profiles (module docstring).

    Args:
        reorderer: the serving pipeline (its backend and, beside its ``ProfileStore``, the
            positional store are used).
        examples: questions with gold labels and answers.
        max_passages: k, the slot count of the profiles (gold or hard distractor plus k-1
            weak distractors per prompt).
        template: the answering template the profiles are for (default: the configured one).
        max_answer_tokens: generation budget of the greedy answers.
        source: provenance recorded with the profiles (the data file's name).
        progress: called with (done, total) after each question.

    Returns:
        The stored record and the cost of measuring it.

    Raises:
        InvalidRequest: ``max_passages`` < 1, or no question was usable for both profiles.
    """
    k = max_passages
    if k < 1:
        raise InvalidRequest("max_passages must be at least 1", param="max_passages")
    if max_answer_tokens < 1:
        raise InvalidRequest("max_answer_tokens must be at least 1", param="max_answer_tokens")
    template = template or reorderer.settings.chat_template
    skipped: dict[str, int] = {}
    accuracy, loglik, effect = _Sums([]), _Sums([]), _Sums([])
    used = hard = weak = 0
    prompts = failed = generated = 0
    for q, ex in enumerate(examples):
        work = reorderer.work(f"positions-{q}", template)
        try:
            outcome = await _measure(work, ex, k, max_answer_tokens)
        except LimitExceeded:
            outcome = "a prompt is longer than the model's context"
        finally:
            usage = work.usage()
            prompts += usage.prompts
            failed += usage.prompts_failed
            generated += usage.generated_tokens
            if progress is not None:
                progress(q + 1, len(examples))
        if isinstance(outcome, str):
            skipped[outcome] = skipped.get(outcome, 0) + 1
            continue
        used += 1
        hard += outcome.hard
        weak += outcome.weak
        for sums, row in (
            (accuracy, outcome.accuracy),
            (loglik, outcome.loglik),
            (effect, outcome.effect),
        ):
            if row is not None:
                sums.rows.append(row)

    warnings = [f"{n} question(s) skipped: {why}" for why, n in sorted(skipped.items())]
    acc, ll, de_means = accuracy.means(k), loglik.means(k), effect.means(k)
    if acc is None or ll is None or de_means is None:
        missing = [
            name
            for name, m in (
                ("accuracy", acc),
                ("answer_logprob", ll),
                ("distracting_effect", de_means),
            )
            if m is None
        ]
        detail = "; ".join(warnings) or "every question's prompts failed"
        raise InvalidRequest(
            f"no usable question for the {', '.join(missing)} profile at {k} slots "
            f"(each needs a gold passage, answers and at least {k} non-gold passages): {detail}",
            param="data",
        )
    profiles = {"accuracy": acc, "answer_logprob": ll, "distracting_effect": de_means}
    for name, m in profiles.items():
        if m.questions < used:
            warnings.append(f"{used - m.questions} question(s) left out of {name}: prompts failed")
    if hard < used:
        warnings.append(
            f"{used - hard} of {used} question(s) had no distractor with DE > {HARD_DE}; "
            "their hardest one was used"
        )
    if weak < used:
        warnings.append(
            f"{used - weak} of {used} question(s) had fewer than {k - 1} distractors with "
            f"DE < {WEAK_DE}; their least distracting ones were used"
        )
    created_at, created = now_fields()
    record = PositionalRecord(
        model=reorderer.backend.model_id,
        template=template,
        slots=k,
        accuracy=acc,
        answer_logprob=ll,
        distracting_effect=de_means,
        de_template=ABSTAIN_TEMPLATE,
        source=source,
        questions=used,
        skipped=sum(skipped.values()),
        hard_distractors=hard,
        weak_distractors=weak,
        max_answer_tokens=max_answer_tokens,
        created_at=created_at,
        created=created,
        warnings=tuple(warnings),
    )
    PositionalStore.beside(reorderer.profiles).put(record)
    log.info(
        "stored positional profiles for %s / %s / k=%d from %d question(s)",
        record.model,
        template,
        k,
        used,
    )
    return PositionalReport(record, prompts, failed, generated)


@dataclass(frozen=True)
class _Question:
    """One used question's rows (``None``: a prompt of that profile failed)."""

    hard: bool
    weak: bool
    accuracy: list[float] | None
    loglik: list[float] | None
    effect: list[float] | None


async def _measure(work: Work, ex: Example, k: int, max_answer_tokens: int) -> _Question | str:
    """Steps 1-4 of the module docstring for one question, or why it cannot be used."""
    if not ex.gold:
        return "no gold passage"
    gold_answer = next((a for a in ex.answers if a.strip()), None)
    if gold_answer is None:
        return "no gold answer"
    gold = ex.gold[0]
    labelled = set(ex.gold)
    pool = [i for i in range(len(ex.passages)) if i not in labelled]
    if len(pool) < k:
        return f"fewer than {k} non-gold passages"
    single = await passage_effects(work, ex.question, ex.passages, pool)
    measured = sorted((float(d), i) for d, i in zip(single, pool, strict=True) if math.isfinite(d))
    if len(measured) < k:
        return f"fewer than {k} non-gold passages with a measured DE"
    hard_de, hard_idx = measured[-1]
    # Input (retriever) order, the same in every prompt of the question.
    fixed = sorted(i for _, i in measured[: k - 1])

    answering = await work.generation_prompts(
        ex.question, ex.passages, rotations(fixed, gold), room=max_answer_tokens
    )
    # Each answer and the gold answer's log-probs from one prefill of its prompt.
    answered = await work.generate_and_score(
        answering, gold_answer, max_new_tokens=max_answer_tokens
    )
    accuracy = [nq_accuracy(a.text, ex.answers) for a, _ in answered if a is not None]
    loglik = [float(np.mean(r)) for _, r in answered if r is not None]
    de = await set_effects(work, ex.question, ex.passages, rotations(fixed, hard_idx))
    return _Question(
        hard=hard_de > HARD_DE,
        weak=all(d < WEAK_DE for d, _ in measured[: k - 1]),
        accuracy=accuracy if len(accuracy) == k else None,
        loglik=loglik if len(loglik) == k else None,
        effect=[float(d) for d in de] if bool(np.all(np.isfinite(de))) else None,
    )
