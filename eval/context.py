"""Issue 93's evidence: fewer generator prompt tokens at no loss of accuracy?

Per question of a development set (cut to 10 passages as ``rag-reorder eval`` cuts them, or
to ``--passages N``), MoI runs once (``pruned_random``, ``bias_matched``, the committed bias
profiles of ``results/eval/profiles/<set>``, as in ``results/eval/<set>``'s best committed
row) and the generator (the same SmolLM2, greedy, 32 tokens, ``qa_default``) answers these
contexts:

- ``all``: all 10 passages, placed by the profile (MoI ``bias_matched``);
- ``top3``, ``top5``: the retriever's first K passages, in the retriever's order;
- ``budget@top3``, ``budget@top5``: the service's budget rule (``service.context``) at the
  budget the retriever's top-K takes in this question (its documents block, exact tokens);
- ``distractors``: the distractor rule (``not_credibly_below``, floor = mean, 0.9);
- ``distractors_above``: ``credibly_above`` (floor = mean, 0.9);
- ``document`` (HotpotQA: titles as sources): ``all`` with each title's passages together.

``--generator google/gemma-3-270m`` has another generator answer: MoI's fit is read from the
SmolLM2 run's records (``fit``: ranking, utilities, standard errors, covariance), placed by
that generator's stored profile (``results/eval/profiles/<set>__smollm2-135m__<generator>``),
and the contexts are counted in its tokenizer and rendered in its template.

Each record keeps the context's order, its documents-block tokens, the generator's full
prompt tokens, the answer and its scores. Output is one JSON line a question, appended as it
finishes (a rerun skips finished questions); ``--report`` prints the table with paired
bootstrap intervals against ``all``.

    nice -n 5 python eval/context.py --set nq_open_dev --limit 100
    python eval/context.py --set nq_open_dev --report
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from offline.evaluation.metrics import score_answer
from offline.evaluation.runner import prepare
from offline.evaluation.stats import paired_comparison
from service.batch.dataset import load_examples
from service.config.settings import EMBEDDED_MODEL, Settings
from service.context.window import ContextOptions, DistractorOptions, build_window
from service.passage import Passage
from service.pipeline import Reorderer
from service.prompting.templates import get_template
from service.strategies.request import DesignSpec, ReorderRequest
from solver import place_ranking, resample

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "eval" / "context"
MAX_PASSAGES = 10
MAX_ANSWER_TOKENS = 32
VARIANTS = (
    "all",
    "top3",
    "top5",
    "budget@top3",
    "budget@top5",
    "distractors",
    "distractors_above",
    "document",
)


def block_tokens(tok: Any, passages: list[Passage], order: list[int], template: str) -> int:
    tpl = get_template(template)
    text = tpl.separator.join(tpl.render_document(k, passages[i])[0] for k, i in enumerate(order))
    return len(tok.encode(text).ids)


def fit_record(ranking: list[int], fit: Any) -> dict[str, Any]:
    """What the budget and distractor rules read of MoI's fit, kept so another generator's
    pass (``--generator``) reuses it instead of scoring the question again."""
    return {
        "ranking": list(ranking),
        "utilities": np.asarray(fit.utilities, dtype=float).tolist(),
        "stderr": None
        if fit.utility_stderr is None
        else np.asarray(fit.utility_stderr, dtype=float).tolist(),
        "cov": None if fit.utility_cov is None else np.asarray(fit.utility_cov).tolist(),
    }


def stored_fit(rec: dict[str, Any]) -> Any:
    f = rec["fit"]
    return SimpleNamespace(
        utilities=np.asarray(f["utilities"]),
        utility_stderr=None if f["stderr"] is None else np.asarray(f["stderr"]),
        utility_cov=None if f["cov"] is None else np.asarray(f["cov"]),
    )


def source_passages(q: Any, is_hotpot: bool) -> list[Passage]:
    passages = list(q.passages)
    if is_hotpot:
        # Titles as sources (OP-RAG's document order needs them); offsets: input position.
        passages = [
            Passage(p.text, p.title, source=p.title, offset=k) for k, p in enumerate(passages)
        ]
    return passages


async def moi(reorderer: Reorderer, q: Any, passages: list[Passage]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = await reorderer.reorder(
        ReorderRequest(
            query=q.question,
            passages=passages,
            strategy="moi",
            design=DesignSpec(kind="pruned_random"),
            placement="bias_matched",
            request_id=f"ctx-{q.id}",
        )
    )
    return result, time.perf_counter() - t0


async def answer(
    gen: Reorderer,
    template: str,
    q: Any,
    passages: list[Passage],
    placed: list[int],
    ranking: list[int],
    fit: Any,
    is_hotpot: bool,
) -> dict[str, Any]:
    """Every context of the module docstring, built by the service's rules in ``gen``'s
    tokenizer and template, answered by ``gen``'s model."""
    tok = gen.backend.tokenizer
    tpl = get_template(template)

    def window(options: ContextOptions) -> list[int]:
        return build_window(
            order=placed,
            ranking=ranking,
            fit=fit,
            passages=passages,
            options=options,
            tokenizer=tok,
            tokenizer_name=gen.backend.model_id,
            tokenizer_is_generator=True,
            template=tpl,
        ).order

    n = len(passages)
    orders: dict[str, list[int]] = {
        "all": list(placed),
        "top3": list(range(min(3, n))),
        "top5": list(range(min(5, n))),
    }
    for k in (3, 5):
        budget = block_tokens(tok, passages, list(range(min(k, n))), template)
        orders[f"budget@top{k}"] = window(ContextOptions(max_context_tokens=budget))
    orders["distractors"] = window(ContextOptions(distractors=DistractorOptions()))
    orders["distractors_above"] = window(
        ContextOptions(distractors=DistractorOptions(rule="credibly_above"))
    )
    if is_hotpot:
        orders["document"] = window(ContextOptions(order="document"))
    work = gen.work(f"ctx-gen-{q.id}")
    names = list(orders)
    prompts = await work.generation_prompts(
        q.question, passages, [orders[v] for v in names], template=template, room=MAX_ANSWER_TOKENS
    )
    # Contexts that render the same prompt (a rule that dropped nothing, document order on
    # sets with one passage a source) are answered once: greedy decoding gives them one answer.
    unique: dict[tuple[int, ...], Any] = {}
    for prompt in prompts:
        unique.setdefault(tuple(prompt.token_ids), prompt)
    t0 = time.perf_counter()
    generated = await work.generate(list(unique.values()), max_new_tokens=MAX_ANSWER_TOKENS)
    gen_s = time.perf_counter() - t0
    by_prompt = dict(zip(unique, generated, strict=True))
    answers = [by_prompt[tuple(p.token_ids)] for p in prompts]
    variants: dict[str, Any] = {}
    for v, prompt, ans in zip(names, prompts, answers, strict=True):
        text = ans.text if ans is not None else ""
        s = score_answer(text, q.answers)
        variants[v] = {
            "order": orders[v],
            "documents_tokens": block_tokens(tok, passages, orders[v], template),
            "prompt_tokens": len(prompt.token_ids),
            "gold_kept": len(set(q.gold) & set(orders[v])),
            "answer": text,
            "accuracy": s.accuracy,
            "em": s.em,
            "f1": s.f1,
        }
    return {"generate_s": gen_s, "variants": variants}


