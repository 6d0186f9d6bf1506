"""A cold ``auto`` on a CPU, before and after issue 70: the first requests of two
``bench/auto_stream.py`` streams over the same questions in the same order, side by side.

Before: MoI in the caller's time until a profile is trusted (the committed stream,
``results/bench/auto_stream_smollm2``: back to back). After: the cold path (answered at once,
the learning runs in the engine's idle time between requests), a stream paced at
``--interval`` seconds (``bench/auto_stream.py --interval``). Per stream: each of the first
``--first`` requests' path and latency, the requests and seconds until the first trusted
placement, and the accuracy of the first ``--first`` answers (each stream's ``answers.jsonl``:
the generator's answer to that order), paired per request.

Usage: python -m bench.cold_start --before results/bench/auto_stream_smollm2 \\
         --after results/bench/auto_cold_smollm2 \\
         --out results/bench/auto_cold_smollm2/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench import report

TRUSTED = ("profile", "flat", "explore")


def stream(folder: Path) -> tuple[list[dict[str, Any]], dict[tuple[str, tuple[int, ...]], float]]:
    rows = report.read_jsonl(folder / "requests.jsonl")
    answers = {
        (a["question"], tuple(a["order"])): float(a["accuracy"])
        for a in report.read_jsonl(folder / "answers.jsonl")
        if a.get("error") is None
    }
    return rows, answers


def until_trusted(rows: list[dict[str, Any]]) -> dict[str, Any]:
    k = next((r["k"] for r in rows if r["path"] in TRUSTED), None)
    waited = sum(r["latency_s"] for r in rows[: k if k is not None else len(rows)])
    span = None
    if k is not None and "at" in rows[k] and "at" in rows[0]:
        span = rows[k]["at"] - rows[0]["at"] + rows[0]["latency_s"]
    return {"first_trusted_request": k, "caller_seconds_before": waited, "wall_seconds": span}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.cold_start", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--first", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    before, before_acc = stream(Path(args.before))
    after, after_acc = stream(Path(args.after))
    n = min(args.first, len(before), len(after))
    pairs = []
    for b, a in zip(before[:n], after[:n], strict=True):
        assert b["question"] == a["question"], (b["k"], b["question"], a["question"])
        side = {}
        for name, row, acc in (("before", b, before_acc), ("after", a, after_acc)):
            side[name] = {
                "path": row["path"],
                "latency_s": row["latency_s"],
                "accuracy": acc.get((row["question"], tuple(row["order"]))),
            }
        pairs.append({"k": b["k"], "question": b["question"], **side})
    scored = [p for p in pairs if None not in (p["before"]["accuracy"], p["after"]["accuracy"])]
    diff = [p["after"]["accuracy"] - p["before"]["accuracy"] for p in scored]
    summary = {
        "first": n,
        "before": {
            "folder": args.before,
            "latency_s_median": statistics.median(p["before"]["latency_s"] for p in pairs),
            "latency_s_max": max(p["before"]["latency_s"] for p in pairs),
            "accuracy": statistics.mean(p["before"]["accuracy"] for p in scored),
            **until_trusted(before),
        },
        "after": {
            "folder": args.after,
            "latency_s_median": statistics.median(p["after"]["latency_s"] for p in pairs),
            "latency_s_max": max(p["after"]["latency_s"] for p in pairs),
            "accuracy": statistics.mean(p["after"]["accuracy"] for p in scored),
            **until_trusted(after),
        },
        "paired": {
            "answered_both": len(scored),
            "difference": statistics.mean(diff) if diff else None,
            "wins": sum(d > 0 for d in diff),
            "losses": sum(d < 0 for d in diff),
        },
        "requests": pairs,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "requests"}, indent=1))
    for p in pairs:
        b, a = p["before"], p["after"]
        print(f"{p['k']:3d} before {b['path']:8s} {b['latency_s']:6.1f} s {b['accuracy']}  "
              f"after {a['path']:8s} {a['latency_s']:6.2f} s {a['accuracy']}")  # fmt: skip


if __name__ == "__main__":
    main()
