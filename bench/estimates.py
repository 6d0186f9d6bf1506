"""Admission's estimates against what requests really cost (issue 77): every named strategy
that calls the model, N requests each of 10 passages (the first N NQ-Open dev questions),
through one real server process on the embedded SmolLM2, quiet or with competing CPU
processes; per request admission's estimate (``timing.estimated_s``, made before the first
prompt) beside the seconds the model calls took (``timing.scoring_s``), and per strategy the
median and worst of estimate / actual.

Run (the full measurement: 20 requests per strategy, quiet, then with one competing process)::

    python -m bench.estimates --requests 20
    python -m bench.estimates --requests 20 --compete

Requests go round-robin (question 0 for every strategy, then question 1, ...), one at a time,
so the server's measured rates come from mixed traffic, as they would on a shared service.
Each run appends one row per request to ``<out>/requests.jsonl`` and skips the rows already
there (interrupted, it resumes); ``<out>/estimates.json`` and ``<out>/estimates.md`` are
written from every row of the condition at the end. A request refused (422, 503) has the
refusal's estimate and no actual time; a 504 is counted apart: admitted work that missed its
deadline.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.server_process import free_port, start_server
from bench.whole_request import STRATEGIES

PASSAGES = 10
_EXPECTED = re.compile(r"admission estimated its model calls at ([0-9.]+) s")
BUSY = "while True: pass"
"""A competing process: one core's worth of pure-Python spinning."""


def body(question: Any, strategy: str) -> dict[str, Any]:
    return {
        "query": question.question,
        "passages": [{"title": p.title, "text": p.text} for p in question.passages],
        "strategy": strategy,
    }


def one(client: httpx.Client, url: str, question: Any, strategy: str) -> dict[str, Any]:
    """One request's row: its status, admission's estimate and the model's seconds."""
    t = time.perf_counter()
    r = client.post(f"{url}/v1/reorder", json=body(question, strategy))
    row: dict[str, Any] = {
        "strategy": strategy,
        "question": question.id,
        "status": r.status_code,
        "elapsed_s": round(time.perf_counter() - t, 3),
        # The machine's load when it ended: "quiet" is only quiet if nothing else ran.
        "load_1m": round(os.getloadavg()[0], 2),
    }
    data = r.json()
    if r.status_code == 200:
        timing, usage = data["timing"], data["usage"]
        row.update(
            estimated_s=timing["estimated_s"],
            scoring_s=timing["scoring_s"],
            tokenize_s=timing["tokenize_s"],
            solver_s=timing["solver_s"],
            total_s=timing["total_s"],
            prompts=data["diagnostics"]["prompts"],
            prompts_scored=usage["prompts_scored"],
            generations=usage["generations"],
            prompt_tokens=usage["prompt_tokens"],
            generated_tokens=usage["generated_tokens"],
            path=(data.get("auto") or {}).get("path"),
        )
    else:
        err = data.get("error", {})
        row.update(code=err.get("code"), message=err.get("message"), estimated_s=err.get("value"))
        # A 504 carries admission's estimate in its message only (its body has no value).
        said = _EXPECTED.search(err.get("message") or "")
        if row["estimated_s"] is None and said:
            row["estimated_s"] = float(said.group(1))
    return row


