"""``rag-reorder profile-generator --no-labels``: a generator's position profile from its own
answers to unlabelled questions.

Any question file will do (no ``answers`` or gold labels are read): each question's first
``slots`` passages are shown in one uniformly random order (seeded by the question's id), the
generator answers once, and the answer is attributed to the passages that support it
(``solver.blind_profile.attribute``: normalised containment, else token overlap above
``threshold``). The position-based estimate over those randomised placements, its bootstrap
intervals and the trust rule ``auto`` applies to learned profiles come from
``solver.blind_profile``; a ``shaped`` profile is stored under the generator's name
(``identification: answers-unlabelled``) with its trust figures, as ``profile-generator``
stores a labelled one.

One call per question (the labelled mode makes ``slots``), through the same budgeted client:
the cost estimate before any call, ``max_calls`` a hard bound on HTTP attempts, retries with
backoff, refusals stop the run, and every answered question is appended to
``blind-answers.jsonl`` as it arrives (a rerun continues). Only what the estimate needs is
kept: the order shown and the attributed passages, never the answer's text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]

from offline import run_folder
from offline.answer_profile import Estimate
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
from service.learning.answer_likelihood import Likelihood, resolve_tie
from service.prompting.prompts import ApiPrompt, api_prompt
from service.prompting.templates import PromptTemplate
from service.state.profile_store import ProfileStore, ProfileTrust, StoredProfile
from solver.blind_profile import (
    DEFAULT_THRESHOLD,
    BlindProfile,
    attribute,
    fit_blind_profile,
)
from solver.blind_profile import slot_weights as weights_of
from solver.trust import TrustRules

ANSWERS_FILE = "blind-answers.jsonl"
RUN_FILE = "blind-run.json"
REPORT_FILE = "blind-profile.json"
IDENTIFICATION = "answers-unlabelled"
_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class BlindJob:
    endpoint: GeneratorEndpoint
    examples: Sequence[Example]
    data_name: str
    slots: int
    template: PromptTemplate
    out: Path
    max_calls: int | None = None
    seed: int = 0
    threshold: float = DEFAULT_THRESHOLD
    rules: TrustRules = dataclasses.field(default_factory=TrustRules)
    force: bool = False
    progress: bool = True
    profile_model: str | None = None
    """The model name the profile is stored under (default: ``endpoint.model``)."""
    likelihood: Likelihood | None = None
    """The tie-break's scorer (``service.learning.answer_likelihood``): an answer held by
    several passages goes to the likeliest under it; ``None``: its weight is split."""


@dataclass(frozen=True)
class BlindCall:
    """One question, its first ``slots`` passages in a random order (``order[k]``: the
    passage in slot ``k``)."""

    question_id: str
    order: tuple[int, ...]
    prompt: ApiPrompt
    question: str
    passages: tuple[str, ...]
    """Every passage's title and text, for the attribution."""
    chars: int


@dataclass(frozen=True)
class BlindOutcome:
    estimate: Estimate
    calls_made: int
    attempts: int
    fit: BlindProfile | None
    stored: StoredProfile | None
    refused: str | None
    """Why no profile was stored, if none was."""
    files: tuple[Path, ...]


def plan_calls(
    examples: Sequence[Example], slots: int, template: PromptTemplate, seed: int
) -> tuple[list[BlindCall], int]:
    """One call per question with at least ``slots`` passages (the others are skipped and
    counted): its first ``slots`` passages shuffled uniformly, seeded by ``seed`` and its id."""
    if slots < 2:
        raise InvalidRequest(f"--slots must be >= 2, got {slots}", param="slots")
    calls: list[BlindCall] = []
    skipped = 0
    for ex in examples:
        if len(ex.passages) < slots:
            skipped += 1
            continue
        order = list(range(slots))
        random.Random(zlib.crc32(f"blind:{seed}:{ex.id}".encode())).shuffle(order)
        prompt = api_prompt(template, ex.question, ex.passages, order)
        chars = len(prompt.text or "") + sum(len(m.content) for m in prompt.messages or ())
        texts = tuple(f"{p.title or ''} {p.text}" for p in ex.passages[:slots])
        calls.append(BlindCall(ex.id, tuple(order), prompt, ex.question, texts, chars))
    return calls, skipped


def _run_settings(job: BlindJob) -> dict[str, Any]:
    return {
        "mode": "no-labels",
        "base_url": public_url(job.endpoint.base_url),
        "model": job.endpoint.model,
        "api": job.endpoint.api,
        "template": dataclasses.asdict(job.template),
        "slots": job.slots,
        "seed": job.seed,
        "threshold": job.threshold,
        "max_tokens": job.endpoint.max_tokens,
        "data": job.data_name,
    }


def estimate(job: BlindJob) -> tuple[Estimate, list[BlindCall], dict[str, dict[str, Any]]]:
    """What the run will cost, before it calls anything (and its calls and done answers).

    Raises:
        InvalidRequest: a bad setting, or the folder holds a run with other settings.
    """
    calls, skipped = plan_calls(job.examples, job.slots, job.template, job.seed)
    run_folder.claim(job.out, RUN_FILE, _run_settings(job), "answers of another measurement")
    done: dict[str, dict[str, Any]] = {}
    for rec in run_folder.records(job.out / ANSWERS_FILE):
        if isinstance(rec.get("question_id"), str) and isinstance(rec.get("attributed"), list):
            done[rec["question_id"]] = rec
    todo = [c for c in calls if c.question_id not in done]
    if job.max_calls is not None:
        todo = todo[: job.max_calls]
    est = Estimate(
        questions=len(calls),
        skipped=skipped,
        calls=len(calls),
        done=sum(c.question_id in done for c in calls),
        todo=len(todo),
        approx_prompt_tokens=sum(c.chars for c in todo) // _CHARS_PER_TOKEN,
    )
    return est, todo, done


