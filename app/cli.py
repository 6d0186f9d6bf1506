"""``rag-reorder``: serve the API, reorder once, calibrate a bias profile, evaluate, distill a
scorer, list profiles.

Configuration comes from the environment (``RAG_REORDER_*``, see docs/configuration.md); the
few flags below override it for one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

# Dense numerics on small matrices: one BLAS thread is faster and leaves cores to the model.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from service.errors import ClientError, ReorderError
from service.prompts import Passage
from service.settings import Settings
from service.strategies import strategy_names
from service.strategies.base import DesignKind, Placement

if TYPE_CHECKING:
    from service.dataset import Example
    from service.pipeline import Reorderer

log = logging.getLogger("rag_reorder")

_DESIGNS: tuple[str, ...] = get_args(DesignKind)
_PLACEMENTS: tuple[str, ...] = get_args(Placement)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rag-reorder`` command. Returns the process exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RAG_REORDER_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One INFO line per HTTP call (profile-generator makes hundreds) would bury the progress.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = _settings(args)
    except ValidationError as exc:
        _fail(f"invalid configuration: {exc}")
        return 2
    try:
        if args.command == "serve":
            from app.server import serve

            serve(settings, args.host, args.port)
            return 0
        if args.command == "reorder":
            return asyncio.run(_reorder(settings, args))
        if args.command == "calibrate":
            return asyncio.run(_calibrate(settings, args))
        if args.command == "calibrate-positions":
            return asyncio.run(_calibrate_positions(settings, args))
        if args.command == "eval":
            return asyncio.run(_eval(settings, args))
        if args.command == "eval-report":
            from service.offline.evaluation.rebuild import rebuild_report

            files = rebuild_report(args.out, pack=args.pack)
            print(json.dumps({"out": str(args.out), "files": [str(f) for f in files]}, indent=2))
            return 0
        if args.command == "profile-generator":
            return asyncio.run(_profile_generator(settings, args))
        if args.command == "distill":
            return asyncio.run(_distill(settings, args))
        if args.command == "distill-eval":
            return asyncio.run(_distill_eval(settings, args))
        if args.command == "profiles":
            from service.positional_store import PositionalStore
            from service.profile_store import ProfileStore

            store = ProfileStore(settings.profiles_path)
            listing = {
                "bias": [asdict(p) for p in store.list()],
                "positional": [asdict(p) for p in PositionalStore.beside(store).list()],
            }
            print(json.dumps(listing, indent=2))
            return 0
    except ClientError as exc:
        _fail(exc.message, code=exc.code, param=exc.param)
        return 2
    except ReorderError as exc:
        _fail(exc.message, code=exc.code)
        return 1
    raise AssertionError(args.command)


# One example per command, printed at the end of its --help (tests/app/test_cli.py checks
# that every command has one and that each parses). Arguments, not a string: the test parses
# them, and shlex quotes them for the help.
_TRAIN = "../shared/data/nq_open_train.jsonl"
_DEV = "../shared/data/nq_open_dev.jsonl"
_GEMMA, _SMOLLM2 = "google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"
EXAMPLES: dict[str, tuple[str, ...]] = {
    "serve": ("serve", "--host", "0.0.0.0", "--port", "8000"),
    "reorder": (
        "reorder",
        *("--query", "What is the capital of France?", "--passages", "passages.json"),
        *("--placement", "bias_matched"),
    ),
    "calibrate": ("calibrate", "--data", _TRAIN, "--limit", "20", "--max-passages", "10"),
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
    "profiles": ("profiles",),
}


def _example(command: str) -> str:
    return f"example:\n  {shlex.join(('rag-reorder', *EXAMPLES[command]))}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rag-reorder",
        description=__doc__,
        epilog=_example("serve"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=("auto", "vllm", "transformers"))
    p.add_argument("--model", help="local model folder (default: embedded SmolLM2-135M)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        epilog=_example("serve"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="serve the HTTP API",
    )
    s.add_argument("--host", default=os.environ.get("RAG_REORDER_HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=int(os.environ.get("RAG_REORDER_PORT", "8000")))

    r = sub.add_parser(
        "reorder",
        epilog=_example("reorder"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="reorder passages once and print the result as JSON",
    )
    r.add_argument("--query", required=True)
    r.add_argument(
        "--passages",
        required=True,
        type=Path,
        help="JSON file: a list of strings or of objects with text (title, id, score optional)",
    )
    r.add_argument("--design", choices=_DESIGNS, help="default: pruned_random")
    r.add_argument("--num-prompts", type=int)
    r.add_argument("--prompt-passages", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--variable-pruning", action="store_true")
    r.add_argument(
        "--placement",
        choices=_PLACEMENTS,
        default=None,
        help="any strategy that ranks (default: MoI and RAG_REORDER_STRATEGY's ranker "
        "RAG_REORDER_PLACEMENT, others their order)",
    )
    r.add_argument("--bias-profile", help="stored bias profile id bias_matched places by")
    r.add_argument("--joint", action="store_true", help="add the passages' own log-likelihood")
    r.add_argument("--template")
    r.add_argument(
        "--strategy", choices=strategy_names(), help="default: RAG_REORDER_STRATEGY (moi)"
    )
    r.add_argument("--samples", type=int, help="K for query_likelihood / self_consistency")
    r.add_argument("--max-answer-tokens", type=int, help="lore / self_consistency")

    c = sub.add_parser(
        "calibrate",
        epilog=_example("calibrate"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="fit and store a bias profile from a QA set (JSONL)",
    )
    c.add_argument("--data", required=True, type=Path)
    c.add_argument("--limit", type=int, default=20, help="queries to use")
    c.add_argument("--max-passages", type=int, default=10, help="N: passages per query")
    c.add_argument("--design", choices=("random", "pruned_random"), default="random")
    c.add_argument("--prompt-passages", type=int, help="L for pruned_random")
    c.add_argument("--num-prompts", type=int)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--template")

    cp = sub.add_parser(
        "calibrate-positions",
        epilog=_example("calibrate-positions"),
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
        epilog=_example("eval"),
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
        epilog=_example("eval-report"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="rebuild an eval run's report (results.json, summary.md, plots) from its records "
        "and run.json alone, without a model; --pack folds its records into cache.jsonl.gz "
        "(the form the repository keeps)",
    )
    er.add_argument("--out", required=True, type=Path, help="the run's output folder")
    er.add_argument("--pack", action="store_true", help="compress its records first")

    pg = sub.add_parser(
        "profile-generator",
        epilog=_example("profile-generator"),
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
        epilog=_example("distill"),
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
        epilog=_example("distill-eval"),
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
    sub.add_parser(
        "profiles",
        epilog=_example("profiles"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="list the stored profiles: MoI bias profiles (calibrate) and positional ones "
        "(calibrate-positions)",
    )
    return p


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {k: getattr(args, k) for k in ("backend", "model", "device") if getattr(args, k)}
    return Settings(**overrides)


def read_passages(path: Path) -> list[Passage]:
    """Passages from a JSON list of strings or objects with ``text``.

    Raises:
        ClientError: unreadable file or an entry that is neither.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ClientError(f"cannot read passages from {path}: {exc}", param="passages") from None
    if not isinstance(raw, list) or not raw:
        raise ClientError("the passages file must hold a non-empty JSON list", param="passages")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            out.append(Passage(text=item))
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            score = item.get("score")
            if score is not None and not isinstance(score, int | float):
                raise ClientError(f"passages[{i}].score must be a number", param="passages")
            out.append(
                Passage(
                    text=item["text"],
                    title=item.get("title"),
                    id=None if item.get("id") is None else str(item["id"]),
                    score=None if score is None else float(score),
                )
            )
        else:
            raise ClientError(
                f"passages[{i}] must be a string or an object with a string 'text'",
                param="passages",
            )
    return out


