"""Run every strategy variant on a QA set and measure what the generator makes of its order.

For each question and each strategy variant the runner orders the passages through the
serving pipeline (``Reorderer.reorder``), builds the generator's prompt for that order and
measures: the gold answer's teacher-forced log-likelihood per token, the greedy answer's task
metrics, the gold passages' slots and the strategy's cost. Controlled positional runs rotate
the gold passage through every slot among fixed distractors. Each finished (question, variant)
is appended to ``cache.jsonl`` in the output folder, so an interrupted run resumes where it
stopped; the report is written from the cache at the end.

Rules decided here (docs/evaluation.md summarises them):

- **Variants**: every registered strategy with its default options; ``moi`` once per design
  kind x placement, labelled ``moi:<design>:<placement>``. Both placements are applied to one
  MoI run per design (``solver.place`` on its fit): the design is seeded, so a second run would
  score the same prompts and fit the same numbers; the cost and wall time of that run are
  reported for both. The cheap rankers' placed variants (``bm25:litm``,
  ``query_generation:bias_matched``, ...) run through the pipeline with that ``placement``, each
  its own run; ``bias_matched`` places by the generator's stored bias profile
  (``EvalConfig.bias_profile``, else the one stored for the generator's model and template),
  never by the scorer's. With a generator other than the scorer, MoI's fit is also placed by
  that profile (``moi:<design>:generator_bias``: the scorer's utilities, the generator's bias),
  beside the placement by the bias the fit measured on the scorer. A variant that needs the
  generator's profile when none is stored is ``skipped`` with the reason.
- **Skipped, not failed**: a variant whose strategy needs a calibrated profile that does not
  exist (cyclic designs, ``max_relevance``, ``min_distraction``) raises
  ``UnidentifiableRequest``; its record is ``skipped`` with the reason and is not cached (it
  cost nothing, and a later run may find a profile). Any other client error is recorded as
  ``error`` on that record, and the run goes on. ``ScoringFailed`` is recorded but not cached.
- **Passages**: labels never reach a request (only title and text are sent). With
  ``max_passages`` K below a question's N passages, the gold passages are kept, the first
  K - |gold| others in retriever order fill the rest, and each gold passage keeps its relative
  place: slot ``floor(g K / N)`` for input index g (uniform over N stays uniform over K).
- **Generator batch**: a question's strategies run first (one at a time, so each one's wall
  time is its own); then every distinct order among them is answered in one generator batch
  and identical orders are answered once. Each record's generator cost counts its own
  prompts and tokens, with an even share of the batch's wall time.
- **Gold answer**: the first listed answer is the teacher-forced continuation; its
  log-likelihood per token is the sum over its tokens / their number (generator's tokenizer).
  It is scored with the greedy answer from one prefill of the prompt
  (``Work.generate_and_score``): the generator cost counts one prompt per order, of the
  prompt's tokens plus the gold answer's.
- **Positional runs**: the (first) gold passage is moved through slots 1..K; the other K - 1
  passages (a second gold passage included) keep their order. Per slot: the generator's
  answer metrics, the gold answer's log-likelihood per token, and the question's
  log-likelihood per token under the *scoring* model (the quantity MoI reads).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

import solver
from offline.evaluation.metrics import (
    AnswerScores,
    MetricName,
    default_metric,
    gold_ranks,
    score_answer,
)
from offline.evaluation.records import (
    CACHE_FILE,
    GENERATION_FAILED,
    GOLD_SCORING_FAILED,
    POSITIONAL,
    RUN_SETTINGS,
    AnyRecord,
    Cost,
    PositionalRecord,
    Record,
    RecordCache,
    RunKey,
    SlotResult,
    Status,
    run_settings,
)
from offline.evaluation.variants import Variant, all_variants
from service.batch.dataset import Example
from service.errors import ClientError, InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest, ReorderResult
from service.prompting.answers import DEFAULT_MAX_ANSWER_TOKENS
from service.prompting.prompts import BuiltPrompt
from service.state.profile_store import StoredProfile
from service.strategies.request import Answer
from service.strategies.work import Work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalQuestion:
    """A question as the runner uses it: passages without labels, gold indices beside them."""

    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    gold: tuple[int, ...]


def prepare(
    example: Example, max_passages: int | None, *, keep_scores: bool = False
) -> EvalQuestion:
    """Strip labels and cut to ``max_passages`` keeping the gold passages (module rules).

    ``keep_scores``: keep the retriever's scores (a user's data, where "the retriever's order"
    and ``auto``'s ranker read them); the development sets have none."""
    n = len(example.passages)
    clean = [
        Passage(text=p.text, title=p.title, score=p.score if keep_scores else None)
        for p in example.passages
    ]
    if max_passages is None or n <= max_passages:
        return EvalQuestion(
            example.id, example.question, example.answers, tuple(clean), tuple(example.gold)
        )
    k = max_passages
    gold = sorted(set(example.gold))[:k]
    others = [i for i in range(n) if i not in gold][: k - len(gold)]
    slots: list[int] = []
    for g in gold:
        slots.append(max(g * k // n, slots[-1] + 1 if slots else 0))
    for j in range(len(slots) - 1, -1, -1):
        ceiling = k - 1 if j == len(slots) - 1 else slots[j + 1] - 1
        slots[j] = min(slots[j], ceiling)
    picked: list[int | None] = [None] * k
    for g, s in zip(gold, slots, strict=True):
        picked[s] = g
    rest = iter(others)
    chosen = [p if p is not None else next(rest) for p in picked]
    return EvalQuestion(
        example.id,
        example.question,
        example.answers,
        tuple(clean[i] for i in chosen),
        tuple(slots),
    )


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run's settings."""

    out_dir: Path
    variants: tuple[Variant, ...] = field(default_factory=lambda: tuple(all_variants()))
    max_passages: int | None = None
    template: str | None = None
    generator_template: str | None = None
    """The generator's prompt template (default: its model's; the scorer's when one model)."""
    max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS
    positional: bool = True
    positional_limit: int = 10
    metric: MetricName | None = None  # None: EM for multi-gold sets, else NQ accuracy
    resamples: int = 10_000
    seed: int = 0
    progress: bool = True
    data_name: str = ""
    bias_profile: str | None = None
    """The stored profile ``bias_matched`` ranker variants place by (the generator's); None:
    the generator's own stored profile (this slot count, else its data-oriented one)."""
    fresh: bool = False
    """Start afresh: the output folder's earlier records are moved aside, not resumed."""
    cached_only: bool = False
    """Compute nothing: report the questions whose every variant (and positional run, where
    asked) the cache already holds, and leave the others out. The report of a run that is
    not finished, on the questions that are, whichever they are (``--limit`` takes a prefix)."""


@dataclass(frozen=True)
class EvalOutcome:
    """Every record of the run (cached and new) and where the report went."""

    records: tuple[Record, ...]
    positional: tuple[PositionalRecord, ...]
    metric: MetricName
    files: tuple[Path, ...]


@dataclass(frozen=True)
class GeneratedAnswer:
    """What the generator made of one order."""

    answer: str | None
    scores: AnswerScores | None
    gold_logprob: float | None
    gold_tokens: int | None
    cost: Cost
    error: str | None


class Evaluator:
    """Runs an evaluation (module docstring) with a scoring and a generating pipeline.

    Args:
        scorer: the pipeline the strategies run on.
        generator: the pipeline that answers from each order (default: the scorer).
        config: the run's settings.
        on_record: called after each newly computed record is cached (a test hook: raising
            there interrupts the run as a crash would).
    """

    def __init__(
        self,
        scorer: Reorderer,
        config: EvalConfig,
        *,
        generator: Reorderer | None = None,
        on_record: Callable[[AnyRecord], None] | None = None,
    ) -> None:
        self.scorer = scorer
        self.generator = generator or scorer
        self.config = config
        self.on_record = on_record
        self.template = config.template or scorer.settings.chat_template
        own = self.generator is scorer
        self.generator_template = config.generator_template or (
            self.template if own else self.generator.settings.chat_template
        )
        self.cache = RecordCache(config.out_dir / CACHE_FILE)
        self._configured_profile: StoredProfile | None = None
        """``config.bias_profile``'s stored profile, resolved by ``run``."""

    def key(self, question_id: str, variant: str) -> RunKey:
        return RunKey.for_run(
            question_id,
            variant,
            scorer=self.scorer.backend.model_id,
            generator=self.generator.backend.model_id,
            max_passages=self.config.max_passages,
            template=self.template,
            max_answer_tokens=self.config.max_answer_tokens,
            seed=self.scorer.settings.seed,
            generator_template=self.generator_template,
        )

    async def run(self, examples: Sequence[Example]) -> EvalOutcome:
        """Evaluate ``examples``, resuming from the cache, and write the report.

        Raises:
            InvalidRequest: ``bias_profile`` names no stored profile.
            ServerError: the backend failed beyond one question (e.g. it is unavailable).
        """
        from offline.evaluation.plots import write_plots
        from offline.evaluation.rebuild import write_manifest
        from offline.evaluation.report import build_summary, write_report

        cfg = self.config
        if cfg.bias_profile is not None:
            self._configured_profile = self.scorer.profiles.by_id(cfg.bias_profile)
            if self._configured_profile is None:
                known = ", ".join(p.id for p in self.scorer.profiles.list()) or "none stored"
                raise InvalidRequest(
                    f"unknown bias profile {cfg.bias_profile!r}; known: {known}",
                    param="bias_profile",
                )
        questions = [prepare(e, cfg.max_passages) for e in examples]
        self._resume_or_refuse(questions)
        if cfg.cached_only:
            questions = [q for q in questions if self._all_cached(q)]
            log.info(
                "reporting the %d of %d questions the cache finished", len(questions), len(examples)
            )
        metric: MetricName = cfg.metric or default_metric([len(q.gold) for q in questions])
        positional = (
            [q for q in questions if q.gold and len(q.passages) > 1][: cfg.positional_limit]
            if cfg.positional
            else []
        )
        if cfg.cached_only:
            positional = [
                q
                for q in positional
                if isinstance(self.cache.get(self.key(q.id, POSITIONAL)), PositionalRecord)
            ]
        total = len(questions) * len(cfg.variants) + len(positional)
        records: list[Record] = []
        pos_records: list[PositionalRecord] = []
        with tqdm(
            total=total, desc="eval", unit="run", file=sys.stderr, disable=not cfg.progress
        ) as bar:
            for q in questions:
                records.extend(await self._question(q, bar))
            for q in positional:
                pos_records.append(await self._positional(q))
                bar.update(1)
        summary = build_summary(
            records, pos_records, metric, resamples=cfg.resamples, seed=cfg.seed
        )
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "data": cfg.data_name,
            "questions": len(questions),
            "scorer": self.scorer.backend.model_id,
            "generator": self.generator.backend.model_id,
            "template": self.template,
            "generator_template": self.generator_template,
            "max_passages": cfg.max_passages,
            "max_answer_tokens": cfg.max_answer_tokens,
            "metric": metric,
            "seed": self.scorer.settings.seed,
            "resamples": cfg.resamples,
            "variants": [v.label for v in cfg.variants],
            "cached_only": cfg.cached_only,
        }
        files = write_report(cfg.out_dir, meta, records, pos_records, summary)
        files += write_plots(cfg.out_dir, summary)
        files.append(write_manifest(cfg.out_dir, meta, records, pos_records, cfg.seed, self.cache))
        return EvalOutcome(tuple(records), tuple(pos_records), metric, tuple(files))

    def _resume_or_refuse(self, questions: Sequence[EvalQuestion]) -> None:
        """Resume only a run with this run's settings: say how much it resumes, or refuse a
        folder that holds another run's records (their settings named), or with ``fresh``
        move those records aside.

        Raises:
            InvalidRequest: the folder holds records of a run with other settings.
        """
        cfg = self.config
        ours = run_settings(self.key("", ""))
        others = self.cache.run_settings() - {ours}
        if self.cache and (cfg.fresh or others):
            if not cfg.fresh:
                theirs = sorted(others, key=repr)[0]
                differ = ", ".join(
                    f"{name} {old!r} there, {new!r} here"
                    for name, old, new in zip(RUN_SETTINGS, theirs, ours, strict=True)
                    if old != new
                )
                raise InvalidRequest(
                    f"{cfg.out_dir} holds the records of another run ({differ}): choose another "
                    "--out, or pass --fresh to start afresh (the old records are moved aside)",
                    param="out",
                )
            moved = self.cache.set_aside()
            log.warning(
                "--fresh: the earlier records of %s moved to %s",
                cfg.out_dir,
                ", ".join(str(m) for m in moved),
            )
            return
        done = sum(self._all_cached(q) for q in questions)
        if done:
            log.info("resuming %d of %d questions from %s", done, len(questions), self.cache.path)

    def _all_cached(self, q: EvalQuestion) -> bool:
        return all(
            isinstance(self.cache.get(self.key(q.id, v.label)), Record)
            for v in self.config.variants
        )

    # --- one question -----------------------------------------------------------------

    async def _question(self, q: EvalQuestion, bar: Any) -> list[Record]:
        """Run every strategy of one question, then answer all its distinct orders in one
        generator batch (the engine batches them; identical orders are answered once)."""
        out: dict[str, Record] = {}
        ran: list[tuple[Variant, ReorderResult, list[int]]] = []
        for group in _groups(self.config.variants):
            todo = []
            for v in group:
                cached = self.cache.get(self.key(q.id, v.label))
                if isinstance(cached, Record):
                    out[v.label] = cached
                    bar.update(1)
                else:
                    todo.append(v)
            if not todo:
                continue
            for v, outcome in await self._run_group(q, todo):
                if isinstance(outcome, Record):  # skipped or failed: no order to answer
                    out[v.label] = outcome
                    self._finished(outcome)
                    bar.update(1)
                else:
                    ran.append((v, *outcome))
        if ran:
            orders = list(dict.fromkeys(tuple(order) for _, _, order in ran))
            generated = dict(zip(orders, await self.answer_orders(q, orders), strict=True))
            for v, result, order in ran:
                rec = self._record(q, v, result, order, generated[tuple(order)])
                out[v.label] = rec
                self._finished(rec)
                bar.update(1)
        return [out[v.label] for v in self.config.variants]

    def _finished(self, rec: Record) -> None:
        """Cache a new record, except those that cost nothing (skipped: a profile may exist
        next time) or may succeed on a retry (``ScoringFailed``, a failed generator forward)."""
        if rec.status == "skipped" or rec.error_code == ScoringFailed.code or rec.retryable:
            return
        self.cache.add(rec)
        if self.on_record is not None:
            self.on_record(rec)

    async def _run_group(
        self, q: EvalQuestion, group: Sequence[Variant]
    ) -> list[tuple[Variant, tuple[ReorderResult, list[int]] | Record]]:
        """Run a strategy once; for MoI apply each placement of ``group`` to the one fit.

        Returns:
            Per variant, the result and its order, or a finished (skipped/error) record.
        """
        out: list[tuple[Variant, tuple[ReorderResult, list[int]] | Record]] = []
        n = len(q.passages)
        wanted = any(self._by_generator_profile(v) for v in group)
        profile = self._generator_profile(n) if wanted else None
        runnable: list[Variant] = []
        for v in group:
            if self._by_generator_profile(v) and profile is None:
                gen = self.generator.backend.model_id
                reason = (
                    f"no bias profile stored for generator {gen!r}, template "
                    f"{self.generator_template!r}: calibrate it (`rag-reorder --model {gen} "
                    "calibrate`) or name one with --bias-profile"
                )
                out.append((v, self._bare(q, v, "skipped", error=reason)))
            else:
                runnable.append(v)
        if not runnable:
            return out
        first = runnable[0]
        req = ReorderRequest(
            query=q.question,
            passages=q.passages,
            strategy=first.strategy,
            design=DesignSpec(kind=first.design) if first.design else DesignSpec(),
            placement=first.placement,
            bias_profile=(
                profile.id if profile is not None and self._by_generator_profile(first) else None
            ),
            template=self.template,
            request_id=f"eval-{q.id}-{first.label}",
        )
        try:
            result = await self.scorer.reorder(req)
        except (ClientError, ScoringFailed) as exc:
            status: Status = "skipped" if isinstance(exc, UnidentifiableRequest) else "error"
            if status == "error":
                log.warning("%s on %s: %s", first.label, q.id, exc.message)
            return out + [
                (v, self._bare(q, v, status, error=exc.message, error_code=exc.code))
                for v in runnable
            ]
        for v in runnable:
            order = list(result.order)
            if v is not first and v.placement is not None and result.fit is not None:
                if v.by_generator and profile is not None:
                    order = solver.place_ranking(
                        result.fit.order, "bias_matched", profile.coefficients
                    )
                else:
                    order = solver.place(result.fit, v.placement)
            out.append((v, (result, order)))
        return out

    def _by_generator_profile(self, v: Variant) -> bool:
        """Whether ``v`` places by the generator's stored profile (module docstring): the
        ``bias_matched`` ranker variants and MoI's ``generator_bias`` ones. With one model
        for both, a ranker's is left to the pipeline, which falls back to that model's own."""
        if v.by_generator:
            return True
        return (
            v.strategy != "moi"
            and v.placement == "bias_matched"
            and (self.config.bias_profile is not None or self._cross_model)
        )

    @property
    def _cross_model(self) -> bool:
        return self.generator.backend.model_id != self.scorer.backend.model_id

    def _generator_profile(self, n: int) -> StoredProfile | None:
        """The configured profile, else the one stored for the generator's model and *its*
        template (``n`` slots, else its data-oriented one); ``None`` when none is stored."""
        if self._configured_profile is not None:
            return self._configured_profile  # looked up once, by ``run``
        gen = self.generator.backend.model_id
        return self.scorer.profiles.for_slots(gen, self.generator_template, n)

    def _bare(self, q: EvalQuestion, v: Variant, status: Status, **extra: Any) -> Record:
        return Record(
            key=self.key(q.id, v.label),
            strategy=v.strategy,
            design=v.design,
            placement=v.placement,
            status=status,
            n_passages=len(q.passages),
            gold=q.gold,
            **extra,
        )

    def _record(
        self,
        q: EvalQuestion,
        v: Variant,
        result: ReorderResult,
        order: list[int],
        gen: GeneratedAnswer,
    ) -> Record:
        best, mean = gold_ranks(order, q.gold)
        sa = result.answer.text if result.answer is not None else None
        sa_scores = score_answer(sa, q.answers) if sa is not None and q.answers else None
        gs = gen.scores
        return self._bare(
            q,
            v,
            "ok",
            order=tuple(order),
            gold_rank_best=best,
            gold_rank_mean=mean,
            answer=gen.answer,
            gold_logprob=gen.gold_logprob,
            gold_tokens=gen.gold_tokens,
            gold_logprob_per_token=(
                gen.gold_logprob / gen.gold_tokens
                if gen.gold_logprob is not None and gen.gold_tokens
                else None
            ),
            accuracy=gs.accuracy if gs else None,
            em=gs.em if gs else None,
            f1=gs.f1 if gs else None,
            rouge_l=gs.rouge_l if gs else None,
            strategy_answer=sa,
            strategy_answer_accuracy=sa_scores.accuracy if sa_scores else None,
            strategy_answer_em=sa_scores.em if sa_scores else None,
            strategy_answer_f1=sa_scores.f1 if sa_scores else None,
            strategy_answer_rouge_l=sa_scores.rouge_l if sa_scores else None,
            cost=Cost.of(result.usage, result.timing.total_s),
            generator_cost=gen.cost,
            generator_error=gen.error,
            position_bias=(
                tuple(float(a) for a in result.fit.position_bias)
                if result.fit is not None
                else None
            ),
            warnings=result.warnings,
            ranking=tuple(result.ranking),
            adaptive=asdict(result.adaptive) if result.adaptive is not None else None,
        )

    async def answer_orders(
        self, q: EvalQuestion, orders: Sequence[tuple[int, ...]]
    ) -> list[GeneratedAnswer]:
        """Greedy answers and gold log-likelihoods for ``orders``, as one generator batch.

        Each order's generator cost counts its own prompt and tokens (its generation and its
        teacher-forced gold answer, from one prefill); the batch's wall time is shared evenly.
        """
        t0 = time.perf_counter()
        work = self.generator.work(f"eval-{q.id}-gen", self.generator_template)
        try:
            prompts = await work.generation_prompts(
                q.question, q.passages, orders, room=self.config.max_answer_tokens
            )
            answered = await self._answer_and_score(work, prompts, q)
        except ClientError as exc:
            wall = (time.perf_counter() - t0) / len(orders)
            none = Cost(0, 0, 0, 0, 0, 0, wall)
            return [GeneratedAnswer(None, None, None, None, none, exc.message) for _ in orders]
        wall = (time.perf_counter() - t0) / len(orders)
        out = []
        for prompt, (ans, row) in zip(prompts, answered, strict=True):
            text = ans.text if ans is not None else None
            error = None
            if text is None:
                error = GENERATION_FAILED
            elif q.answers and row is None:
                error = GOLD_SCORING_FAILED
            scores = score_answer(text, q.answers) if text is not None and q.answers else None
            n_gold = len(row) if row is not None else 0
            cost = Cost(
                # One forward of the prompt, with the gold answer after it when there is one.
                prompts=1,
                prompts_scored=1 if q.answers else 0,
                prompt_tokens=len(prompt.token_ids) + n_gold,
                scored_tokens=n_gold,
                generations=1,
                generated_tokens=len(ans.token_ids) if ans is not None else 0,
                wall_s=wall,
            )
            out.append(
                GeneratedAnswer(
                    answer=text,
                    scores=scores,
                    gold_logprob=float(sum(row)) if row is not None else None,
                    gold_tokens=n_gold or None,
                    cost=cost,
                    error=error,
                )
            )
        return out

    async def _answer_and_score(
        self, work: Work, prompts: Sequence[BuiltPrompt], q: EvalQuestion
    ) -> list[tuple[Answer | None, tuple[float, ...] | None]]:
        """Per prompt, the greedy answer and the gold answer's log-probs (``None`` where that
        part failed, and always without a gold answer), from one prefill of the prompt."""
        budget = self.config.max_answer_tokens
        if q.answers:
            return await work.generate_and_score(prompts, q.answers[0], max_new_tokens=budget)
        return [(a, None) for a in await work.generate(prompts, max_new_tokens=budget)]

    # --- controlled positional runs ---------------------------------------------------

    async def _positional(self, q: EvalQuestion) -> PositionalRecord:
        key = self.key(q.id, POSITIONAL)
        cached = self.cache.get(key)
        if isinstance(cached, PositionalRecord):
            return cached
        gold = q.gold[0]
        rest = [i for i in range(len(q.passages)) if i != gold]
        orders = [[*rest[:s], gold, *rest[s:]] for s in range(len(q.passages))]
        try:
            slots = await self._rotate(q, orders)
        except (ClientError, ScoringFailed) as exc:
            log.warning("positional run on %s: %s", q.id, exc.message)
            return PositionalRecord(key, "error", len(q.passages), gold, error=exc.message)
        rec = PositionalRecord(key, "ok", len(q.passages), gold, tuple(slots))
        self.cache.add(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    async def _rotate(self, q: EvalQuestion, orders: list[list[int]]) -> list[SlotResult]:
        gwork = self.generator.work(f"eval-{q.id}-pos-gen", self.generator_template)
        prompts = await gwork.generation_prompts(
            q.question, q.passages, orders, room=self.config.max_answer_tokens
        )
        answered = await self._answer_and_score(gwork, prompts, q)
        swork = self.scorer.work(f"eval-{q.id}-pos-score", self.template)
        scored = await swork.score_prompts(
            await swork.scoring_prompts(q.question, q.passages, orders)
        )
        out = []
        for s, ((ans, row), sc) in enumerate(zip(answered, scored, strict=True)):
            text = ans.text if ans is not None else None
            m = score_answer(text, q.answers) if text is not None and q.answers else None
            out.append(
                SlotResult(
                    slot=s + 1,
                    answer=text,
                    accuracy=m.accuracy if m else None,
                    em=m.em if m else None,
                    f1=m.f1 if m else None,
                    rouge_l=m.rouge_l if m else None,
                    gold_logprob_per_token=float(sum(row)) / len(row) if row else None,
                    question_logprob_per_token=(
                        float(sc.query.mean()) if sc is not None and sc.query.size else None
                    ),
                )
            )
        return out


def _groups(variants: Iterable[Variant]) -> list[list[Variant]]:
    """Variants that share one strategy run: MoI variants of one design; others alone."""
    groups: dict[tuple[str, str | None], list[Variant]] = {}
    for v in variants:
        key = (v.strategy, v.design) if v.strategy == "moi" else (v.label, None)
        groups.setdefault(key, []).append(v)
    return list(groups.values())


async def run_evaluation(
    examples: Sequence[Example],
    scorer: Reorderer,
    config: EvalConfig,
    *,
    generator: Reorderer | None = None,
    on_record: Callable[[AnyRecord], None] | None = None,
) -> EvalOutcome:
    """Evaluate ``examples`` (see ``Evaluator``) and write the report into ``config.out_dir``.

    Returns:
        Every record and the files written (``results.json``, ``summary.md``, the plots).
    """
    return await Evaluator(scorer, config, generator=generator, on_record=on_record).run(examples)