def ratio(row: dict[str, Any]) -> float | None:
    """Estimate / actual model seconds of an answered request (``None``: either missing)."""
    est, actual = row.get("estimated_s"), row.get("scoring_s")
    if est is None or not actual:
        return None
    return float(est) / float(actual)


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy: statuses, and over its answered requests the median estimate / actual
    and the worst (furthest from 1 either way: ``max(r, 1 / r)``), with their seconds."""
    out: dict[str, dict[str, Any]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        statuses: dict[str, int] = {}
        for r in mine:
            key = str(r["status"]) + (f" {r['code']}" if r.get("code") else "")
            statuses[key] = statuses.get(key, 0) + 1
        ratios = [x for x in (ratio(r) for r in mine) if x is not None]
        worst = max(ratios, key=lambda x: max(x, 1 / x)) if ratios else None
        answered = [r for r in mine if r["status"] == 200]
        out[strategy] = {
            "requests": len(mine),
            "statuses": statuses,
            "estimated": len(ratios),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_worst": worst,
            "within_2x": sum(0.5 <= x <= 2.0 for x in ratios),
            "actual_s_median": (
                statistics.median(r["scoring_s"] for r in answered) if answered else None
            ),
            "estimated_s_median": (
                statistics.median(r["estimated_s"] for r in mine if r.get("estimated_s"))
                if any(r.get("estimated_s") for r in mine)
                else None
            ),
            "elapsed_s_max": max(r["elapsed_s"] for r in mine),
            "load_1m_median": (
                statistics.median(r["load_1m"] for r in mine if "load_1m" in r)
                if any("load_1m" in r for r in mine)
                else None
            ),
            "504": sum(r["status"] == 504 for r in mine),
        }
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def table(summary: dict[str, dict[str, Any]], condition: str, note: str) -> str:
    lines = [
        f"Admission's estimate / the model's seconds, {PASSAGES} passages, {condition} ({note}).",
        "",
        "| strategy | requests | answers | estimate / actual, median | worst | within 2x | "
        "estimated s, median | actual s, median | slowest answer s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, s in summary.items():
        answers = ", ".join(f"{n}x {k}" for k, n in s["statuses"].items())
        lines.append(
            f"| {strategy} | {s['requests']} | {answers} | {_f(s['ratio_median'], '.2f')} | "
            f"{_f(s['ratio_worst'], '.2f')} | {s['within_2x']} of {s['estimated']} | "
            f"{_f(s['estimated_s_median'], '.1f')} | {_f(s['actual_s_median'], '.1f')} | "
            f"{s['elapsed_s_max']:.1f} |"
        )
    n504 = sum(s["504"] for s in summary.values())
    loads = [s["load_1m_median"] for s in summary.values() if s["load_1m_median"] is not None]
    lines += ["", f"{n504} admitted request(s) got a 504."]
    if loads:
        load = statistics.median(loads)
        lines.append(
            f"Machine load (1-minute average) at the requests' ends: median {load:.1f} on "
            f"{os.cpu_count()} CPUs."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = report.parser("estimates", __doc__, data=True)
    ap.set_defaults(out=str(report.RESULTS / "estimates"))
    ap.add_argument("--requests", type=int, default=20, help="requests per strategy (N)")
    ap.add_argument(
        "--compete",
        type=int,
        nargs="?",
        const=1,
        default=0,
        help="competing busy processes while measuring (bare flag: 1)",
    )
    ap.add_argument("--only", default=None, help="comma-separated strategies (default: every one)")
    ap.add_argument(
        "--note",
        default=None,
        help="what this run is, written beside its table (default: the full measurement)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    condition = "quiet" if not args.compete else f"{args.compete} competing process(es)"
    strategies = args.only.split(",") if args.only else list(STRATEGIES)
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        ap.error(f"--only names {sorted(unknown)}, not among {list(STRATEGIES)}")
    path = out / "requests.jsonl"
    rows = report.read_jsonl(path)
    done = {(r["condition"], r["strategy"], r["question"]) for r in rows}

    from offline.evaluation.runner import prepare
    from service.batch.dataset import load_examples

    questions = [prepare(e, PASSAGES) for e in load_examples(Path(args.data), limit=args.requests)]
    todo = [(q, s) for q in questions for s in strategies if (condition, s, q.id) not in done]
    if todo:
        port = free_port()
        env = {
            "HF_HUB_OFFLINE": "1",
            # A fresh store: no profile learned by an earlier run changes auto's path.
            "RAG_REORDER_BIAS_PROFILE_DIR": tempfile.mkdtemp(prefix="estimates-"),
            "RAG_REORDER_LOG_LEVEL": "info",
        }
        proc = start_server(ROOT, port, env, out / "server.log", ready_s=900)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.compete)]
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=900) as client:
                for question, strategy in todo:
                    row = {"condition": condition, **one(client, url, question, strategy)}
                    print(json.dumps(row), flush=True)
                    report.append(path, row)
                    rows.append(row)
        finally:
            for p in busy:
                p.terminate()
                p.wait(timeout=30)
            proc.terminate()
            proc.wait(timeout=60)
    wanted = {q.id for q in questions}
    mine = [
        r
        for r in rows
        if r["condition"] == condition and r["strategy"] in strategies and r["question"] in wanted
    ]
    summary = summarise(mine)
    note = args.note or f"{args.requests} requests per strategy"
    result = {
        **report.provenance(),
        "condition": condition,
        "passages": PASSAGES,
        "requests_per_strategy": args.requests,
        "note": note,
        "strategies": summary,
    }
    stem = "estimates" if not args.compete else "estimates_compete"
    report.write(result, out / f"{stem}.json")
    text = table(summary, condition, note)
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