async def _reorder(settings: Settings, args: argparse.Namespace) -> int:
    from app.conversions import reorder_response
    from app.schemas import with_defaults
    from service.pipeline import DesignSpec, ReorderRequest, StrategyOptions

    passages = read_passages(args.passages)
    strategy, placement = with_defaults(args.strategy, args.placement, settings)
    moi = strategy == "moi"
    req = ReorderRequest(
        query=args.query,
        passages=passages,
        strategy=strategy,
        design=DesignSpec(
            kind=args.design,
            num_prompts=args.num_prompts,
            prompt_passages=args.prompt_passages,
            seed=args.seed if moi else None,
            variable_pruning=args.variable_pruning,
        ),
        options=StrategyOptions(
            samples=args.samples,
            max_answer_tokens=args.max_answer_tokens,
            seed=None if moi else args.seed,
        ),
        placement=placement,
        bias_profile=args.bias_profile,
        joint=args.joint,
        template=args.template,
    )
    async with _pipeline(settings) as reorderer:
        reorderer.planned_prompts(req)  # refuse bad options before the model loads further
        result = await reorderer.reorder(req)
    print(reorder_response(result, passages).model_dump_json(indent=2))
    return 0


async def _calibrate(settings: Settings, args: argparse.Namespace) -> int:
    from service.calibration import calibrate_profile

    examples = _load_examples(args)
    async with _pipeline(settings) as reorderer:
        report = await calibrate_profile(
            reorderer,
            examples,
            max_passages=args.max_passages,
            design=args.design,
            prompt_passages=args.prompt_passages,
            num_prompts=args.num_prompts,
            seed=args.seed,
            template=args.template,
            source=f"{args.data.name}: {args.limit} queries, {args.design} design",
            progress=_progress("calibrating", "queries"),
        )
    print(file=sys.stderr)
    out: dict[str, Any] = asdict(report.profile)
    out.update(queries=report.queries, prompts=report.prompts, warnings=list(report.warnings))
    out["prompts_failed"] = report.prompts_failed
    if report.orienting is not None:
        out["orienting_profile"] = asdict(report.orienting)
    print(json.dumps(out, indent=2))
    return 0


