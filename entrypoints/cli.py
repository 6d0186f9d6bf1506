"""``rag-reorder``: serve the API, reorder once, calibrate a bias profile, evaluate, distill a
scorer, list profiles.

Configuration comes from the environment (``RAG_REORDER_*``, see docs/configuration.md); the
few flags below override it for one run.
"""
# The one command line: the serving commands (serve, reorder, calibrate, profiles) are here; the
# offline ones (evaluation, distillation, positional and generator profiles) live in
# offline/cli.py, added to this parser and run from there. A new serving command: its parser in
# _parser, an example in EXAMPLES, a branch in main.

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

# Dense numerics on small matrices: one BLAS thread is faster and leaves cores to the model.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from offline import cli as offline_cli
from service.batch.commandline import TRAINING_DATA, open_pipeline, progress_line, read_examples
from service.config.settings import Settings
from service.errors import ClientError, ReorderError
from service.passage import Passage
from service.strategies import strategy_names
from service.strategies.request import DesignKind, Placement

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
    if settings.strategy not in strategy_names():
        # The settings sit below the strategies' registry, so they cannot check the name
        # themselves: refused here, before any model loads, as a bad setting always was.
        known = ", ".join(strategy_names())
        _fail(
            f"invalid configuration: RAG_REORDER_STRATEGY {settings.strategy!r} is not a "
            f"strategy ({known})"
        )
        return 2
    try:
        if args.command == "serve":
            if settings.workers > 1:
                from entrypoints.workers import serve_workers

                serve_workers(settings, args.host, args.port)
                return 0
            from entrypoints.server import serve

            serve(settings, args.host, args.port)
            return 0
        if args.command == "reorder":
            return asyncio.run(_reorder(settings, args))
        if args.command == "calibrate":
            return asyncio.run(_calibrate(settings, args))
        if args.command in offline_cli.EXAMPLES:
            return asyncio.run(offline_cli.run(args.command, settings, args))
        if args.command == "profiles":
            from service.state.positional_store import PositionalStore
            from service.state.profile_store import ProfileStore

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
_TRAIN = TRAINING_DATA
EXAMPLES: dict[str, tuple[str, ...]] = {
    "serve": ("serve", "--host", "0.0.0.0", "--port", "8000"),
    "reorder": (
        "reorder",
        *("--query", "What is the capital of France?", "--passages", "passages.json"),
        *("--placement", "bias_matched"),
    ),
    "calibrate": ("calibrate", "--data", _TRAIN, "--limit", "20", "--max-passages", "10"),
    **offline_cli.EXAMPLES,
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
    p.add_argument("--backend", choices=("auto", "vllm", "transformers", "remote", "paced"))
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
    s.add_argument(
        "--forwarded-allow-ips",
        help="proxies whose X-Forwarded-For is believed (comma-separated addresses or CIDR "
        "ranges, * for any; default RAG_REORDER_FORWARDED_ALLOW_IPS, else 127.0.0.1)",
    )

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
    r.add_argument("--design", choices=_DESIGNS, help="default: adaptive")
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

    offline_cli.add_commands(sub, _example)
    sub.add_parser(
        "profiles",
        epilog=_example("profiles"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="list the stored profiles: MoI bias profiles (calibrate) and positional ones "
        "(calibrate-positions)",
    )
    return p


def _settings(args: argparse.Namespace) -> Settings:
    keys = ("backend", "model", "device", "forwarded_allow_ips")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None)}
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
    from app.schemas.reorder import with_defaults
    from service.pipeline import DesignSpec, ReorderRequest, StrategyOptions

    passages = read_passages(args.passages)
    design_args = (args.design, args.num_prompts, args.prompt_passages)
    strategy, placement = with_defaults(
        args.strategy,
        args.placement,
        settings,
        moi_options=args.joint or args.variable_pruning or any(a is not None for a in design_args),
    )
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
    async with open_pipeline(settings) as reorderer:
        reorderer.planned_prompts(req)  # refuse bad options before the model loads further
        result = await reorderer.reorder(req)
    print(reorder_response(result, passages).model_dump_json(indent=2))
    return 0


async def _calibrate(settings: Settings, args: argparse.Namespace) -> int:
    from service.batch.calibration import calibrate_profile

    examples = read_examples(args.data, args.limit)
    async with open_pipeline(settings) as reorderer:
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
            progress=progress_line("calibrating", "queries"),
        )
    print(file=sys.stderr)
    out: dict[str, Any] = asdict(report.profile)
    out.update(queries=report.queries, prompts=report.prompts, warnings=list(report.warnings))
    out["prompts_failed"] = report.prompts_failed
    if report.orienting is not None:
        out["orienting_profile"] = asdict(report.orienting)
    print(json.dumps(out, indent=2))
    return 0


def _fail(message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
    print(
        json.dumps({"error": {"type": code, "message": message, "param": param}}), file=sys.stderr
    )


if __name__ == "__main__":
    raise SystemExit(main())
