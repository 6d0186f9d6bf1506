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
  call; ``max_calls`` is a hard bound on the generator's HTTP attempts (retries included: the
  attempt that would pass it is never sent); calls go through ``EngineClient`` (bounded
  concurrency, timeouts, backoff on 429/503 and refused connections honouring
  ``Retry-After``; a 502/504 or a call cut mid-way is not retried, since it may have been
  paid); a refusal of the generator (401, 403, 404, or any other answer retrying will not
  change) stops the run at once. A generator call that fails after its retries (a 502/504,
  a timeout, the generator unreachable) is recorded failed on that question and variant and
  the run goes on, until ``GENERATOR_FAILURES_IN_A_ROW`` fail with no answer between: then it
  stops (the generator is down, or loses answers it may have been paid for). The reorder
  server's 401/403/404 stop it too; its other answers are retried or recorded on that
  question and variant (``orderers`` module rules), and the run goes on.
- **Resumable**: each (question, variant) is appended to ``answers.jsonl`` as it ends (a torn
  last line is skipped and never glued to the next record); a rerun with the same settings
  (the generator, the orderer's identity, the data file's hash) continues, one with other
  settings in the folder is refused. A refused or failed order is asked again by a rerun (it
  cost no generator call). Orders identical within a question are answered once (the
  baselines and a strategy that keeps the retriever's order cost one call).
- **Honest when it cannot tell**: each variant's accuracy has a bootstrap interval, each
  comparison a paired one and an exact test (``verdict`` module rules), on the questions
  every compared variant answered; the report counts what was refused, failed or left out.
- **Questions in flight**: ``concurrency`` questions at a time, each question's variants one
  after the other (a stateful default such as ``auto`` sees a stream, as in production).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

from offline import run_folder
from offline.evaluation.metrics import MetricName, score_answer
from offline.evaluation.orderers import Orderer, OrderRefused, Target
from offline.evaluation.runner import EvalQuestion, prepare
from offline.evaluation.verdict import build_report, write_report
from offline.generator_api import (
    BudgetedClient,
    BudgetSpent,
    GeneratorEndpoint,
    parse_answer,
    public_url,
    run_workers,
)
from service.batch.dataset import Example
from service.errors import EngineTimeout, EngineUnavailable, InvalidRequest
from service.prompting.prompts import api_prompt
from service.prompting.templates import PromptTemplate

log = logging.getLogger(__name__)

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
    data_sha256: str | None = None
    """The data file's hash (the settings check's identity of the data); None: a hash of
    ``examples`` (a caller without a file)."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (the data's identity in the run folder)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_identity(job: DeployedJob) -> str:
    if job.data_sha256 is not None:
        return job.data_sha256
    digest = hashlib.sha256()
    for ex in job.examples:
        digest.update(json.dumps(asdict(ex), sort_keys=True, default=str).encode())
    return digest.hexdigest()


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
    # Credentials never reach the file (nor a comparison: a rotated key is the same run).
    return {
        "data": job.data_name,
        "data_sha256": _data_identity(job),
        "generator_url": public_url(job.endpoint.base_url),
        "generator_model": job.endpoint.model,
        "api": job.endpoint.api,
        "template": job.template.name,
        "max_tokens": job.endpoint.max_tokens,
        "max_passages": job.max_passages,
        **orderer.identity,
        "seed": job.seed,
    }


Records = dict[tuple[str, str], dict[str, Any]]


def _done(job: DeployedJob, orderer: Orderer) -> tuple[Records, Records]:
    """The answers already in the folder, after checking they are this evaluation's, and the
    last refusal or failure of each pair not answered.

    Raises:
        InvalidRequest: the folder holds an evaluation with other settings.
    """
    run_folder.claim(job.out, RUN_FILE, _settings(job, orderer), "another evaluation")
    done: Records = {}
    errors: Records = {}
    for rec in run_folder.records(job.out / ANSWERS_FILE):
        try:
            key = (str(rec["question_id"]), str(rec["variant"]))
        except (KeyError, TypeError):
            continue  # a record without its key: that pair is done again
        if rec.get("error") is None:
            done[key] = rec
        else:
            # Asked again: the server may serve it now (a profile stored since, a deadline
            # raised, the engine back); it cost no generator call.
            errors[key] = rec
    return done, {k: r for k, r in errors.items() if k not in done}


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
        EngineUnavailable, EngineTimeout: the generator failed ``GENERATOR_FAILURES_IN_A_ROW``
            calls in a row; the answers so far are kept and a rerun continues.

    ``dry_run``: estimate and report what is in the folder; call nothing.
    ``transport``: an httpx transport for the generator in place of the network (tests).
    """
    check_examples(job.examples, job.data_name)
    questions = [prepare(ex, job.max_passages, keep_scores=True) for ex in job.examples]
    done, errors = _done(job, orderer)
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
    unanswered: dict[str, dict[str, int]] = {"failed": {}, "refused": {}}
    """This run's orders failed and refused, per variant (the progress line)."""
    failing: list[Exception] = []
    """The generator's failures since its last answer."""

    async def answer(q: EvalQuestion, order: list[int]) -> dict[str, Any] | None:
        nonlocal calls
        if client.spent:
            stop.set()  # the budget is spent (retries count): a rerun continues
            return None
        start = time.perf_counter()
        prompt = api_prompt(job.template, q.question, q.passages, order)
        try:
            data = await client.answer(prompt, request_id=f"eval-{q.id}")
        except BudgetSpent:
            stop.set()  # a retry would have passed --max-calls: a rerun continues
            return None
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
                rec.update(error=str(exc), error_kind=exc.kind)
                log.warning("%s on %s: order %s: %s", t.label, q.id, exc.kind, exc)
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
                    try:
                        made = await answer(q, got.order)
                    except (EngineUnavailable, EngineTimeout) as exc:
                        made = _generator_failed(exc, failing)
                        log.warning("%s on %s: %s", t.label, q.id, made["error"])
                    else:
                        failing.clear()
                    if made is None:
                        return
                    rec.update(made)
                    if rec.get("error") is None:
                        answered[tuple(got.order)] = rec
                if rec.get("error") is None:
                    scores = score_answer(rec["answer"], q.answers)
                    rec.update(accuracy=scores.accuracy, em=scores.em, f1=scores.f1)
            run_folder.append(answers_path, rec)
            if rec.get("error") is None:
                done[(q.id, t.label)] = rec
                errors.pop((q.id, t.label), None)
            else:
                errors[(q.id, t.label)] = rec
                unanswered[rec["error_kind"]][t.label] = (
                    unanswered[rec["error_kind"]].get(t.label, 0) + 1
                )
                bar.set_postfix_str(_postfix(unanswered), refresh=False)
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
    report = build_report(job, questions, done, orderer.describe, errors, orderer.bound)
    files = write_report(job.out, report)
    return DeployedOutcome(est, calls, client.attempts, report, files)


GENERATOR_FAILURES_IN_A_ROW = 3
"""Generator failures with no answer between them that stop the run (module rules)."""


def _generator_failed(
    exc: EngineUnavailable | EngineTimeout, failing: list[Exception]
) -> dict[str, Any]:
    """One generator call failed after its retries, never retried since it may have been paid:
    that question's variant is recorded failed and the run goes on, unless the generator has
    failed ``GENERATOR_FAILURES_IN_A_ROW`` times without an answer between (it is down, or
    every call is lost after it ran: going on would pay for nothing), then ``exc`` is raised."""
    failing.append(exc)
    if len(failing) >= GENERATOR_FAILURES_IN_A_ROW:
        raise exc
    return {"error": f"the generator: {exc.message} (not retried)", "error_kind": "failed"}


def _postfix(unanswered: dict[str, dict[str, int]]) -> str:
    """``failed: default 2; refused: dense:litm 1`` (this run's, per variant)."""
    parts = [
        f"{kind}: " + ", ".join(f"{label} {n}" for label, n in sorted(counts.items()))
        for kind, counts in unanswered.items()
        if counts
    ]
    return "; ".join(parts)
