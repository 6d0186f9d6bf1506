"""``rag-reorder distill-eval``: does the distilled student keep the teacher's gain, and at what
cost? On questions not used in training:

1. Agreement: MoI (the serving pipeline, one design for all scorers) is run with the teacher,
   the raw student and the distilled student as scorers; the students' utilities are compared
   with the teacher's (Kendall tau, same top passage).
2. Quality: the generator (the teacher model) answers with each scorer's order and with a
   seeded shuffle; NQ accuracy and the gold answer's mean per-token log-likelihood per order,
   with paired bootstrap intervals against the shuffle and the teacher.
3. Cost: each scorer's prompt tokens and scoring seconds per question, measured in the same
   run on the same machine.

Results are appended to ``records.jsonl`` as each is computed (a rerun resumes), and summarised
in ``summary.json``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import numpy as np
from scipy.stats import kendalltau

from offline.evaluation.runner import EvalQuestion, prepare
from offline.evaluation.stats import bootstrap_mean_ci, paired_comparison
from service.batch.dataset import Example
from service.pipeline import Reorderer
from service.prompting.answers import nq_accuracy
from service.strategies.request import DesignSpec, ReorderRequest

SHUFFLE = "shuffle"
TEACHER = "teacher"


@dataclass(frozen=True)
class MeasureConfig:
    out: Path
    passages: int = 4
    design: str = "random"
    num_prompts: int | None = None
    seed: int = 0
    max_answer_tokens: int = 16
    resamples: int = 10_000
    concurrency: int = 1
    """Questions measured at once: their scoring prompts share forwards (a GPU needs that to
    stay busy; on a CPU one question already fills them)."""


async def measure(
    examples: Sequence[Example],
    scorers: Mapping[str, Reorderer],
    generator: Reorderer,
    config: MeasureConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, object]:
    """Run (or resume) the three measurements and write ``summary.json``.

    Args:
        examples: development questions, none of them used in training.
        scorers: name -> scoring pipeline; must include ``"teacher"``.
        generator: the answering pipeline (the teacher model).
        config: sizes and the output folder.
        progress: called with (done, total) after each question.

    Returns:
        The summary written.
    """
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / "records.jsonl"
    done: dict[tuple[str, str, str], dict[str, object]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted run: computed again
            done[(rec["kind"], rec["name"], rec["id"])] = rec
    with path.open("a", encoding="utf-8") as fh:

        def keep(rec: dict[str, object]) -> None:
            done[(str(rec["kind"]), str(rec["name"]), str(rec["id"]))] = rec
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        finished = 0
        gate = anyio.Semaphore(config.concurrency)

        async def one(ex: Example) -> None:
            nonlocal finished
            async with gate:
                question = prepare(ex, config.passages)
                orders: dict[str, list[int]] = {SHUFFLE: _shuffle(question, config.seed)}
                for name, scorer in scorers.items():
                    rec = done.get(("order", name, ex.id))
                    if rec is None:
                        rec = await _order(scorer, question, name, config)
                        keep(rec)
                    orders[name] = [int(i) for i in rec["order"]]  # type: ignore[attr-defined]
                for name, order in orders.items():
                    if ("answer", name, ex.id) not in done:
                        keep(await _answer(generator, question, name, order, config))
            finished += 1
            if progress is not None:
                progress(finished, len(examples))

        async with anyio.create_task_group() as tg:
            for ex in examples:
                tg.start_soon(one, ex)
    summary = summarise(done, list(scorers), [ex.id for ex in examples], config)
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", "utf-8")
    return summary


def _shuffle(question: EvalQuestion, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, len(question.passages), *map(ord, question.id[-8:])])
    return [int(i) for i in rng.permutation(len(question.passages))]


async def _order(
    scorer: Reorderer, question: EvalQuestion, name: str, config: MeasureConfig
) -> dict[str, object]:
    t0 = time.perf_counter()
    result = await scorer.reorder(
        ReorderRequest(
            query=question.question,
            passages=question.passages,
            design=DesignSpec(
                kind=config.design,  # type: ignore[arg-type]
                num_prompts=config.num_prompts,
                seed=config.seed,
            ),
            request_id=f"{name}-{question.id}",
        )
    )
    utilities = [] if result.fit is None else [float(u) for u in result.fit.utilities]
    return {
        "kind": "order",
        "name": name,
        "id": question.id,
        "model": result.model,
        "order": result.order,
        "ranking": result.ranking,
        "utilities": utilities,
        "prompts": result.usage.prompts_scored,
        "prompt_tokens": result.usage.prompt_tokens,
        "scoring_s": result.timing.scoring_s,
        "total_s": time.perf_counter() - t0,
    }


async def _answer(
    generator: Reorderer,
    question: EvalQuestion,
    name: str,
    order: list[int],
    config: MeasureConfig,
) -> dict[str, object]:
    work = generator.work(f"gen-{name}-{question.id}")
    prompts = await work.generation_prompts(
        question.question, question.passages, [order], room=config.max_answer_tokens
    )
    gold = next((a for a in question.answers if a.strip()), "")
    budget = config.max_answer_tokens
    if gold:  # the answer and the gold answer's log-probs from one prefill
        ((answer, row),) = await work.generate_and_score(prompts, gold, max_new_tokens=budget)
    else:
        answer, row = (await work.generate(prompts, max_new_tokens=budget))[0], None
    return {
        "kind": "answer",
        "name": name,
        "id": question.id,
        "order": order,
        "gold_slot": next((order.index(g) for g in question.gold), None),
        "accuracy": None if answer is None else nq_accuracy(answer.text, question.answers),
        "gold_logprob": None if row is None else float(np.mean(row)),
    }


def summarise(
    done: Mapping[tuple[str, str, str], Mapping[str, object]],
    scorers: Sequence[str],
    ids: Sequence[str],
    config: MeasureConfig,
) -> dict[str, object]:
    """Agreement, quality and cost over the questions every variant has (module docstring)."""
    variants = [SHUFFLE, *scorers]
    complete = [
        i
        for i in ids
        if all(("order", s, i) in done for s in scorers)
        and all(("answer", v, i) in done for v in variants)
    ]

    def value(kind: str, name: str, i: str, key: str) -> float:
        v = done[(kind, name, i)][key]
        return float(v) if isinstance(v, int | float) else math.nan

    out: dict[str, object] = {
        "questions": len(complete),
        "passages": config.passages,
        "design": config.design,
        # Above 1, a question's scoring_s includes waiting on the others' shared forwards: a
        # latency under load, not the scorer's cost alone.
        "concurrency": config.concurrency,
        "models": {s: done[("order", s, complete[0])]["model"] for s in scorers}
        if complete
        else {},
    }
    agreement: dict[str, object] = {}
    for s in scorers:
        if s == TEACHER or not complete:
            continue
        taus, tops = [], []
        for i in complete:
            u_t = np.asarray(done[("order", TEACHER, i)]["utilities"], dtype=float)
            u_s = np.asarray(done[("order", s, i)]["utilities"], dtype=float)
            tau = kendalltau(u_s, u_t).statistic
            taus.append(float(tau) if math.isfinite(tau) else 0.0)
            tops.append(float(int(np.argmax(u_s)) == int(np.argmax(u_t))))
        agreement[s] = {
            "kendall_tau": asdict(bootstrap_mean_ci(taus, resamples=config.resamples)),
            "same_top": asdict(bootstrap_mean_ci(tops, resamples=config.resamples)),
        }
    out["agreement_with_teacher"] = agreement
    quality: dict[str, object] = {}
    comparisons: list[object] = []
    for metric in ("accuracy", "gold_logprob"):
        per: dict[str, list[float]] = {
            v: [value("answer", v, i, metric) for i in complete] for v in variants
        }
        usable = [k for k in range(len(complete)) if all(math.isfinite(per[v][k]) for v in per)]
        quality[metric] = {
            v: asdict(bootstrap_mean_ci([per[v][k] for k in usable], resamples=config.resamples))
            for v in variants
            if usable
        }
        for baseline in (SHUFFLE, TEACHER):
            for v in variants:
                if v == baseline or not usable:
                    continue
                pairs = [(per[v][k], per[baseline][k]) for k in usable]
                comparisons.append(
                    asdict(
                        paired_comparison(metric, v, baseline, pairs, resamples=config.resamples)
                    )
                )
        if usable and TEACHER in per:
            gain = np.mean([per[TEACHER][k] - per[SHUFFLE][k] for k in usable])
            quality[f"{metric}_gain_kept"] = {
                v: (
                    float(np.mean([per[v][k] - per[SHUFFLE][k] for k in usable]) / gain)
                    if gain != 0
                    else None
                )
                for v in scorers
                if v != TEACHER
            }
    out["quality"] = quality
    out["comparisons"] = comparisons
    out["cost_per_question"] = {
        s: {
            "prompts": float(np.mean([value("order", s, i, "prompts") for i in complete])),
            "prompt_tokens": float(
                np.mean([value("order", s, i, "prompt_tokens") for i in complete])
            ),
            "scoring_s": float(np.mean([value("order", s, i, "scoring_s") for i in complete])),
        }
        for s in scorers
        if complete
    }
    return out
