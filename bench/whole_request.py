"""Whole-request admission on the real embedded model (issue 62): every strategy that calls the
model, on one NQ-Open question at 6 and then 10 passages, one request at a time against a real
server process; each answers 200 or is refused at once, none gets a 504, and admission's
estimate (``timing.estimated_s``, made before the first prompt is built) is set against the
seconds the model calls took (``timing.scoring_s``).

Run (about 10 minutes on this 2-core machine; resumes from its JSONL if interrupted)::

    python -m bench.whole_request --out results/bench/whole_request

and what the shipped deadline refused, under a longer one, to measure the estimate's error
there too::

    python -m bench.whole_request --out results/bench/whole_request_long --timeout 600 \
        --only moi:6,lore:6,self_consistency:10   # the first two measure the rates

It starts ``python -m entrypoints serve`` on the embedded default (the packaged SmolLM2, CPU)
with the shipped ``request_timeout_s`` (120 s), writes one row per request to ``requests.jsonl`` and
the table to ``whole_request.md``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.server_process import free_port, start_server
from service.config.settings import Settings
from service.passage import Passage
from service.strategies import STRATEGIES as REGISTRY
from service.strategies.request import ReorderRequest

# Every registered strategy that calls the model, by the cost it states for six passages (the
# others make no call: nothing to estimate).
_SIX = ReorderRequest("q", [Passage(f"passage {i}") for i in range(6)])
STRATEGIES = tuple(n for n, s in REGISTRY.items() if s.cost(_SIX, Settings()).prompts > 0)
SIZES = (6, 10)


def body(question: Any, strategy: str) -> dict[str, Any]:
    return {
        "query": question.question,
        "passages": [{"title": p.title, "text": p.text} for p in question.passages],
        "strategy": strategy,
    }


def one(client: httpx.Client, url: str, question: Any, strategy: str, n: int) -> dict[str, Any]:
    t = time.perf_counter()
    r = client.post(f"{url}/v1/reorder", json=body(question, strategy))
    elapsed = time.perf_counter() - t
    row: dict[str, Any] = {
        "strategy": strategy,
        "passages": n,
        "status": r.status_code,
        "elapsed_s": round(elapsed, 3),
    }
    data = r.json()
    if r.status_code == 200:
        timing, usage = data["timing"], data["usage"]
        row.update(
            estimated_s=timing["estimated_s"],
            scoring_s=timing["scoring_s"],
            total_s=timing["total_s"],
            prompts=data["diagnostics"]["prompts"],
            prompt_tokens=usage["prompt_tokens"],
            generated_tokens=usage["generated_tokens"],
            path=(data.get("auto") or {}).get("path"),
        )
    else:
        err = data["error"]
        row.update(code=err["code"], message=err["message"], estimated_s=err.get("value"))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | passages | status | answered in s | estimated s | in the model s | "
        "estimate / measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        est = r.get("estimated_s")
        measured = r.get("scoring_s")
        ratio = f"{est / measured:.2f}" if est and measured else "-"
        status = str(r["status"]) + (f" {r['code']}" if "code" in r else "")
        lines.append(
            f"| {r['strategy']}{' (' + r['path'] + ')' if r.get('path') else ''} | "
            f"{r['passages']} | {status} | {r['elapsed_s']:.2f} | "
            f"{'-' if est is None else f'{est:.1f}'} | "
            f"{'-' if measured is None else f'{measured:.1f}'} | {ratio} |"
        )
    n504 = sum(r["status"] == 504 for r in rows)
    refused = [r for r in rows if r["status"] != 200]
    slowest_refusal = max((r["elapsed_s"] for r in refused), default=0.0)
    lines += [
        "",
        f"{len(rows)} requests: {sum(r['status'] == 200 for r in rows)} answered, "
        f"{len(refused)} refused (slowest refusal {slowest_refusal:.2f} s), {n504} got a 504.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = report.parser("whole_request", __doc__, data=True)
    # A folder: the rows as they come (resumable), the table, the server's log.
    ap.set_defaults(out=str(report.RESULTS / "whole_request"))
    ap.add_argument("--question", type=int, default=0, help="index in the dev NQ-Open file")
    ap.add_argument(
        "--timeout", type=float, default=None, help="request_timeout_s (default: the shipped)"
    )
    ap.add_argument(
        "--only",
        default=None,
        help="strategy:passages,... (default: all); with a longer --timeout this measures "
        "what the shipped deadline refuses",
    )
    args = ap.parse_args()
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "requests.jsonl"
    rows = report.read_jsonl(path)
    done = {(r["strategy"], r["passages"]) for r in rows}
    todo = [(n, s) for n in SIZES for s in STRATEGIES if (s, n) not in done]
    if args.only:
        wanted = {(s, int(n)) for s, n in (x.split(":") for x in args.only.split(","))}
        todo = [(n, s) for n, s in todo if (s, n) in wanted]

    from offline.evaluation.runner import prepare
    from service.batch.dataset import load_examples

    example = load_examples(Path(args.data), limit=args.question + 1)[args.question]
    if todo:
        port = free_port()
        env = {
            "HF_HUB_OFFLINE": "1",
            # A fresh store: no profile learned by an earlier run changes auto's path.
            "RAG_REORDER_BIAS_PROFILE_DIR": tempfile.mkdtemp(prefix="whole-request-"),
            "RAG_REORDER_LOG_LEVEL": "info",
        }
        if args.timeout is not None:
            env["RAG_REORDER_REQUEST_TIMEOUT_S"] = str(args.timeout)
        proc = start_server(ROOT, port, env, args.out / "server.log", ready_s=900)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=600) as client:
                for n, strategy in todo:
                    row = one(client, url, prepare(example, n), strategy, n)
                    print(json.dumps(row), flush=True)
                    report.append(path, row)
                    rows.append(row)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    order = {(s, n): i for i, (n, s) in enumerate((n, s) for n in SIZES for s in STRATEGIES)}
    if args.only:
        rows = [r for r in rows if (r["strategy"], r["passages"]) in wanted]
    rows.sort(key=lambda r: order.get((r["strategy"], r["passages"]), 0))
    text = table(rows)
    (args.out / "whole_request.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