def fit_records(
    records: Sequence[dict[str, Any]], *, slots: int, rules: TrustRules, seed: int = 0
) -> BlindProfile | None:
    """The estimate over answered questions' records (``order``, ``attributed``), in file
    order; ``None`` before the first."""
    if not records:
        return None
    w = weights_of([r["order"] for r in records], [r["attributed"] for r in records])
    return fit_blind_profile(w, placement_slots=slots, rules=rules, seed=seed)


async def run_blind_profile(
    job: BlindJob,
    store: ProfileStore,
    *,
    on_estimate: Callable[[Estimate], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BlindOutcome:
    """Ask, attribute, fit, report and (when ``shaped``, or ``force``) store (module
    docstring).

    Raises:
        InvalidRequest: a bad setting, a folder of another run, or the server refusing the
            calls: nothing further is sent.
        EngineUnavailable, EngineTimeout: the server is unreachable or too slow after the
            retries; the answers so far are kept and a rerun continues.
    """
    est, todo, done = estimate(job)
    if on_estimate is not None:
        on_estimate(est)
    client = BudgetedClient(job.endpoint, job.max_calls, transport)
    answers = job.out / ANSWERS_FILE
    made = 0
    queue: asyncio.Queue[BlindCall] = asyncio.Queue()
    for c in todo:
        queue.put_nowait(c)

    async def worker(bar: Any) -> None:
        nonlocal made
        while not queue.empty():
            if client.spent:
                return
            call = queue.get_nowait()
            try:
                data = await client.answer(
                    call.prompt,
                    tokens=call.chars // _CHARS_PER_TOKEN,
                    request_id=f"{call.question_id}-blind",
                )
            except BudgetSpent:
                return
            text, _, p_tokens, c_tokens = parse_answer(data)
            found = attribute(text, call.passages, question=call.question, threshold=job.threshold)
            found = await resolve_tie(
                job.likelihood,
                found,
                call.question,
                call.passages,
                text,
                where=f"question {call.question_id}",
            )
            # The answer's text is not kept: the order and the attribution are the estimate's.
            rec = {
                "question_id": call.question_id,
                "order": list(call.order),
                "attributed": list(found.passages),
                "kind": found.kind,
                "overlap": round(found.overlap, 4),
                "tied": found.tied,
                "prompt_tokens": p_tokens,
                "completion_tokens": c_tokens,
                "at": time.time(),
            }
            run_folder.append(answers, rec)
            done[call.question_id] = rec
            made += 1
            bar.update(1)

    try:
        with tqdm(
            total=len(todo), desc="blind", unit="call", file=sys.stderr, disable=not job.progress
        ) as bar:
            await run_workers(job.endpoint.concurrency, lambda: worker(bar))
    finally:
        await client.aclose()
    return _finish(job, store, est, made, done, client.attempts)


def _finish(
    job: BlindJob,
    store: ProfileStore,
    est: Estimate,
    made: int,
    done: dict[str, dict[str, Any]],
    attempts: int,
) -> BlindOutcome:
    wanted = {c.question_id for c in plan_calls(job.examples, job.slots, job.template, job.seed)[0]}
    records = [r for q, r in done.items() if q in wanted]
    fit = fit_records(records, slots=job.slots, rules=job.rules, seed=job.seed)
    tokens = sum(int(r.get("prompt_tokens") or 0) for r in records)
    stored: StoredProfile | None = None
    refused: str | None = None
    if fit is None:
        refused = "no question is answered yet"
    elif fit.verdict != "shaped" and not job.force:
        refused = (
            f"cannot tell yet: {fit.reason}: measure more questions, or pass --force"
            if fit.verdict == "undecided"
            else f"{fit.reason}: a flat profile places nothing (pass --force to store it)"
        )
    else:
        # The API lists a stored trust as learned from traffic or measured offline: this is
        # the latter (its identification says how).
        trust = ProfileTrust.of_blind(fit, source="calibration")
        stored = store.put(
            model=job.profile_model or job.endpoint.model,
            template=job.template.name,
            coefficients=fit.coefficients,
            identification=IDENTIFICATION,
            runs=fit.questions,
            prompts=len(records),
            r2=float("nan"),
            source=(
                f"answers without labels: {job.data_name}, {fit.questions} questions x "
                f"{job.slots} slots in random order, {fit.attributed:.1f} attributed, "
                f"{tokens} prompt tokens, {fit.verdict}"
                f"{', forced' if fit.verdict != 'shaped' else ''}"
            ),
            oriented_by="data",
            trust=trust,
        )
    kinds = [str(r.get("kind")) for r in records]
    report = {
        "mode": "no-labels",
        "model": job.endpoint.model,
        "base_url": public_url(job.endpoint.base_url),
        "api": job.endpoint.api,
        "template": job.template.name,
        "data": job.data_name,
        "slots": job.slots,
        "threshold": job.threshold,
        "questions_answered": len(records),
        "questions_skipped": est.skipped,
        "attributed_contained": kinds.count("contained"),
        "attributed_overlap": kinds.count("overlap"),
        "attributed_none": kinds.count("none"),
        "ties_broken": sum(int(r.get("tied") or 0) > 0 for r in records),
        "calls_this_run": made,
        "attempts_this_run": attempts,
        "prompt_tokens": tokens,
        "completion_tokens": sum(int(r.get("completion_tokens") or 0) for r in records),
        "fit": dataclasses.asdict(fit) if fit else None,
        "stored": stored.id if stored else None,
        "refused": refused,
    }
    path = job.out / REPORT_FILE
    path.write_text(json.dumps(report, indent=1) + "\n")
    return BlindOutcome(est, made, attempts, fit, stored, refused, (path,))