async def _calibrate_positions(settings: Settings, args: argparse.Namespace) -> int:
    from service.offline.positions import calibrate_positions

    examples = _load_examples(args)
    async with _pipeline(settings) as reorderer:
        report = await calibrate_positions(
            reorderer,
            examples,
            max_passages=args.max_passages,
            template=args.template,
            source=args.data.name,
            progress=_progress("calibrating positions", "questions"),
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
    from service.offline.evaluation import EvalConfig, run_evaluation, select_variants

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
    examples = _load_examples(args)
    async with AsyncExitStack() as stack:
        scorer = await stack.enter_async_context(_pipeline(scorer_settings))
        generator = None
        if generator_settings.model != scorer_settings.model:
            generator = await stack.enter_async_context(_pipeline(generator_settings))
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
    from service.offline.answer_profile import (
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
        examples=_load_examples(args),
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
    from service.offline.distill.command import DistillJob, run_distill
    from service.offline.distill.train import DistillConfig

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
    outcome = await run_distill(_load_examples(args), job, config)
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
    from service.offline.distill.measure import TEACHER, MeasureConfig, measure
    from service.offline.evaluation.plots import write_distill_plot

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
    examples = _load_examples(args)
    async with AsyncExitStack() as stack:
        # The teacher scores and, as the generator, answers: one pipeline for both.
        scorers = {
            TEACHER: await stack.enter_async_context(_pipeline(teacher)),
            "student": await stack.enter_async_context(_pipeline(student)),
        }
        if args.adapter is not None:
            distilled = student.model_copy(update={"adapter": args.adapter})
            scorers["distilled"] = await stack.enter_async_context(_pipeline(distilled))
        summary = await measure(
            examples,
            scorers,
            scorers[TEACHER],
            config,
            progress=None if args.no_progress else _progress("distill-eval", "questions"),
        )
    print(file=sys.stderr)
    write_distill_plot(args.out, summary)
    print(json.dumps(summary, indent=2))
    return 0


@asynccontextmanager
async def _pipeline(settings: Settings) -> AsyncIterator[Reorderer]:
    """The configured backend, loaded off the event loop, in a pipeline; closed on exit."""
    import anyio.to_thread

    from service.backends.factory import create_backend
    from service.pipeline import Reorderer

    backend = await anyio.to_thread.run_sync(lambda: create_backend(settings))
    try:
        yield Reorderer(backend, settings)
    finally:
        await backend.aclose()


def _load_examples(args: argparse.Namespace) -> list[Example]:
    """``--data`` (JSONL in the shared/data schema), at most ``--limit`` questions."""
    from service.dataset import load_examples

    try:
        return list(load_examples(args.data, limit=args.limit))
    except OSError as exc:
        raise ClientError(f"cannot read {args.data}: {exc}", param="data") from None


def _progress(label: str, unit: str) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback that redraws one progress line on stderr."""

    def progress(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total} {unit}", end="", file=sys.stderr, flush=True)

    return progress


def _fail(message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
    print(
        json.dumps({"error": {"type": code, "message": message, "param": param}}), file=sys.stderr
    )


if __name__ == "__main__":
    raise SystemExit(main())
