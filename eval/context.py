"""Issue 93's evidence: fewer generator prompt tokens at no loss of accuracy?

Per question of a development set (cut to 10 passages as ``rag-reorder eval`` cuts them), MoI
runs once (``pruned_random``, ``bias_matched``, the committed bias profiles of
``results/eval/profiles/<set>``, as in ``results/eval/<set>``'s best committed row) and the
generator (the same SmolLM2, greedy, 32 tokens, ``qa_default``) answers these contexts:

- ``all``: all 10 passages, placed by the profile (MoI ``bias_matched``);
- ``top3``, ``top5``: the retriever's first K passages, in the retriever's order;
- ``budget@top3``, ``budget@top5``: the service's budget rule (``service.context``) at the
  budget the retriever's top-K takes in this question (its documents block, exact tokens);
- ``distractors``: the distractor rule (``not_credibly_below``, floor = mean, 0.9);
- ``distractors_above``: ``credibly_above`` (floor = mean, 0.9);
- ``document`` (HotpotQA: titles as sources): ``all`` with each title's passages together.

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


def block_tokens(tok: Any, passages: list[Passage], order: list[int]) -> int:
    tpl = get_template("qa_default")
    text = tpl.separator.join(tpl.render_document(k, passages[i])[0] for k, i in enumerate(order))
    return len(tok.encode(text).ids)


async def one(reorderer: Reorderer, q: Any, is_hotpot: bool) -> dict[str, Any]:
    passages = list(q.passages)
    if is_hotpot:
        # Titles as sources (OP-RAG's document order needs them); offsets: input position.
        passages = [
            Passage(p.text, p.title, source=p.title, offset=k) for k, p in enumerate(passages)
        ]
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
    moi_s = time.perf_counter() - t0
    tok = reorderer.backend.tokenizer
    tpl = get_template("qa_default")

    def window(options: ContextOptions) -> list[int]:
        return build_window(
            order=result.order,
            ranking=result.ranking,
            fit=result.fit,
            passages=passages,
            options=options,
            tokenizer=tok,
            tokenizer_name=reorderer.backend.model_id,
            tokenizer_is_generator=True,
            template=tpl,
        ).order

    n = len(passages)
    orders: dict[str, list[int]] = {
        "all": list(result.order),
        "top3": list(range(min(3, n))),
        "top5": list(range(min(5, n))),
    }
    for k in (3, 5):
        budget = block_tokens(tok, passages, list(range(min(k, n))))
        orders[f"budget@top{k}"] = window(ContextOptions(max_context_tokens=budget))
    orders["distractors"] = window(ContextOptions(distractors=DistractorOptions()))
    orders["distractors_above"] = window(
        ContextOptions(distractors=DistractorOptions(rule="credibly_above"))
    )
    if is_hotpot:
        orders["document"] = window(ContextOptions(order="document"))
    work = reorderer.work(f"ctx-gen-{q.id}")
    names = list(orders)
    prompts = await work.generation_prompts(
        q.question, passages, [orders[v] for v in names], room=MAX_ANSWER_TOKENS
    )
    answers = await work.generate(prompts, max_new_tokens=MAX_ANSWER_TOKENS)
    rec: dict[str, Any] = {"id": q.id, "gold": list(q.gold), "moi_s": moi_s, "variants": {}}
    for v, prompt, ans in zip(names, prompts, answers, strict=True):
        text = ans.text if ans is not None else ""
        s = score_answer(text, q.answers)
        rec["variants"][v] = {
            "order": orders[v],
            "documents_tokens": block_tokens(tok, passages, orders[v]),
            "prompt_tokens": len(prompt.token_ids),
            "gold_kept": len(set(q.gold) & set(orders[v])),
            "answer": text,
            "accuracy": s.accuracy,
            "em": s.em,
            "f1": s.f1,
        }
    return rec


async def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = Path(args.data) / f"{args.set}.jsonl"
    out = OUT / f"{args.set}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = (
        {json.loads(line)["id"] for line in out.read_text().splitlines()} if out.exists() else set()
    )
    settings = Settings(
        model=EMBEDDED_MODEL,
        device="cpu",
        dtype="float32",
        bias_profile_dir=ROOT / "results" / "eval" / "profiles" / args.set,
    )
    from service.backends.factory import create_backend

    backend = create_backend(settings)
    reorderer = Reorderer(backend, settings)
    examples = load_examples(data, limit=args.limit)
    for ex in examples:
        q = prepare(ex, MAX_PASSAGES)
        if q.id in done:
            continue
        rec = await one(reorderer, q, args.set.startswith("hotpot"))
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(q.id, {v: r["accuracy"] for v, r in rec["variants"].items()}, flush=True)


def report(args: argparse.Namespace) -> str:
    recs = [json.loads(line) for line in (OUT / f"{args.set}.jsonl").read_text().splitlines()]
    metric = "f1" if args.set.startswith("hotpot") else "accuracy"
    lines = [
        f"{args.set}: {len(recs)} questions, metric {metric} (HotpotQA also EM)",
        "",
        f"| context | {metric} | EM | documents tokens | prompt tokens | tokens vs all "
        f"| gold kept | {metric} - all [95% CI] p |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base_tok = np.mean([r["variants"]["all"]["prompt_tokens"] for r in recs])
    for v in VARIANTS:
        rows = [r for r in recs if v in r["variants"]]
        if not rows:
            continue
        x = [r["variants"][v] for r in rows]
        pairs = [(r["variants"][v][metric], r["variants"]["all"][metric]) for r in rows]
        c = paired_comparison(metric, v, "all", pairs, seed=0)
        tok = np.mean([y["prompt_tokens"] for y in x])
        lines.append(
            f"| {v} | {np.mean([y[metric] for y in x]):.3f} | {np.mean([y['em'] for y in x]):.3f} "
            f"| {np.mean([y['documents_tokens'] for y in x]):.0f} | {tok:.0f} "
            f"| {tok / base_tok - 1:+.1%} | {np.mean([y['gold_kept'] for y in x]):.2f} "
            f"| {c.mean_diff:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] p={c.p_value:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", required=True, choices=["nq_open_dev", "hotpot_dev"])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    if args.report:
        print(report(args))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
