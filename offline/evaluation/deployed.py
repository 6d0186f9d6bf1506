"""``rag-reorder eval --generator-url``: does reordering help *your* generator on *your* data?

The question a team asks before it puts rag-reorder in front of its generator, answered with
what it deploys: the generator it serves (any OpenAI-compatible API, the key from the
environment) answers every question once per order, and the orders come from a running
rag-reorder server through its public API (``--reorder-url``: its default strategy, its
profiles, its engine, exactly as callers get them) or, without a server, from the in-process
scorer. The retriever's order and a shuffle are always among the variants, so every result is
paired against what the team has today and against no order at all.

Rules decided here (docs/evaluation.md, "Your generator, your questions"):

- **Trust, as ``profile-generator``**: the data is checked and the cost estimated before any
  call; ``max_calls`` bounds the generator's HTTP attempts (retries included); calls go through
  ``EngineClient`` (bounded concurrency, timeouts, backoff on 429/502/503/504 honouring
  ``Retry-After``); a refusal of the generator (401, 403, 404, or any other answer retrying will
  not change) stops the run at once with the status. The reorder server's 401/403 stop it too;
  its other 4xx (a strategy that cannot serve the request) are recorded on that variant, which
  is left out of the comparisons, and the run goes on; a rerun asks them again.
- **Resumable**: each (question, variant) is appended to ``answers.jsonl`` as it ends; a rerun
  with the same settings continues, one with other settings in the folder is refused. Orders
  identical within a question are answered once (the baselines and a strategy that keeps the
  retriever's order cost one call).
- **Honest when it cannot tell**: each variant's accuracy has a bootstrap interval, each
  comparison a paired one; when a paired interval holds 0, the verdict says so and how many
  questions would show a difference of ``DETECTABLE`` at the variance observed.
- **Questions in flight**: ``concurrency`` questions at a time, each question's variants one
  after the other (a stateful default such as ``auto`` sees a stream, as in production).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

from offline import run_folder
from offline.evaluation.metrics import MetricName, score_answer
from offline.evaluation.orderers import Orderer, OrderRefused, Target
from offline.evaluation.runner import EvalQuestion, prepare
from offline.evaluation.verdict import build_report, write_report
from offline.generator_api import BudgetedClient, GeneratorEndpoint, parse_answer, run_workers
from service.dataset import Example
from service.errors import InvalidRequest
from service.prompts import api_prompt
from service.templates import PromptTemplate

ANSWERS_FILE = "answers.jsonl"
RUN_FILE = "deployed-run.json"
_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class DeployedJob:
    """One evaluation of a user's generator."""

    endpoint: GeneratorEndpoint
    template: PromptTemplate
    examples: Sequence[Example]
    data_name: str
    targets: tuple[Target, ...]
    out: Path
    max_passages: int | None = None
    max_calls: int | None = None
    metric: MetricName | None = None
    resamples: int = 10_000
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True)
class Estimate:
    questions: int
    variants: int
    done: int
    """(question, variant) pairs already answered in the output folder."""
    todo: int
    max_generator_calls: int
    """At most one call per pair to do (identical orders within a question share one)."""
    approx_prompt_tokens: int
    """Generator prompt tokens of those calls, from their characters (~4 per token)."""


@dataclass(frozen=True)
class DeployedOutcome:
    estimate: Estimate
    generator_calls: int
    attempts: int
    report: dict[str, Any]
    files: tuple[Path, ...]


def _settings(job: DeployedJob, orderer: Orderer) -> dict[str, Any]:
    return {
        "data": job.data_name,
        "generator_url": job.endpoint.base_url,
        "generator_model": job.endpoint.model,
        "api": job.endpoint.api,
        "template": job.template.name,
        "max_tokens": job.endpoint.max_tokens,
        "max_passages": job.max_passages,
        "orderer": orderer.describe,
        "seed": job.seed,
    }


def _done(job: DeployedJob, orderer: Orderer) -> dict[tuple[str, str], dict[str, Any]]:
    """The answers already in the folder, after checking they are this evaluation's.

    Raises:
        InvalidRequest: the folder holds an evaluation with other settings.
    """
    run_folder.claim(job.out, RUN_FILE, _settings(job, orderer), "another evaluation")
    done: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in run_folder.records(job.out / ANSWERS_FILE):
        try:
            key = (str(rec["question_id"]), str(rec["variant"]))
        except (KeyError, TypeError):
            continue  # a record without its key: that pair is done again
        if rec.get("error") is None:
            done[key] = rec
        # A refused order is asked again: the server may serve it now (a profile stored
        # since, a deadline raised); it cost no generator call.
    return done


def check_examples(examples: Sequence[Example], data_name: str) -> None:
    """Every question must have a gold answer to score against.

    Raises:
        InvalidRequest: naming the first line without one.
    """
    for ex in examples:
        if not ex.answers:
            raise InvalidRequest(
                f"{data_name}:{ex.line}: answers: expected at least one gold answer to score "
                "the generator's answer against",
                param="data",
            )


