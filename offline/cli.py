"""The offline commands of ``rag-reorder``: evaluation, distillation, positional and generator
profiles. ``app.cli`` (the one command line) adds them to its parser with ``add_commands`` and
runs them with ``run``; each imports its own code (and its libraries: matplotlib, peft, ...)
only when it runs, so ``rag-reorder serve`` never loads them.

A new offline command: its parser in ``add_commands``, an example in ``EXAMPLES`` (the help
prints it; tests/app/test_cli.py parses it), a handler in ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

from service.commandline import open_pipeline, progress_line, read_examples
from service.errors import ClientError
from service.settings import Settings
from service.strategies import strategy_names
from service.strategies.base import DesignKind, Placement

_DESIGNS: tuple[str, ...] = get_args(DesignKind)
_PLACEMENTS: tuple[str, ...] = get_args(Placement)

_TRAIN = "../shared/data/nq_open_train.jsonl"
_DEV = "../shared/data/nq_open_dev.jsonl"
_GEMMA, _SMOLLM2 = "google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"
EXAMPLES: dict[str, tuple[str, ...]] = {
    "calibrate-positions": (
        "calibrate-positions",
        *("--data", _DEV, "--limit", "20", "--max-passages", "5"),
    ),
    "eval": (
        "eval",
        *("--data", _DEV, "--limit", "200", "--max-passages", "10"),
        *("--strategies", "moi,dense:bias_matched,shuffle", "--out", "eval/results/nq_open_dev"),
    ),
    "distill": (
        "distill",
        *("--data", _TRAIN, "--limit", "1000", "--teacher", _GEMMA, "--student", _SMOLLM2),
        *("--out", "models/smollm2-from-gemma"),
    ),
    "distill-eval": (
        "distill-eval",
        *("--data", _DEV, "--limit", "16", "--teacher", _GEMMA, "--student", _SMOLLM2),
        *("--adapter", "models/smollm2-from-gemma", "--out", "eval/results/distill"),
    ),
    "eval-report": ("eval-report", "--out", "eval/results/nq_open_dev", "--pack"),
    "profile-generator": (
        "profile-generator",
        *("--base-url", "https://api.openai.com/v1", "--model", "gpt-4o-mini"),
        *("--data", _TRAIN, "--limit", "50", "--slots", "10", "--max-calls", "500"),
        *("--out", "profiles/gpt-4o-mini"),
    ),
}
"""One example per offline command, in the order ``rag-reorder --help`` lists them."""


def add_commands(sub: Any, example: Callable[[str], str]) -> None:
    """Add the offline commands' parsers to ``rag-reorder``'s subparsers.

    Args:
        sub: the top-level parser's subparsers action.
        example: the help epilog for a command name (its ``EXAMPLES`` entry, quoted).
    """
    cp = sub.add_parser(
        "calibrate-positions",
        epilog=example("calibrate-positions"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="measure and store the positional accuracy and distracting-effect profiles "
        "(max_relevance, min_distraction) from a QA set with gold labels (JSONL)",
    )
    cp.add_argument("--data", required=True, type=Path)
    cp.add_argument("--limit", type=int, default=20, help="questions to use")
    cp.add_argument(
        "--max-passages",
        type=int,
        default=5,
        help="k: prompt slots (the gold passage or the hard distractor plus k-1 weak ones); "
        "requests of k passages use the profile",
    )
    cp.add_argument("--template", help="the answering template the profiles are for")

    e = sub.add_parser(
        "eval",
        epilog=example("eval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="evaluate every strategy on a QA set (JSONL): the generator's answers, the gold "
        "answer's log-likelihood, the gold passage's slot and the cost, with paired tests",
    )
    e.add_argument("--data", required=True, type=Path, help="JSONL in the shared/data schema")
    e.add_argument("--limit", type=int, help="questions to use (default: all)")
    e.add_argument(
        "--max-passages", type=int, help="K: passages per question, gold kept (default: all)"
    )
    e.add_argument(
        "--strategies",
        help="comma-separated strategy names, moi:<design>, moi:<design>:<placement> or "
        "<ranker>:<placement> (bm25:litm, dense:bias_matched, query_generation:bias_matched; "
        "<ranker>:descending_utility is the ranker alone, without its placed variants) "
        "(default: every strategy, MoI with each design and placement). "
        f"Strategies: {', '.join(strategy_names())}. Designs: {', '.join(_DESIGNS)}. "
        f"Placements: {', '.join(_PLACEMENTS)}",
    )
    e.add_argument(
        "--bias-profile",
        help="stored bias profile id the bias_matched ranker variants and the "
        "moi:<design>:generator_bias variants place by (default: the generator's stored profile "
        "for its template)",
    )
    e.add_argument("--scorer", help="scoring model (default: --model, else the configured one)")
    e.add_argument("--generator", help="answering model (default: the scorer)")
    e.add_argument("--template", help="scorer's prompt template (default: the configured one)")
    e.add_argument(
        "--generator-template",
        help="generator's prompt template (default: its model's own, e.g. qa_completion for "
        "google/gemma-3-270m; the scorer's when both are one model)",
    )
    e.add_argument("--max-answer-tokens", type=int, default=32)
    e.add_argument(
        "--metric",
        choices=("accuracy", "em", "f1", "rouge_l"),
        help="task metric (default: EM for two-gold sets like HotpotQA, else NQ accuracy)",
    )
    e.add_argument(
        "--positional",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="controlled runs: the gold passage rotated through every slot",
    )
    e.add_argument("--positional-limit", type=int, default=10, help="questions rotated")
    e.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    e.add_argument(
        "--cached-only",
        action="store_true",
        help="compute nothing: report the questions whose every variant is in the cache (the "
        "finished part of an unfinished run)",
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output folder; a run with the same models, templates, passage count and seed "
        "resumes from its records (it says how much), one with other settings is refused",
    )
    e.add_argument(
        "--fresh",
        action="store_true",
        help="start afresh in --out: its earlier records are moved aside, not resumed",
    )

    er = sub.add_parser(
        "eval-report",
        epilog=example("eval-report"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="rebuild an eval run's report (results.json, summary.md, plots) from its records "
        "and run.json alone, without a model; --pack folds its records into cache.jsonl.gz "
        "(the form the repository keeps)",
    )
    er.add_argument("--out", required=True, type=Path, help="the run's output folder")
    er.add_argument("--pack", action="store_true", help="compress its records first")

    pg = sub.add_parser(
        "profile-generator",
        epilog=example("profile-generator"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="measure a generator's position profile by asking it questions through its "
        "OpenAI-compatible API (no prompt log-probs needed: OpenAI, Azure, vLLM, SGLang, "
        "Ollama, LiteLLM): the gold passage in each slot, accuracy per slot with intervals; "
        "stores it as a bias profile for bias_matched (resumable, budgeted)",
    )
    pg.add_argument("--base-url", required=True, help="the API's root, up to /v1")
    pg.add_argument("--model", required=True, help="the model name the API serves")
    pg.add_argument(
        "--api",
        choices=("chat", "completions"),
        default="chat",
        help="/chat/completions (chat models) or /completions (base models, with a completion "
        "template such as qa_completion)",
    )
    pg.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key (unset: no key sent)",
    )
    pg.add_argument(
        "--data",
        type=Path,
        default=Path("../shared/data/nq_open_train.jsonl"),
        help="labelled questions with passages (JSONL in the shared/data schema)",
    )
    pg.add_argument("--limit", type=int, default=50, help="questions to use")
    pg.add_argument("--slots", type=int, default=10, help="N: passages per prompt")
    pg.add_argument(
        "--template",
        default="qa_default",
        help="registered prompt template (the prompt shape the profile is for): "
        "qa_default, qa_plain, qa_system, qa_completion",
    )
    pg.add_argument(
        "--template-file",
        type=Path,
        help="your own prompt shape: a JSON object with name, instruction, document, "
        "untitled_document and optionally question_prefix, separator, system, completion, "
        "answer_prefix (service/prompts.py PromptTemplate)",
    )
    pg.add_argument("--max-calls", type=int, help="most calls this invocation makes")
    pg.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    pg.add_argument("--max-tokens", type=int, default=32, help="answer tokens per call")
    pg.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    pg.add_argument("--retries", type=int, default=5, help="retries of 429/502-504 and refusals")
    pg.add_argument("--no-logprobs", action="store_true", help="do not ask for output log-probs")
    pg.add_argument("--seed", type=int, default=0, help="the distractors' arrangement")
    pg.add_argument("--alpha", type=float, default=0.05, help="level of the flatness test")
    pg.add_argument("--force", action="store_true", help="store a profile that looks flat")
    pg.add_argument(
        "--profile-model", help="the model name to store the profile under (default: --model)"
    )
    pg.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    pg.add_argument("--out", required=True, type=Path, help="answers, report and plot (resumes)")

    d = sub.add_parser(
        "distill",
        epilog=example("distill"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="preference distillation (the MoI paper): the teacher scores K permutations per "
        "question (resumable), then a LoRA adapter on the student learns to prefer the same "
        "orders; writes the adapter and its manifest for RAG_REORDER_ADAPTER",
    )
    d.add_argument("--data", required=True, type=Path, help="training questions (JSONL)")
    d.add_argument("--limit", type=int, help="questions to use (default: all)")
    d.add_argument("--teacher", help="the generator (default: --model, else the configured one)")
    d.add_argument("--teacher-template", help="default: the teacher model's own")
    d.add_argument("--student", required=True, help="the smaller scoring model")
    d.add_argument("--student-template", help="default: the student model's own")
    d.add_argument("--passages", type=int, default=5, help="N: passages per question (gold kept)")
    d.add_argument("--permutations", type=int, default=30, help="K: teacher-scored orders")
    d.add_argument(
        "--permutations-per-step", type=int, default=4, help="K': orders sampled per step"
    )
    d.add_argument("--held-back", type=int, default=10, help="questions kept out of training")
    d.add_argument("--lora-r", type=int, default=8)
    d.add_argument("--lora-alpha", type=int, default=32)
    d.add_argument("--lora-dropout", type=float, default=0.1)
    d.add_argument("--lr", type=float, default=1e-4)
    d.add_argument("--weight-decay", type=float, default=0.01)
    d.add_argument("--epochs", type=int, default=5)
    d.add_argument("--batch-questions", type=int, default=4, help="questions per step")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--name", help="the adapter's name in the model id (default: --out's name)")
    d.add_argument(
        "--preferences", type=Path, help="the preference set (default: <out>/preferences.jsonl)"
    )
    d.add_argument("--score-only", action="store_true", help="build the preference set only")
    d.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="questions the teacher scores at once (their prompts share forwards: use 8-16 on a "
        "GPU)",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    d.add_argument("--out", required=True, type=Path, help="the adapter folder")
    de = sub.add_parser(
        "distill-eval",
        epilog=example("distill-eval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="a distilled scorer against its teacher and the raw student on held-out "
        "questions: agreement with the teacher's MoI utilities, the generator's quality with "
        "each order and a shuffle (paired intervals), scoring cost (resumable)",
    )
    de.add_argument("--data", required=True, type=Path, help="questions not used in training")
    de.add_argument("--limit", type=int, help="questions to use (default: all)")
    de.add_argument("--teacher", help="the generator (default: --model, else the configured one)")
    de.add_argument("--student", required=True)
    de.add_argument(
        "--adapter",
        type=Path,
        help="the distilled adapter folder (without it: teacher and raw student only; a later "
        "run with it in the same --out adds the distilled student)",
    )
    de.add_argument("--passages", type=int, default=4, help="N: passages per question")
    de.add_argument("--design", choices=_DESIGNS, default="random", help="MoI's design")
    de.add_argument("--num-prompts", type=int, help="MoI's prompts per question")
    de.add_argument("--max-answer-tokens", type=int, default=16)
    de.add_argument("--seed", type=int, default=0)
    de.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="questions measured at once (a GPU needs several; above 1 the per-question "
        "scoring seconds include waiting, so measure cost with 1)",
    )
    de.add_argument("--no-progress", action="store_true")
    de.add_argument("--out", required=True, type=Path, help="output folder (resumes from it)")


async def run(command: str, settings: Settings, args: argparse.Namespace) -> int:
    """Run one offline command; returns the process exit code.

    Raises:
        ClientError: a bad argument (exit 2 in ``app.cli``).
        ReorderError: the work failed (exit 1).
    """
    if command == "calibrate-positions":
        return await _calibrate_positions(settings, args)
    if command == "eval":
        return await _eval(settings, args)
    if command == "eval-report":
        from offline.evaluation.rebuild import rebuild_report

        files = rebuild_report(args.out, pack=args.pack)
        print(json.dumps({"out": str(args.out), "files": [str(f) for f in files]}, indent=2))
        return 0
    if command == "profile-generator":
        return await _profile_generator(settings, args)
    if command == "distill":
        return await _distill(settings, args)
    if command == "distill-eval":
        return await _distill_eval(settings, args)
    raise AssertionError(command)


async def _calibrate_positions(settings: Settings, args: argparse.Namespace) -> int:
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


async def _eval(settings: Settings, args: argparse.Namespace) -> int:
    from offline.evaluation import EvalConfig, run_evaluation, select_variants

    for name in ("limit", "max_passages", "positional_limit", "resamples", "max_answer_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ClientError(f"--{name.replace('_', '-')} must be >= 1", param=name)
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


async def _profile_generator(settings: Settings, args: argparse.Namespace) -> int:
    from offline.answer_profile import (
        Estimate,
        GeneratorEndpoint,
        ProfileJob,
        run_profile,
    )
    from service.profile_store import ProfileStore
    from service.prompts import PromptTemplate, get_template

    for name in ("limit", "slots", "max_calls", "concurrency", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "slots" else 1):
            least = 2 if name == "slots" else 1
            raise ClientError(
                f"--{name.replace('_', '-')} must be >= {least}, got {value}", param=name
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
    job = ProfileJob(
        endpoint=GeneratorEndpoint(
            base_url=args.base_url,
            model=args.model,
            api=args.api,
            api_key=os.environ.get(args.api_key_env) or None,
            max_tokens=args.max_tokens,
            logprobs=not args.no_logprobs,
            timeout_s=args.timeout,
            retries=args.retries,
            concurrency=args.concurrency,
        ),
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
        return 1
    return 0


async def _distill(settings: Settings, args: argparse.Namespace) -> int:
    from offline.distill.command import DistillJob, run_distill
    from offline.distill.train import DistillConfig

    for name in (
        "limit",
        "passages",
        "permutations",
        "epochs",
        "batch_questions",
        "lora_r",
        "concurrency",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ClientError(f"--{name.replace('_', '-')} must be >= 1", param=name)
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


async def _distill_eval(settings: Settings, args: argparse.Namespace) -> int:
    from offline.distill.measure import TEACHER, MeasureConfig, measure
    from offline.evaluation.plots import write_distill_plot

    base = settings.model_copy(update={"adapter": None})
    teacher = base.for_model(args.teacher or settings.model)
    student = base.for_model(args.student)
    if args.concurrency < 1:
        raise ClientError("--concurrency must be >= 1", param="concurrency")
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