def short_name(model: str) -> str:
    """``google/gemma-3-270m`` -> ``gemma-3-270m``: the name in result and profile folders."""
    return model.rsplit("/", 1)[-1].lower()


def out_path(args: argparse.Namespace, *, scorer: bool = False) -> Path:
    """``<set>[__<generator>][__p<passages>].jsonl``, 10 passages without the suffix;
    ``scorer``: the SmolLM2 run's file (where another generator's pass reads the fits)."""
    name = args.set
    if args.generator and not scorer:
        name += f"__{short_name(args.generator)}"
    if args.passages != MAX_PASSAGES:
        name += f"__p{args.passages}"
    return OUT / f"{name}.jsonl"


def _append(path: Path, rec: dict[str, Any]) -> None:
    # One write of the whole line on an O_APPEND file: shards (--shard) append side by side.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def _done(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


async def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from service.backends.factory import create_backend

    if args.threads:
        import torch

        # Two runs side by side (one a set) on a 2-core host: one thread each, no contention.
        torch.set_num_threads(args.threads)
    is_hotpot = args.set.startswith("hotpot")
    profiles = ROOT / "results" / "eval" / "profiles"
    out = out_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(out)
    scorer_settings = Settings(
        model=EMBEDDED_MODEL,
        device="cpu",
        dtype="float32",
        bias_profile_dir=profiles / args.set,
    )
    scorer: Reorderer | None = None
    gen: Reorderer | None = None
    template = "qa_default"
    coefficients: np.ndarray | None = None
    gen_settings: Settings | None = None
    if args.generator is not None:
        # Another generator: MoI's fit is the scorer's (SmolLM2), read from the SmolLM2 run's
        # records where it kept one; placed by the generator's own stored profile (what
        # ``moi:<design>:generator_bias`` does in ``rag-reorder eval``); contexts counted in the
        # generator's tokens and rendered in its template.
        gen_settings = Settings(model=args.generator, device="cpu", dtype="float32")
        template = gen_settings.chat_template
        folder = profiles / f"{args.set}__smollm2-135m__{short_name(args.generator)}"
        [path] = folder.glob(f"*__{template}__L{MAX_PASSAGES}.json")
        coefficients = np.asarray(json.loads(path.read_text())["coefficients"])
        if args.passages != MAX_PASSAGES:
            # No profile is stored at other slot counts: the 10-slot one resampled, as MoI's
            # adaptive design fixes a stored profile of another slot count.
            coefficients = np.asarray(resample(coefficients, args.passages))
        scored = _done(out_path(args, scorer=True))
        fits = {k: r for k, r in scored.items() if "fit" in r}
    else:
        scored, fits = {}, {}
    data = Path(args.data) / f"{args.set}.jsonl"
    shard, shards = args.shard
    for k, ex in enumerate(load_examples(data, limit=args.limit)):
        q = prepare(ex, args.passages)
        if k % shards != shard or q.id in done or (args.only_scored and q.id not in scored):
            continue
        passages = source_passages(q, is_hotpot)
        rec: dict[str, Any] = {"id": q.id, "gold": list(q.gold)}
        placed: list[int] = []
        if q.id in fits:
            fit = stored_fit(fits[q.id])
            ranking = fits[q.id]["fit"]["ranking"]
            rec["moi_s"] = None
        else:
            if scorer is None:
                scorer = Reorderer(create_backend(scorer_settings), scorer_settings)
            result, rec["moi_s"] = await moi(scorer, q, passages)
            fit, ranking = result.fit, list(result.ranking)
            rec["fit"] = fit_record(ranking, fit)
            placed = list(result.order)
        if coefficients is not None:
            placed = place_ranking(ranking, "bias_matched", coefficients)
        if gen is None:  # loaded on the first question to answer: a follower often has none
            gen = Reorderer(create_backend(gen_settings), gen_settings) if gen_settings else scorer
        assert gen is not None
        rec.update(await answer(gen, template, q, passages, placed, ranking, fit, is_hotpot))
        _append(out, rec)
        print(q.id, {v: r["accuracy"] for v, r in rec["variants"].items()}, flush=True)


