"""``rag-reorder profile-generator``: a generator's position profile measured by asking it.

Most generators give no prompt log-probabilities (OpenAI, Anthropic, Gemini, Ollama,
llama.cpp...), so the log-prob calibration cannot measure them. This measures what matters to
a placement directly, as the lost-in-the-middle experiments do: for each labelled question,
the gold passage goes into each slot k = 1..N among the same N - 1 distractors, held in one
shuffled arrangement per question (seeded), so only the gold passage's slot changes; the
generator answers; an answer is right when it holds a gold string (NQ-Open accuracy). The
per-slot accuracy, its bootstrap interval, a flatness test and the smoothed placement weights
come from ``solver.answer_profile``; the weights are stored as a bias profile of that generator
(``identification: answers``), which ``bias_matched`` and ``RAG_REORDER_PLACEMENT_PROFILE``
use unchanged (at any passage count: placement resamples a profile by relative position).

One OpenAI-compatible client covers OpenAI, Azure, vLLM, SGLang, Ollama and LiteLLM proxies:
``/chat/completions`` (chat models; the server applies the model's chat template) or
``/completions`` (base models, with a ``completion`` prompt template). Calls go through
``EngineClient``: bounded concurrency, timeouts, retries with backoff and jitter on 429, 503
and refused connections, honouring ``Retry-After`` (never of a 502, 504 or cut call, which may
have run and been paid). Every answer is appended to
``answers.jsonl`` in the output folder as it arrives, so a killed run continues where it
stopped; ``max_calls`` bounds the HTTP attempts of one invocation, retries included (a retry
is counted even when it provably did no billed work: the budget is what was sent).

The profile belongs to the prompt it was measured with (the template: instruction, document
layout, question): a generator weighs positions differently in another prompt shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]

from offline import run_folder
from offline.evaluation.metrics import score_answer
from offline.generator_api import (
    BudgetedClient,
    BudgetSpent,
    GeneratorEndpoint,
    parse_answer,
    public_url,
    run_workers,
)
from service.batch.dataset import Example
from service.errors import InvalidRequest
from service.prompting.prompts import ApiPrompt, api_prompt
from service.prompting.templates import PromptTemplate
from service.state.profile_store import ProfileStore, StoredProfile
from solver.answer_profile import AnswerProfileFit, fit_answer_profile

log = logging.getLogger(__name__)

ANSWERS_FILE = "answers.jsonl"
RUN_FILE = "profile-run.json"
REPORT_FILE = "profile.json"
PLOT_FILE = "position_curve.png"
_CHARS_PER_TOKEN = 4
"""For the estimate printed before a run: English text is about 4 characters a token."""


@dataclass(frozen=True)
class ProfileJob:
    endpoint: GeneratorEndpoint
    examples: Sequence[Example]
    data_name: str
    slots: int
    template: PromptTemplate
    out: Path
    max_calls: int | None = None
    seed: int = 0
    resamples: int = 2000
    alpha: float = 0.05
    force: bool = False
    progress: bool = True
    profile_model: str | None = None
    """The model name the profile is stored under (default: ``endpoint.model``)."""


@dataclass(frozen=True)
class Trial:
    """One call: a question with its gold passage in ``slot`` (0-based)."""

    question_id: str
    slot: int
    order: tuple[int, ...]
    prompt: ApiPrompt
    answers: tuple[str, ...]
    chars: int


@dataclass(frozen=True)
class Estimate:
    questions: int
    skipped: int
    """Questions without a gold passage or with fewer than ``slots - 1`` other passages."""
    calls: int
    done: int
    """Calls already answered in the output folder (a resumed run)."""
    todo: int
    """Calls this invocation will make (``max_calls`` applied)."""
    approx_prompt_tokens: int
    """Prompt tokens of the ``todo`` calls, estimated from their characters."""


@dataclass(frozen=True)
class ProfileOutcome:
    estimate: Estimate
    calls_made: int
    attempts: int
    """HTTP attempts this invocation sent, retries included (what ``max_calls`` bounds)."""
    complete_questions: int
    fit: AnswerProfileFit | None
    stored: StoredProfile | None
    refused: str | None
    """Why no profile was stored, if none was."""
    files: tuple[Path, ...]


def plan_trials(
    examples: Sequence[Example], slots: int, template: PromptTemplate, seed: int
) -> tuple[list[Trial], int]:
    """Every question's ``slots`` calls, question by question, and how many questions were
    skipped. The distractors are the question's first ``slots - 1`` passages that are not
    gold, shuffled once per question (seeded by the question's id)."""
    if slots < 2:
        raise InvalidRequest(f"--slots must be >= 2, got {slots}", param="slots")
    trials: list[Trial] = []
    skipped = 0
    for ex in examples:
        others = [i for i in range(len(ex.passages)) if i not in ex.gold]
        if not ex.gold or not ex.answers or len(others) < slots - 1:
            skipped += 1
            continue
        gold = ex.gold[0]
        distractors = others[: slots - 1]
        random.Random(zlib.crc32(f"{seed}:{ex.id}".encode())).shuffle(distractors)
        for slot in range(slots):
            order = (*distractors[:slot], gold, *distractors[slot:])
            prompt = api_prompt(template, ex.question, ex.passages, order)
            chars = len(prompt.text or "") + sum(len(m.content) for m in prompt.messages or ())
            trials.append(Trial(ex.id, slot, order, prompt, ex.answers, chars))
    return trials, skipped


def _run_settings(job: ProfileJob) -> dict[str, Any]:
    return {
        "base_url": public_url(job.endpoint.base_url),
        "model": job.endpoint.model,
        "api": job.endpoint.api,
        "template": dataclasses.asdict(job.template),
        "slots": job.slots,
        "seed": job.seed,
        "max_tokens": job.endpoint.max_tokens,
        "data": job.data_name,
    }


def _check_folder(job: ProfileJob) -> dict[tuple[str, int], dict[str, Any]]:
    """The answers already in the output folder, after checking they are this run's.

    Raises:
        InvalidRequest: the folder holds a run with other settings.
    """
    run_folder.claim(job.out, RUN_FILE, _run_settings(job), "answers of another measurement")
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in run_folder.records(job.out / ANSWERS_FILE):
        try:
            done[(str(rec["question_id"]), int(rec["slot"]))] = rec
        except (ValueError, KeyError, TypeError):
            continue  # a record without its key: that call is made again
    return done


def estimate(job: ProfileJob) -> tuple[Estimate, list[Trial], dict[tuple[str, int], Any]]:
    """What the run will cost, before it calls anything (and the trials and done answers)."""
    trials, skipped = plan_trials(job.examples, job.slots, job.template, job.seed)
    done = _check_folder(job)
    todo = [t for t in trials if (t.question_id, t.slot) not in done]
    if job.max_calls is not None:
        todo = todo[: job.max_calls]
    est = Estimate(
        questions=len(trials) // job.slots,
        skipped=skipped,
        calls=len(trials),
        done=sum((t.question_id, t.slot) in done for t in trials),
        todo=len(todo),
        approx_prompt_tokens=sum(t.chars for t in todo) // _CHARS_PER_TOKEN,
    )
    return est, todo, done


async def run_profile(
    job: ProfileJob,
    store: ProfileStore,
    *,
    on_estimate: Callable[[Estimate], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ProfileOutcome:
    """Measure, fit, report and (when the curve is distinguishable from flat, or ``force``)
    store the profile (module docstring).

    Raises:
        InvalidRequest: a bad setting, a folder of another run, or the server refusing the
            calls (a bad key, an unknown model, a prompt too long): nothing further is sent.
        EngineUnavailable, EngineTimeout: the server is unreachable or too slow after the
            retries; the answers so far are kept and a rerun continues.

    ``transport``: an httpx transport in place of the network (tests).
    """
    est, todo, done = estimate(job)
    if on_estimate is not None:
        on_estimate(est)
    ep = job.endpoint
    client = BudgetedClient(ep, job.max_calls, transport)
    answers = job.out / ANSWERS_FILE
    made = 0
    queue: asyncio.Queue[Trial] = asyncio.Queue()
    for t in todo:
        queue.put_nowait(t)

    async def worker(bar: Any) -> None:
        nonlocal made
        while not queue.empty():
            if client.spent:
                return  # retries spent part of --max-calls: stop, a rerun continues
            trial = queue.get_nowait()
            try:
                data = await client.answer(
                    trial.prompt,
                    tokens=trial.chars // _CHARS_PER_TOKEN,
                    request_id=f"{trial.question_id}-{trial.slot}",
                )
            except BudgetSpent:
                return  # a retry would pass --max-calls: stop, a rerun continues
            text, logprob, p_tokens, c_tokens = parse_answer(data)
            rec = {
                "question_id": trial.question_id,
                "slot": trial.slot,
                "order": list(trial.order),
                "answer": text,
                "correct": score_answer(text, trial.answers).accuracy,
                "answer_logprob": logprob,
                "prompt_tokens": p_tokens,
                "completion_tokens": c_tokens,
            }
            run_folder.append(answers, rec)
            done[(trial.question_id, trial.slot)] = rec
            made += 1
            bar.update(1)

    try:
        with tqdm(
            total=len(todo), desc="profile", unit="call", file=sys.stderr, disable=not job.progress
        ) as bar:
            await run_workers(ep.concurrency, lambda: worker(bar))
    finally:
        await client.aclose()
    return _finish(job, store, est, made, done, client.attempts)


def _finish(
    job: ProfileJob,
    store: ProfileStore,
    est: Estimate,
    made: int,
    done: dict[tuple[str, int], dict[str, Any]],
    attempts: int,
) -> ProfileOutcome:
    from offline.evaluation.plots import write_position_curve

    ids = list(dict.fromkeys(q for q, _ in done))
    complete = [q for q in ids if all((q, k) in done for k in range(job.slots))]
    matrix = [[float(done[(q, k)]["correct"]) for k in range(job.slots)] for q in complete]
    fit = (
        fit_answer_profile(matrix, resamples=job.resamples, seed=job.seed, alpha=job.alpha)
        if complete
        else None
    )
    tokens = sum(int(r.get("prompt_tokens") or 0) for r in done.values())
    stored: StoredProfile | None = None
    refused: str | None = None
    if fit is None:
        refused = "no question has an answer at every slot yet"
    elif not fit.distinguishable and not job.force:
        refused = (
            f"the curve is not distinguishable from flat (Cochran's Q p = {fit.p_flat:.3g} >= "
            f"{job.alpha} over {fit.questions} questions): measure more questions, or pass "
            "--force to store it anyway"
        )
    else:
        stored = store.put(
            model=job.profile_model or job.endpoint.model,
            template=job.template.name,
            coefficients=fit.coefficients,
            identification="answers",
            runs=fit.questions,
            prompts=len(done),
            r2=fit.r2,
            source=(
                f"answers: {job.data_name}, {fit.questions} questions x {job.slots} slots, "
                f"{len(done)} calls, {tokens} prompt tokens, Cochran's Q p = {fit.p_flat:.3g}"
                f"{', forced' if not fit.distinguishable else ''}"
            ),
            oriented_by="data",
        )
    report = {
        "model": job.endpoint.model,
        "base_url": public_url(job.endpoint.base_url),
        "api": job.endpoint.api,
        "template": job.template.name,
        "data": job.data_name,
        "slots": job.slots,
        "questions_measured": len(complete),
        "questions_skipped": est.skipped,
        "calls": len(done),
        "calls_this_run": made,
        "attempts_this_run": attempts,
        "prompt_tokens": tokens,
        "completion_tokens": sum(int(r.get("completion_tokens") or 0) for r in done.values()),
        "fit": dataclasses.asdict(fit) if fit else None,
        "distinguishable": fit.distinguishable if fit else False,
        "stored": stored.id if stored else None,
        "refused": refused,
    }
    files = [job.out / REPORT_FILE]
    files[0].write_text(json.dumps(report, indent=1) + "\n")
    if fit is not None:
        files.append(write_position_curve(job.out / PLOT_FILE, fit, title=job.endpoint.model))
    return ProfileOutcome(est, made, attempts, len(complete), fit, stored, refused, tuple(files))
