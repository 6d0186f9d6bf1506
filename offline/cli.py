"""The offline commands of ``rag-reorder``: evaluation, distillation, positional and generator
profiles. ``entrypoints.cli`` (the one command line) adds them to its parser with
``add_commands`` and runs them with ``run``; each imports its own code (and its libraries:
matplotlib, peft, ...) only when it runs, so ``rag-reorder serve`` never loads them.

A new offline command: its parser in ``add_commands``, an example in ``EXAMPLES`` (the help
prints it; tests/app/test_cli.py parses it), its handler in ``offline/commands.py``, a branch
in ``run``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from offline import commands
from service.batch.commandline import TRAINING_DATA
from service.config.settings import Settings
from service.strategies import strategy_names
from service.strategies.request import DesignKind, Placement

_DESIGNS: tuple[str, ...] = get_args(DesignKind)
_PLACEMENTS: tuple[str, ...] = get_args(Placement)

_TRAIN = TRAINING_DATA
_DEV = "../shared/data/nq_open_dev.jsonl"
_GEMMA, _SMOLLM2 = "google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"
EXAMPLES: dict[str, tuple[str, ...]] = {
    "calibrate-positions": (
        "calibrate-positions",
        *("--data", _DEV, "--limit", "20", "--max-passages", "5"),
    ),
    "eval": (
        "eval",
        *("--data", "my_questions.jsonl", "--limit", "50", "--max-passages", "10"),
        *("--generator-url", "http://vllm:8000/v1", "--generator-model", "my-generator"),
        *("--reorder-url", "http://rag-reorder:8000", "--out", "results/eval/mine"),
    ),
    "convert-data": (
        *("convert-data", "--from", "litm"),
        *("nq-open-10_total_documents_gold_at_4.jsonl.gz", "my_questions.jsonl"),
    ),
    "distill": (
        "distill",
        *("--data", _TRAIN, "--limit", "1000", "--teacher", _GEMMA, "--student", _SMOLLM2),
        *("--out", "models/smollm2-from-gemma"),
    ),
    "distill-eval": (
        "distill-eval",
        *("--data", _DEV, "--limit", "16", "--teacher", _GEMMA, "--student", _SMOLLM2),
        *("--adapter", "models/smollm2-from-gemma", "--out", "results/eval/distill"),
    ),
    "eval-report": ("eval-report", "--out", "results/eval/nq_open_dev", "--pack"),
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

    g = e.add_argument_group(
        "your generator, through the service you deploy",
        "answer with the generator you serve (any OpenAI-compatible API) and take the orders "
        "from a running rag-reorder server; variants default to the server's default strategy "
        "(`default`), and the retriever's order and a shuffle are always included",
    )
    g.add_argument("--generator-url", help="the generator API's root, up to /v1")
    g.add_argument("--generator-model", help="the model name the generator API serves")
    g.add_argument(
        "--generator-api",
        choices=("chat", "completions"),
        default="chat",
        help="/chat/completions (chat models) or /completions (base models, with a completion "
        "template such as qa_completion via --generator-template)",
    )
    g.add_argument(
        "--api-key-env",
        help="environment variable holding the generator's API key (unset: no key sent; "
        "default: OPENAI_API_KEY, sent only to an https --generator-url)",
    )
    g.add_argument(
        "--reorder-url", help="a running rag-reorder server (default: the in-process scorer)"
    )
    g.add_argument(
        "--reorder-key-env",
        default="RAG_REORDER_API_KEY",
        help="environment variable holding the rag-reorder server's API key",
    )
    g.add_argument(
        "--reorder-timeout",
        type=float,
        default=300.0,
        help="seconds per reorder call (above the server's RAG_REORDER_REQUEST_TIMEOUT_S, "
        "so that its own deadline answers first)",
    )
    g.add_argument(
        "--reorder-retries",
        type=int,
        default=5,
        help="retries of a reorder call answered 429, 502, 503 (after its Retry-After) or "
        "504, or whose connection dropped; then that question fails for that variant, the run "
        "goes on and a rerun asks it again",
    )
    g.add_argument(
        "--max-calls",
        type=int,
        help="most generator HTTP attempts this invocation sends, retries included",
    )
    g.add_argument("--concurrency", type=int, default=4, help="questions in flight")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds per generator call")
    g.add_argument(
        "--retries",
        type=int,
        default=5,
        help="retries of a call refused with 429 or 503 or a refused connection (never of "
        "a 502, 504 or cut call: it may have run and been paid)",
    )
    g.add_argument(
        "--dry-run", action="store_true", help="print the cost estimate and call nothing"
    )

    cv = sub.add_parser(
        "convert-data",
        epilog=example("convert-data"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="convert a QA set from another format into the JSONL eval takes: `litm` (the "
        "lost-in-the-middle / DPR / FiD files: question, answers, ctxs)",
    )
    cv.add_argument("--from", dest="source_format", choices=("litm",), required=True)
    cv.add_argument("input", type=Path, help="the file to convert (.jsonl, .json or .gz)")
    cv.add_argument("output", type=Path, help="the JSONL to write")

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
        help="environment variable holding the API key (unset: no key sent; default: "
        "OPENAI_API_KEY, sent only to an https --base-url)",
    )
    pg.add_argument(
        "--data",
        type=Path,
        default=Path(TRAINING_DATA),
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
        "answer_prefix (service/prompting/prompts.py PromptTemplate)",
    )
    pg.add_argument("--max-calls", type=int, help="most calls this invocation makes")
    pg.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    pg.add_argument("--max-tokens", type=int, default=32, help="answer tokens per call")
    pg.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    pg.add_argument(
        "--retries",
        type=int,
        default=5,
        help="retries of a call refused with 429 or 503 or a refused connection (never of "
        "a 502, 504 or cut call: it may have run and been paid)",
    )
    pg.add_argument("--no-logprobs", action="store_true", help="do not ask for output log-probs")
    pg.add_argument("--seed", type=int, default=0, help="the distractors' arrangement")
    pg.add_argument("--alpha", type=float, default=0.05, help="level of the flatness test")
    pg.add_argument(
        "--tie-break",
        action="store_true",
        help="with --no-labels: an answer held by several passages goes to the one under which "
        "the scoring model (RAG_REORDER_MODEL, loaded here) finds it likeliest, not split",
    )
    pg.add_argument(
        "--top-slots",
        type=int,
        default=2,
        help="with --no-labels: strongest slots whose order must be stable for trust (1 or 2; "
        "1: the best slot alone, for a generator with one clear slot and a flat rest)",
    )
    pg.add_argument("--force", action="store_true", help="store a profile that looks flat")
    pg.add_argument(
        "--profile-model", help="the model name to store the profile under (default: --model)"
    )
    pg.add_argument(
        "--no-labels",
        action="store_true",
        help="no gold answers needed: one call per question, its passages in a random order, "
        "the answer attributed to the passages that hold it, and the slots' shares fitted "
        "(a position-based model) and judged by auto's trust rule",
    )
    pg.add_argument(
        "--threshold",
        type=float,
        default=0.6,
        help="with --no-labels: share of an answer's content words a passage must hold to "
        "support it when none holds the whole answer",
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
        ClientError: a bad argument (exit 2 in ``entrypoints.cli``).
        ReorderError: the work failed (exit 1).
    """
    if command == "calibrate-positions":
        return await commands.calibrate_positions(settings, args)
    if command == "eval":
        return await commands.eval(settings, args)
    if command == "convert-data":
        return commands.convert_data(args)
    if command == "eval-report":
        from offline.evaluation.rebuild import rebuild_report

        files = rebuild_report(args.out, pack=args.pack)
        print(json.dumps({"out": str(args.out), "files": [str(f) for f in files]}, indent=2))
        return 0
    if command == "profile-generator":
        return await commands.profile_generator(settings, args)
    if command == "distill":
        return await commands.distill(settings, args)
    if command == "distill-eval":
        return await commands.distill_eval(settings, args)
    raise AssertionError(command)