GOAL_TOKENS = -0.30  # the goal: at least 30% fewer prompt tokens than all placed ...
GOAL_LOSS = -0.02  # ... with the paired interval's lower bound no lower than this


def _paired(recs: list[dict[str, Any]], v: str, base: str, metric: str) -> Any:
    rows = [r for r in recs if v in r["variants"] and base in r["variants"]]
    pairs = [(r["variants"][v][metric], r["variants"][base][metric]) for r in rows]
    return paired_comparison(metric, v, base, pairs, seed=0)


def _needed(recs: list[dict[str, Any]], v: str, metric: str) -> str:
    """About how many questions the goal's interval would need at this row's mean and spread
    of paired differences (normal approximation), or that the mean itself is a loss."""
    d = np.array([r["variants"][v][metric] - r["variants"]["all"][metric] for r in recs])
    if d.mean() <= GOAL_LOSS:
        return ": a loss beyond 0.02"
    sd = d.std(ddof=1) if len(d) > 1 else 0.0
    return f" (about {int(np.ceil((1.96 * sd / (d.mean() - GOAL_LOSS)) ** 2))} questions)"


def report(args: argparse.Namespace) -> str:
    recs = [json.loads(line) for line in out_path(args).read_text().splitlines()]
    metric = "f1" if args.set.startswith("hotpot") else "accuracy"
    answering = args.generator or EMBEDDED_MODEL
    lines = [
        f"{args.set}{'' if args.passages == MAX_PASSAGES else f' at {args.passages} passages'}"
        f": {len(recs)} questions, {answering} answering, metric {metric} "
        "(HotpotQA also EM)",
        "",
        f"| context | {metric} | EM | documents tokens | prompt tokens | tokens vs all "
        f"| gold kept | {metric} - all [95% CI] p | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    base_tok = np.mean([r["variants"]["all"]["prompt_tokens"] for r in recs])
    for v in VARIANTS:
        x = [r["variants"][v] for r in recs if v in r["variants"]]
        if not x:
            continue
        c = _paired(recs, v, "all", metric)
        tok = np.mean([y["prompt_tokens"] for y in x])
        saved = tok / base_tok - 1
        goal = (
            "-"
            if v in ("all", "document")  # the baseline; an order, not a cut
            else "met"
            if saved <= GOAL_TOKENS and c.ci_low >= GOAL_LOSS
            else f"not shown{_needed(recs, v, metric)}"
            if saved <= GOAL_TOKENS
            else "too few tokens saved"
        )
        lines.append(
            f"| {v} | {np.mean([y[metric] for y in x]):.3f} | {np.mean([y['em'] for y in x]):.3f} "
            f"| {np.mean([y['documents_tokens'] for y in x]):.0f} | {tok:.0f} "
            f"| {saved:+.1%} | {np.mean([y['gold_kept'] for y in x]):.2f} "
            f"| {c.mean_diff:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] p={c.p_value:.3g} "
            f"| {goal} |"
        )
    lines += [
        "",
        "At equal tokens (the budget rule at the retriever's top-K tokens against that top-K):",
        "",
        f"| K | {metric} budget / top-K | prompt tokens budget / top-K "
        f"| {metric} budget - top-K [95% CI] p |",
        "|---:|---|---|---|",
    ]
    for k in (3, 5):
        b, t = f"budget@top{k}", f"top{k}"
        c = _paired(recs, b, t, metric)
        mb, mt = (np.mean([r["variants"][v][metric] for r in recs]) for v in (b, t))
        tb, tt = (np.mean([r["variants"][v]["prompt_tokens"] for r in recs]) for v in (b, t))
        lines.append(
            f"| {k} | {mb:.3f} / {mt:.3f} | {tb:.0f} / {tt:.0f} "
            f"| {c.mean_diff:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] p={c.p_value:.3g} |"
        )
    return "\n".join(lines)


def _shard(text: str) -> tuple[int, int]:
    k, n = (int(x) for x in text.split("/"))
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"K/N with 0 <= K < N, not {text!r}")
    return k, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", required=True, choices=["nq_open_dev", "hotpot_dev"])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--report", action="store_true")
    p.add_argument(
        "--generator",
        default=None,
        help="another generator answering (google/gemma-3-270m): MoI's fits from the SmolLM2 "
        "run's records, placed by the generator's stored profile",
    )
    p.add_argument(
        "--only-scored",
        action="store_true",
        help="with --generator: only the questions the SmolLM2 run has finished (a pass that "
        "follows a running one)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument(
        "--passages",
        type=int,
        default=MAX_PASSAGES,
        help="passages a question (the sets' first N; 20 is NQ-Open's whole list); results in "
        "<set>[__<generator>]__p<N>.jsonl when not 10",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=(0, 1),
        metavar="K/N",
        help="only the questions whose index is K modulo N (N processes side by side, one file)",
    )
    args = p.parse_args()
    if args.report:
        print(report(args))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
