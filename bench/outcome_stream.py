"""``auto``'s randomized holdout on a live stream through the deployed path: orders from a
running rag-reorder server (the holdout on), answers from a running OpenAI-compatible
generator (vLLM's server on SmolLM2), the answer's NQ-Open accuracy reported back as the
outcome (``POST /v1/feedback``), and the server's uplift read after every outcome
(issue 92, docs/outcomes.md "A stream through the deployed path").

NQ-Open dev questions (``--data``), 10 passages each cut as ``rag-reorder eval`` cuts them (the
gold passage kept, no labels sent), in file order, replayed until ``--requests``; ``--concurrency``
clients. Per request: the arm and path the server chose, the generator's answer (the template's
API prompt for the served order, as ``rag-reorder eval --generator-url`` sends it: greedy, 32
tokens), its NQ-Open accuracy (a normalised gold answer in the answer's first line: the offline
evaluation's metric) and exact match, and the uplift the feedback's response carries. Appended to
``<out>.jsonl`` as measured (a rerun continues); ``--out`` gets the uplift at each checkpoint
(100, 200, 400, 1,000 requests, or as far as it got) beside the offline paired evaluation of the
same questions (``--offline``: ``rag-reorder eval``'s deployed answers, ``default`` against
``retriever``), and the arms' own means.

Usage: python -m bench.outcome_stream --reorder-url http://127.0.0.1:8767 \\
         --generator-url http://127.0.0.1:8766/v1 \\
         --generator-model HuggingFaceTB/SmolLM2-135M-Instruct \\
         --out results/bench/outcome_stream/smollm2.json   (bench/outcome_stream.sh starts both)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import report
from service.prompting.answers import exact_match, nq_accuracy
from service.prompting.prompts import api_prompt
from service.prompting.templates import get_template

CHECKPOINTS = (100, 200, 400, 1000)


def questions(data: Path, passages: int) -> list[Any]:
    from offline.evaluation.runner import prepare
    from service.batch.dataset import load_examples

    examples = load_examples(data)
    return [(ex, prepare(ex, passages)) for ex in examples]


async def one(
    k: int, item: Any, args: argparse.Namespace, client: httpx.AsyncClient
) -> dict[str, Any]:
    ex, q = item
    body = {
        "query": q.question,
        "passages": [{"title": p.title, "text": p.text} for p in q.passages],
    }
    r = await client.post(f"{args.reorder_url}/v1/reorder", json=body, timeout=900)
    r.raise_for_status()
    served = r.json()
    prompt = api_prompt(get_template(args.template), q.question, q.passages, served["order"])
    assert prompt.messages is not None
    g = await client.post(
        f"{args.generator_url}/chat/completions",
        json={
            "model": args.generator_model,
            "messages": [{"role": m.role, "content": m.content} for m in prompt.messages],
            "max_tokens": 32,
            "temperature": 0.0,
        },
        timeout=900,
    )
    g.raise_for_status()
    answer = g.json()["choices"][0]["message"]["content"] or ""
    acc = nq_accuracy(answer, ex.answers)
    fb = await client.post(
        f"{args.reorder_url}/v1/feedback",
        json={"id": served["feedback_id"], "outcome": acc, "answer": answer or "-"},
        timeout=120,
    )
    fb.raise_for_status()
    outcome = fb.json()["outcome"]
    auto = served.get("auto") or {}
    return {
        "request": k,
        "question_id": ex.id,
        "path": auto.get("path"),
        "arm": auto.get("arm"),
        "order": served["order"],
        "accuracy": acc,
        "em": exact_match(answer, ex.answers),
        "answer": answer,
        "counted": outcome["counted"],
        "uplift": outcome["uplift"],
        "t": time.time(),
    }


def offline_paired(path: Path, ids: set[str]) -> dict[str, Any] | None:
    """``default`` against ``retriever`` on the same questions, from ``rag-reorder eval``'s
    deployed answers (a paired bootstrap interval, as the evaluation reports)."""
    if not path.is_file():
        return None
    by: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["question_id"] in ids and row["variant"] in ("default", "retriever"):
            by.setdefault(row["question_id"], {})[row["variant"]] = float(row["accuracy"])
    pairs = [(v["default"], v["retriever"]) for v in by.values() if len(v) == 2]
    if not pairs:
        return None
    d = np.asarray([a - b for a, b in pairs])
    rng = np.random.default_rng(0)
    boot = rng.choice(d, size=(10_000, d.size)).mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return {
        "questions": int(d.size),
        "default": float(np.mean([a for a, _ in pairs])),
        "retriever": float(np.mean([b for _, b in pairs])),
        "difference": float(d.mean()),
        "interval_95": [float(lo), float(hi)],
    }


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: r["request"])
    points = []
    for c in [c for c in CHECKPOINTS if c <= len(rows)] + [len(rows)]:
        upto = rows[:c]
        last = next((r["uplift"] for r in reversed(upto) if r["uplift"] is not None), None)
        arms = {
            a: [r["accuracy"] for r in upto if r["arm"] == a and r["counted"]]
            for a in ("placed", "holdout")
        }
        ids = {r["question_id"] for r in upto}
        points.append(
            {
                "requests": c,
                "uplift": last,
                "arm_means": {a: (float(np.mean(v)) if v else None) for a, v in arms.items()},
                "arm_outcomes": {a: len(v) for a, v in arms.items()},
                "offline_paired_same_questions": offline_paired(Path(args.offline), ids),
            }
        )
    return {**report.provenance(), "requests": len(rows), "checkpoints": points}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    rows_path = out.with_suffix(".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = report.read_jsonl(rows_path)
    done = {r["request"] for r in rows}
    items = questions(Path(args.data), args.passages)
    todo = [k for k in range(args.requests) if k not in done]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in todo:
        queue.put_nowait(k)

    async with httpx.AsyncClient() as client:

        async def worker() -> None:
            while not queue.empty():
                k = queue.get_nowait()
                try:
                    row = await one(k, items[k % len(items)], args, client)
                except (httpx.HTTPError, KeyError) as exc:
                    print(f"request {k}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                report.append(rows_path, row)
                rows.append(row)
                u = row["uplift"] or {}
                print(
                    f"{len(rows)}: {row['arm']} acc {row['accuracy']:.0f} uplift "
                    f"{u.get('estimate')} [{u.get('lower')}, {u.get('upper')}] {u.get('verdict')} "
                    f"needed {u.get('needed')}",
                    flush=True,
                )
                if len(rows) in CHECKPOINTS or len(rows) % 25 == 0:
                    report.write(summary(rows, args), out)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return summary(rows, args)


def main() -> int:
    ap = report.parser("outcome_stream", __doc__, data=True)
    ap.add_argument("--reorder-url", default="http://127.0.0.1:8767")
    ap.add_argument("--generator-url", default="http://127.0.0.1:8766/v1")
    ap.add_argument("--generator-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--template", default="qa_default")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--offline", default="results/eval/deployed/answers.jsonl")
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