def estimate(
    job: DeployedJob, questions: Sequence[EvalQuestion], done: dict[tuple[str, str], Any]
) -> Estimate:
    """What the run will cost, before any call."""
    pairs = [(q, t) for q in questions for t in job.targets]
    todo = [(q, t) for q, t in pairs if (q.id, t.label) not in done]
    calls = len(todo) if job.max_calls is None else min(len(todo), job.max_calls)
    chars = {q.id: _chars(job.template, q) for q in questions}
    return Estimate(
        questions=len(questions),
        variants=len(job.targets),
        done=len(pairs) - len(todo),
        todo=len(todo),
        max_generator_calls=calls,
        approx_prompt_tokens=sum(chars[q.id] for q, _ in todo[:calls]) // _CHARS_PER_TOKEN,
    )


def _chars(template: PromptTemplate, q: EvalQuestion) -> int:
    prompt = api_prompt(template, q.question, q.passages, range(len(q.passages)))
    return len(prompt.text or "") + sum(len(m.content) for m in prompt.messages or ())


async def run_deployed(
    job: DeployedJob,
    orderer: Orderer,
    *,
    on_estimate: Callable[[Estimate], None] | None = None,
    dry_run: bool = False,
    transport: Any = None,
) -> DeployedOutcome:
    """Order, answer, score and report (module docstring).

    Raises:
        InvalidRequest: bad data or settings, a folder of another evaluation, or the generator
            or reorder server refusing the calls: nothing further is sent.
        EngineUnavailable, EngineTimeout: a server unreachable or too slow after the retries;
            the answers so far are kept and a rerun continues.

    ``dry_run``: estimate and report what is in the folder; call nothing.
    ``transport``: an httpx transport for the generator in place of the network (tests).
    """
    check_examples(job.examples, job.data_name)
    questions = [prepare(ex, job.max_passages, keep_scores=True) for ex in job.examples]
    done = _done(job, orderer)
    est = estimate(job, questions, done)
    if on_estimate is not None:
        on_estimate(est)
    client = BudgetedClient(job.endpoint, job.max_calls, transport)
    calls = 0
    answers_path = job.out / ANSWERS_FILE
    queue: asyncio.Queue[EvalQuestion] = asyncio.Queue()
    for q in questions:
        if any((q.id, t.label) not in done for t in job.targets):
            queue.put_nowait(q)
    stop = asyncio.Event()

    async def answer(q: EvalQuestion, order: list[int]) -> dict[str, Any] | None:
        nonlocal calls
        if client.spent:
            stop.set()  # the budget is spent (retries count): a rerun continues
            return None
        start = time.perf_counter()
        prompt = api_prompt(job.template, q.question, q.passages, order)
        data = await client.answer(prompt, request_id=f"eval-{q.id}")
        calls += 1
        text, _, p_tokens, c_tokens = parse_answer(data)
        return {
            "answer": text,
            "generator_prompt_tokens": p_tokens,
            "generator_completion_tokens": c_tokens,
            "generator_s": round(time.perf_counter() - start, 4),
        }

    async def one_question(q: EvalQuestion, bar: Any) -> None:
        answered = {
            tuple(r["order"]): r
            for (qid, _), r in done.items()
            if qid == q.id and r.get("answer") is not None
        }
        for t in job.targets:
            if (q.id, t.label) in done or stop.is_set():
                continue
            rec: dict[str, Any] = {"question_id": q.id, "variant": t.label}
            try:
                got = await orderer.order(q, t)
            except OrderRefused as exc:
                rec.update(error=str(exc))
            else:
                rec.update(
                    order=got.order,
                    gold_slots=[got.order.index(g) + 1 for g in q.gold],
                    strategy=got.strategy,
                    auto_path=got.path,
                    reorder_s=round(got.seconds, 4),
                    reorder_prompts=got.prompts,
                    reorder_prompt_tokens=got.prompt_tokens,
                )
                prior = answered.get(tuple(got.order))
                if prior is not None:
                    keys = ("answer", "generator_prompt_tokens", "generator_completion_tokens")
                    rec.update({k: prior.get(k) for k in keys}, generator_s=0.0, shared=True)
                else:
                    made = await answer(q, got.order)
                    if made is None:
                        return
                    rec.update(made)
                    answered[tuple(got.order)] = rec
                scores = score_answer(rec["answer"], q.answers)
                rec.update(accuracy=scores.accuracy, em=scores.em, f1=scores.f1)
            with answers_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
            done[(q.id, t.label)] = rec
            bar.update(1)

    async def worker(bar: Any) -> None:
        while not queue.empty() and not stop.is_set():
            await one_question(queue.get_nowait(), bar)

    try:
        if not dry_run:
            quiet = not job.progress
            bar_args = {"desc": "eval", "unit": "answer", "file": sys.stderr, "disable": quiet}
            with tqdm(total=est.todo, **bar_args) as bar:
                await run_workers(job.endpoint.concurrency, lambda: worker(bar))
    finally:
        await client.aclose()
        await orderer.aclose()
    report = build_report(job, questions, done, orderer.describe)
    files = write_report(job.out, report)
    return DeployedOutcome(est, calls, client.attempts, report, files)
