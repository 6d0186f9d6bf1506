"""The offline commands' handlers (``offline/cli.py`` parses their arguments and calls them).

Each imports its own code, and with it its libraries (matplotlib, peft, rouge-score, ...),
only when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from service.batch.commandline import open_pipeline, progress_line, read_examples
from service.config.settings import Settings
from service.errors import ClientError
from service.learning.answer_likelihood import AnswerLikelihood

if TYPE_CHECKING:
    from offline.generator_api import GeneratorEndpoint
    from service.prompting.templates import PromptTemplate

NOT_STORED = 3
"""``profile-generator``'s exit code when it measured but did not store the profile (a curve not
distinguishable from flat, or no complete question yet): a result, not a failure, which the
scripts that run it tell apart from the errors (1: the service or endpoint; 2: the request)."""


def _require_at_least(
    args: argparse.Namespace, names: Sequence[str], bounds: Mapping[str, int] | None = None
) -> None:
    """Refuse a numeric flag below its bound (``bounds``, else 1), checked in ``names``' order;
    unset flags pass (their defaults apply).

    Raises:
        ClientError: naming the first flag out of bounds, the bound and the value given.
    """
    for name in names:
        value = getattr(args, name)
        least = (bounds or {}).get(name, 1)
        if value is not None and value < least:
            raise ClientError(
                f"--{name.replace('_', '-')} must be >= {least}, got {value}", param=name
            )


async def calibrate_positions(settings: Settings, args: argparse.Namespace) -> int:
    from offline.positions import calibrate_positions

    examples = read_examples(args.data, args.limit)
    async with open_pipeline(settings) as reorderer:
        report = await calibrate_positions(
            reorderer,
            examples,
            max_passages=args.max_passages,
            template=args.template,
            source=args.data.name,
            progress=progress_line("calibrating positions", "questions"),
        )
    print(file=sys.stderr)
    out: dict[str, Any] = asdict(report.record)
    out.update(
        prompts=report.prompts,
        prompts_failed=report.prompts_failed,
        generated_tokens=report.generated_tokens,
    )
    print(json.dumps(out, indent=2))
    return 0


async def eval(settings: Settings, args: argparse.Namespace) -> int:
    from offline.evaluation import EvalConfig, run_evaluation, select_variants

    _require_at_least(
        args, ("limit", "max_passages", "positional_limit", "resamples", "max_answer_tokens")
    )
    if args.generator_url or args.reorder_url:
        return await eval_deployed(settings, args)
    # for_model: a base model (Gemma-3-270m) gets its completion template unless one is set.
    scorer_settings = settings.for_model(args.scorer or settings.model)
    generator_settings = scorer_settings.for_model(args.generator or scorer_settings.model)
    variants = select_variants(
        args.strategies.split(",") if args.strategies else None,
        cross_model=generator_settings.model != scorer_settings.model,
    )
    examples = read_examples(args.data, args.limit)
    async with AsyncExitStack() as stack:
        scorer = await stack.enter_async_context(open_pipeline(scorer_settings))
        generator = None
        if generator_settings.model != scorer_settings.model:
            generator = await stack.enter_async_context(open_pipeline(generator_settings))
        config = EvalConfig(
            out_dir=args.out,
            variants=tuple(variants),
            max_passages=args.max_passages,
            template=args.template,
            generator_template=args.generator_template,
            max_answer_tokens=args.max_answer_tokens,
            positional=args.positional,
            positional_limit=args.positional_limit,
            metric=args.metric,
            resamples=args.resamples,
            progress=not args.no_progress,
            data_name=args.data.name,
            bias_profile=args.bias_profile,
            cached_only=args.cached_only,
            fresh=args.fresh,
        )
        outcome = await run_evaluation(examples, scorer, config, generator=generator)
    print(
        json.dumps(
            {
                "out": str(args.out),
                # With --cached-only, the finished questions the report holds.
                "questions": len({r.question_id for r in outcome.records}),
                "variants": len(variants),
                "metric": outcome.metric,
                "files": [str(f) for f in outcome.files],
            },
            indent=2,
        )
    )
    return 0


async def profile_generator(settings: Settings, args: argparse.Namespace) -> int:
    from offline.answer_profile import Estimate, ProfileJob, run_profile
    from offline.generator_api import GeneratorEndpoint, api_key
    from service.prompting.templates import PromptTemplate, get_template
    from service.state.profile_store import ProfileStore

    _require_at_least(
        args, ("limit", "slots", "max_calls", "concurrency", "max_tokens"), {"slots": 2}
    )
    if args.template_file is not None:
        try:
            template = PromptTemplate(**json.loads(args.template_file.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ClientError(
                f"--template-file {args.template_file}: {exc}", param="template_file"
            ) from None
    else:
        template = get_template(args.template)
    endpoint = GeneratorEndpoint(
        base_url=args.base_url,
        model=args.model,
        api=args.api,
        api_key=api_key(args.base_url, args.api_key_env, os.environ),
        max_tokens=args.max_tokens,
        logprobs=not args.no_logprobs,
        timeout_s=args.timeout,
        retries=args.retries,
        concurrency=args.concurrency,
    )
    if args.no_labels:
        return await _profile_generator_blind(settings, args, endpoint, template)
    job = ProfileJob(
        endpoint=endpoint,
        examples=read_examples(args.data, args.limit),
        data_name=args.data.name,
        slots=args.slots,
        template=template,
        out=args.out,
        max_calls=args.max_calls,
        seed=args.seed,
        alpha=args.alpha,
        force=args.force,
        progress=not args.no_progress,
        profile_model=args.profile_model,
    )

    def announce(est: Estimate) -> None:
        print(
            f"profile-generator: {est.questions} questions x {args.slots} slots = {est.calls} "
            f"calls ({est.skipped} questions skipped: no gold passage or too few others); "
            f"{est.done} answered in {args.out}; this run: {est.todo} calls, about "
            f"{est.approx_prompt_tokens} prompt tokens",
            file=sys.stderr,
            flush=True,
        )

    outcome = await run_profile(job, ProfileStore(settings.profiles_path), on_estimate=announce)
    fit = outcome.fit
    print(
        json.dumps(
            {
                "out": str(args.out),
                "calls_this_run": outcome.calls_made,
                "attempts_this_run": outcome.attempts,
                "questions_measured": outcome.complete_questions,
                "accuracy_by_slot": list(fit.accuracy) if fit else None,
                "p_flat": fit.p_flat if fit else None,
                "stored": outcome.stored.id if outcome.stored else None,
                "refused": outcome.refused,
                "files": [str(f) for f in outcome.files],
            },
            indent=2,
        )
    )
    if outcome.refused is not None:
        print(f"profile not stored: {outcome.refused}", file=sys.stderr)
        return NOT_STORED
    return 0


async def _profile_generator_blind(
    settings: Settings,
    args: argparse.Namespace,
    endpoint: GeneratorEndpoint,
    template: PromptTemplate,
) -> int:
    from offline.answer_profile import Estimate
    from offline.blind_profile import BlindJob, run_blind_profile
    from service.state.profile_store import ProfileStore
    from solver.trust import TrustRules

    if not 0.0 < args.threshold <= 1.0:
        raise ClientError(f"--threshold must be in (0, 1], got {args.threshold}", param="threshold")
    if args.top_slots not in (1, 2):
        raise ClientError(f"--top-slots must be 1 or 2, got {args.top_slots}", param="top_slots")
    job = BlindJob(
        endpoint=endpoint,
        examples=read_examples(args.data, args.limit),
        data_name=args.data.name,
        slots=args.slots,
        template=template,
        out=args.out,
        max_calls=args.max_calls,
        seed=args.seed,
        threshold=args.threshold,
        rules=TrustRules(alpha=args.alpha, top_slots=args.top_slots),
        force=args.force,
        progress=not args.no_progress,
        profile_model=args.profile_model,
        likelihood=await _tie_break_scorer(settings) if args.tie_break else None,
    )

    def announce(est: Estimate) -> None:
        print(
            f"profile-generator --no-labels: {est.questions} questions, one call each in a "
            f"random order of {args.slots} passages ({est.skipped} questions skipped: fewer "
            f"passages); {est.done} answered in {args.out}; this run: {est.todo} calls, about "
            f"{est.approx_prompt_tokens} prompt tokens",
            file=sys.stderr,
            flush=True,
        )

    try:
        outcome = await run_blind_profile(
            job, ProfileStore(settings.profiles_path), on_estimate=announce
        )
    finally:
        if isinstance(job.likelihood, AnswerLikelihood):
            await job.likelihood.backend.aclose()
    fit = outcome.fit
    print(
        json.dumps(
            {
                "out": str(args.out),
                "calls_this_run": outcome.calls_made,
                "attempts_this_run": outcome.attempts,
                "questions_answered": fit.questions if fit else 0,
                "attributed": fit.attributed if fit else 0,
                "share_by_slot": list(fit.share) if fit else None,
                "verdict": fit.verdict if fit else None,
                "reason": fit.reason if fit else None,
                "stored": outcome.stored.id if outcome.stored else None,
                "refused": outcome.refused,
                "files": [str(f) for f in outcome.files],
            },
            indent=2,
        )
    )
    if outcome.refused is not None:
        print(f"profile not stored: {outcome.refused}", file=sys.stderr)
        return NOT_STORED
    return 0


async def _tie_break_scorer(settings: Settings) -> AnswerLikelihood:
    """The configured scoring model (``RAG_REORDER_MODEL``, the embedded SmolLM2 by default;
    not ``--model``, which names the generator), loaded in this process, as the attribution's
    tie-break."""
    import anyio.to_thread

    from service.backends.factory import create_backend

    scorer = settings.model_copy(update={"model": Settings().model})
    return AnswerLikelihood(await anyio.to_thread.run_sync(create_backend, scorer))


async def distill(settings: Settings, args: argparse.Namespace) -> int:
    from offline.distill.command import DistillJob, run_distill
    from offline.distill.train import DistillConfig

    _require_at_least(
        args,
        ("limit", "passages", "permutations", "epochs", "batch_questions", "lora_r", "concurrency"),
    )
    # Neither model runs with an adapter: the teacher is the generator itself, and the student
    # is trained from its base weights.
    base = settings.model_copy(update={"adapter": None})
    teacher = base.for_model(args.teacher or settings.model)
    if args.teacher_template:
        teacher = teacher.model_copy(update={"chat_template": args.teacher_template})
    student = base.for_model(args.student)
    if args.student_template:
        student = student.model_copy(update={"chat_template": args.student_template})
    job = DistillJob(
        teacher=teacher,
        student=student,
        out=args.out,
        preferences=args.preferences or args.out / "preferences.jsonl",
        data_name=args.data.name,
        passages=args.passages,
        permutations=args.permutations,
        held_back=args.held_back,
        seed=args.seed,
        name=args.name,
        progress=not args.no_progress,
        score_only=args.score_only,
        concurrency=args.concurrency,
    )
    config = DistillConfig(
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        epochs=args.epochs,
        batch_questions=args.batch_questions,
        permutations_per_step=args.permutations_per_step,
        seed=args.seed,
        device=settings.device,
    )
    outcome = await run_distill(read_examples(args.data, args.limit), job, config)
    out: dict[str, Any] = {
        "preferences": str(job.preferences),
        "questions": len(outcome.preferences.preferences),
        "scored_now": outcome.preferences.scored,
        "skipped": outcome.preferences.skipped,
    }
    if outcome.manifest is not None:
        out["adapter"] = str(args.out)
        out["manifest"] = outcome.manifest.to_json()
    print(json.dumps(out, indent=2))
    return 0


async def distill_eval(settings: Settings, args: argparse.Namespace) -> int:
    from offline.distill.measure import TEACHER, MeasureConfig, measure
    from offline.evaluation.plots import write_distill_plot

    base = settings.model_copy(update={"adapter": None})
    teacher = base.for_model(args.teacher or settings.model)
    student = base.for_model(args.student)
    _require_at_least(args, ("concurrency",))
    config = MeasureConfig(
        out=args.out,
        passages=args.passages,
        design=args.design,
        num_prompts=args.num_prompts,
        seed=args.seed,
        max_answer_tokens=args.max_answer_tokens,
        concurrency=args.concurrency,
    )
    examples = read_examples(args.data, args.limit)
    async with AsyncExitStack() as stack:
        # The teacher scores and, as the generator, answers: one pipeline for both.
        scorers = {
            TEACHER: await stack.enter_async_context(open_pipeline(teacher)),
            "student": await stack.enter_async_context(open_pipeline(student)),
        }
        if args.adapter is not None:
            distilled = student.model_copy(update={"adapter": args.adapter})
            scorers["distilled"] = await stack.enter_async_context(open_pipeline(distilled))
        summary = await measure(
            examples,
            scorers,
            scorers[TEACHER],
            config,
            progress=None if args.no_progress else progress_line("distill-eval", "questions"),
        )
    print(file=sys.stderr)
    write_distill_plot(args.out, summary)
    print(json.dumps(summary, indent=2))
    return 0


async def eval_deployed(settings: Settings, args: argparse.Namespace) -> int:
    """``eval --generator-url``: the user's generator, orders from their server (or in process)."""
    from offline.evaluation.deployed import DeployedJob, Estimate, file_sha256, run_deployed
    from offline.evaluation.orderers import InProcessOrderer, Orderer, ServerOrderer, targets
    from offline.generator_api import GeneratorEndpoint, api_key
    from service.prompting.templates import get_template

    _require_at_least(args, ("max_calls", "concurrency"))
    _require_at_least(args, ("reorder_retries",), {"reorder_retries": 0})
    if not args.generator_url or not args.generator_model:
        raise ClientError(
            "evaluating your generator needs both --generator-url and --generator-model "
            f"(got {args.generator_url!r}, {args.generator_model!r})",
            param="generator_url",
        )
    if args.generator or args.cached_only or args.bias_profile:
        raise ClientError(
            "--generator, --bias-profile and --cached-only are for the in-process evaluation; "
            "with --generator-url the generator is the API and the orders are the deployment's",
            param="generator",
        )
    if args.metric == "rouge_l":
        raise ClientError(
            "--metric rouge_l is for the in-process evaluation; with --generator-url: "
            "accuracy, em or f1",
            param="metric",
        )
    job = DeployedJob(
        endpoint=GeneratorEndpoint(
            base_url=args.generator_url,
            model=args.generator_model,
            api=args.generator_api,
            api_key=api_key(args.generator_url, args.api_key_env, os.environ),
            max_tokens=args.max_answer_tokens,
            logprobs=False,
            timeout_s=args.timeout,
            retries=args.retries,
            concurrency=args.concurrency,
        ),
        template=get_template(args.generator_template or "qa_default"),
        examples=read_examples(args.data, args.limit),
        data_name=args.data.name,
        data_sha256=file_sha256(args.data),
        targets=tuple(targets(args.strategies.split(",") if args.strategies else None)),
        out=args.out,
        max_passages=args.max_passages,
        max_calls=args.max_calls,
        metric=args.metric,
        resamples=args.resamples,
        progress=not args.no_progress,
    )

    def announce(est: Estimate) -> None:
        print(
            f"eval: {est.questions} questions x {est.variants} variants "
            f"({', '.join(t.label for t in job.targets)}); {est.done} answered in {args.out}; "
            f"this run: at most {est.max_generator_calls} generator calls, about "
            f"{est.approx_prompt_tokens} prompt tokens"
            + (f" (--max-calls {args.max_calls} of {est.todo})" if args.max_calls else ""),
            file=sys.stderr,
        )

    async with AsyncExitStack() as stack:
        orderer: Orderer
        if args.reorder_url:
            orderer = ServerOrderer(
                args.reorder_url,
                api_key=os.environ.get(args.reorder_key_env) or None,
                timeout_s=args.reorder_timeout,
                retries=args.reorder_retries,
                concurrency=args.concurrency,
            )
        else:
            scorer = settings.for_model(args.scorer or settings.model)
            orderer = InProcessOrderer(await stack.enter_async_context(open_pipeline(scorer)))
        outcome = await run_deployed(job, orderer, on_estimate=announce, dry_run=args.dry_run)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "verdict": outcome.report["verdict"],
                # What a rerun asks again, per variant: a long run finishes and says so.
                "unanswered": {
                    v["variant"]: {k: v[k] for k in ("failed", "refused", "not_asked") if v[k]}
                    for v in outcome.report["variants"]
                    if v["failed"] or v["refused"] or v["not_asked"]
                },
                "generator_calls": outcome.generator_calls,
                "attempts": outcome.attempts,
                "files": [str(f) for f in outcome.files],
            },
            indent=2,
        )
    )
    return 0


def convert_data(args: argparse.Namespace) -> int:
    """``convert-data``: another format's QA set as the JSONL ``eval`` takes."""
    from offline.convert import convert_litm

    written = convert_litm(args.input, args.output)
    print(json.dumps({"out": str(args.output), "questions": written}, indent=2))
    return 0
