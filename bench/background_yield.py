"""What the service's own engine work costs a caller who arrives while it runs, on the
embedded SmolLM2 through a real server process, for two checkouts of the service side by side
(``--arms name=path,...``: the code before and after a change). The work is started by a
``--trigger`` request just before the caller's: ``auto`` (its cold path queues a MoI learning
run for the background) or a strategy refused 422 ``deadline_unreachable`` (``convex_score``:
a refusal asks the rate canary to re-measure the engine).

Per arm, one server; per question (NQ-Open dev, 10 passages), the caller's ``--strategy``
request twice, paired: **alone** (the engine idle, nothing queued) and **after the
trigger** (the trigger request, then ``--gap-s`` later the caller's). Reported per arm:
the caller's seconds in both, the paired difference (what the service's own work added to
the caller's time), and the answers that were not 200 (an admitted request stopped early
by the progress check is a 503). Arms alternate question by question, so a slower hour
weighs on both.

Run::

    python -m bench.background_yield --arms before=/tmp/before,after=. --questions 6 \
        --out results/bench/background_yield

``<out>/requests.jsonl`` gets one row per request and is resumed from; ``<out>/summary.json``
and ``<out>/summary.md`` are written from every row at the end.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.estimates import one
from bench.server_process import free_port, start_server

PASSAGES = 10


def summarise(rows: Sequence[dict[str, Any]], arms: Sequence[str], trigger: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        alone = {r["question"]: r for r in mine if r["condition"] == "alone"}
        after = {r["question"]: r for r in mine if r["condition"] == f"after_{trigger}"}
        paired = [
            (alone[q]["elapsed_s"], after[q]["elapsed_s"])
            for q in alone
            if q in after and alone[q]["status"] == after[q]["status"] == 200
        ]
        added = [b - a for a, b in paired]
        out[arm] = {
            "questions": len(alone),
            "not_200": [
                {k: r.get(k) for k in ("condition", "question", "status", "message")}
                for r in mine
                if r["status"] != 200
            ],
            "alone_s_median": statistics.median(a for a, _ in paired) if paired else None,
            "after_trigger_s_median": statistics.median(b for _, b in paired) if paired else None,
            "added_s_median": statistics.median(added) if added else None,
            "added_s_max": max(added) if added else None,
        }
    return out


def table(summary: dict[str, Any], strategy: str, trigger: str) -> str:
    lines = [
        f"Caller's `{strategy}` request (10 passages, embedded SmolLM2) alone and right after "
        f"a `{trigger}` request, paired by question.",
        "",
        f"| arm | questions | alone, median s | after {trigger}, median s | added, median s | "
        "added, max s | not 200 |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for arm, s in summary.items():

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        bad = ", ".join(f"{b['status']} ({b['condition']})" for b in s["not_200"]) or "none"
        lines.append(
            f"| {arm} | {s['questions']} | {f(s['alone_s_median'])} | "
            f"{f(s['after_trigger_s_median'])} | {f(s['added_s_median'])} | "
            f"{f(s['added_s_max'])} | {bad} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = report.parser("background_yield", __doc__, data=True)
    ap.set_defaults(out=str(report.RESULTS / "background_yield"))
    ap.add_argument("--arms", default=f"after={ROOT}", help="name=checkout,... (side by side)")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--strategy", default="moi", help="the caller's strategy")
    ap.add_argument("--trigger", default="auto", help="the request before the caller's")
    ap.add_argument("--gap-s", type=float, default=1.0, help="trigger to caller's request")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = dict(a.split("=", 1) for a in args.arms.split(","))
    path = out / "requests.jsonl"
    rows = report.read_jsonl(path)
    done = {(r["arm"], r["condition"], r["question"]) for r in rows}

    from offline.evaluation.runner import prepare
    from service.batch.dataset import load_examples

    questions = [prepare(e, PASSAGES) for e in load_examples(Path(args.data), limit=args.questions)]
    servers: dict[str, tuple[Any, str]] = {}
    wanted = {
        (arm, c, q.id)
        for arm in arms
        for q in questions
        for c in ("alone", f"after_{args.trigger}")
    }
    try:
        for arm, root in arms.items() if wanted - done else ():
            port = free_port()
            env = {
                "HF_HUB_OFFLINE": "1",
                # A fresh store: auto has no profile and takes its cold path.
                "RAG_REORDER_BIAS_PROFILE_DIR": tempfile.mkdtemp(prefix="yield-"),
                "RAG_REORDER_LOG_LEVEL": "info",
            }
            proc = start_server(
                Path(root).resolve(), port, env, out / f"server_{arm}.log", ready_s=900
            )
            servers[arm] = (proc, f"http://127.0.0.1:{port}")
        with httpx.Client(timeout=900) as client:
            for question in questions:
                for arm, (_, url) in servers.items():
                    if (arm, "alone", question.id) not in done:
                        row: dict[str, Any] = {
                            "arm": arm,
                            "condition": "alone",
                            "question": question.id,
                        }
                        row |= one(client, url, question, args.strategy)
                        print(json.dumps(row), flush=True)
                        report.append(path, row)
                        rows.append(row)
                    after = f"after_{args.trigger}"
                    if (arm, after, question.id) not in done:
                        trigger = one(client, url, question, args.trigger)
                        time.sleep(args.gap_s)
                        row = {"arm": arm, "condition": after, "question": question.id}
                        row |= one(client, url, question, args.strategy)
                        row[args.trigger] = trigger
                        print(json.dumps(row), flush=True)
                        report.append(path, row)
                        rows.append(row)
                        # Let a background run that outlived the caller's request end.
                        time.sleep(2)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    summary = summarise(rows, list(arms), args.trigger)
    result = {
        **report.provenance(),
        "strategy": args.strategy,
        "trigger": args.trigger,
        "gap_s": args.gap_s,
        "arms": {a: str(Path(r).resolve()) for a, r in arms.items()},
        "summary": summary,
    }
    report.write(result, out / "summary.json")
    text = table(summary, args.strategy, args.trigger)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
