"""The default strategy (``auto``) on a real server from a cold start: paths, latency, answers.

A real ``python -m entrypoints serve`` with the shipped defaults (the strategy is ``auto``) and an
empty profile folder gets the NQ-Open dev questions, 10 passages each (cut as ``rag-reorder
eval`` cuts them, the gold passage kept, no labels sent), one at a time in a fixed random
order; the stream is replayed until at least ``--requests`` requests are answered and a
profile is trusted. Per request: its path (``auto.path``), client-side latency and order.

Then, on the same server, the same questions with ``dense`` placed ``bias_matched`` by the
committed calibrated profile (``--profile``): the latency of the cheap path an expert would
configure by hand.

Then every order is answered by the generator (the scoring model, in process, as ``rag-reorder
eval`` answers) and scored (NQ-Open accuracy), paired per request against MoI's default,
``dense`` placed by the committed profile, the retriever's order and a shuffle: their orders
are those of the committed evaluation records (``--records``), answered again here.

Everything is appended as it is measured under ``--out-dir`` (``requests.jsonl``,
``dense.jsonl``, ``answers.jsonl``; the server's profile folder in ``state/``), so an
interrupted run continues where it stopped: the server restarts on its own stored profile and
learning runs, as a restarted replica does. ``summary.json`` and ``summary.md`` at the end.

Usage: python -m bench.auto_stream --model HuggingFaceTB/SmolLM2-135M-Instruct \\
         --records results/eval/nq_open_dev --profile results/eval/profiles/nq_open_dev/<id>.json \\
         --out-dir results/bench/auto_stream_smollm2
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import report
from bench.server_process import free_port, start_server

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {
    "moi": "moi:pruned_random:bias_matched",
    "dense_profile": "dense:bias_matched",
    "retriever": "retriever",
    "shuffle": "shuffle",
}
"""Each baseline's label among the committed evaluation records."""


def questions(data: Path, passages: int) -> list[Any]:
    from offline.evaluation.runner import prepare
    from service.batch.dataset import load_examples

    return [prepare(ex, passages) for ex in load_examples(data)]


def body(q: Any, **extra: Any) -> dict[str, Any]:
    return {
        "query": q.question,
        "passages": [{"title": p.title, "text": p.text} for p in q.passages],
        **extra,
    }


def server(args: argparse.Namespace, out: Path) -> tuple[Any, str]:
    port = free_port()
    env = {
        "RAG_REORDER_MODEL": args.model,
        "RAG_REORDER_BIAS_PROFILE_DIR": str(out / "state" / "profiles"),
        "RAG_REORDER_REQUEST_TIMEOUT_S": "600",
        "RAG_REORDER_LOG_LEVEL": "info",
    }
    proc = start_server(ROOT, port, env, out / "server.log", ready_s=900)
    return proc, f"http://127.0.0.1:{port}"


async def stream(args: argparse.Namespace, out: Path, qs: list[Any], url: str) -> None:
    """Phase 1: the default strategy from a cold start (resumes from ``requests.jsonl``)."""
    path = out / "requests.jsonl"
    done = report.read_jsonl(path)
    order = np.random.default_rng(args.seed).permutation(len(qs))
    trusted = any(r["path"] in ("profile", "flat") for r in done)
    k = len(done)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        while k < args.requests or not trusted:
            if k >= args.max_requests:
                print(f"stopped at {k} requests without a trusted profile", flush=True)
                return
            q = qs[int(order[k % len(qs)])]
            t0 = time.perf_counter()
            r = await client.post("/v1/reorder", json=body(q))
            latency = time.perf_counter() - t0
            r.raise_for_status()
            j = r.json()
            auto = j["auto"]
            trusted = trusted or auto["path"] in ("profile", "flat")
            report.append(
                path,
                {
                    "k": k,
                    "pass": k // len(qs),
                    "question": q.id,
                    "path": auto["path"],
                    "reason": auto["reason"],
                    "profile": auto["profile"],
                    "trust": auto["trust"],
                    "learning_runs": auto["learning_runs"],
                    "recorded": auto["recorded"],
                    "at": time.time(),
                    "latency_s": latency,
                    "server_s": j["timing"]["total_s"],
                    "prompt_tokens": j["usage"]["prompt_tokens"],
                    "order": j["order"],
                },
            )
            print(f"{k} {auto['path']} {latency:.2f} s  {auto['reason'][:80]}", flush=True)
            k += 1
            # A paced stream (--interval): requests arrive as traffic does, not back to back,
            # so a cold server's background learning gets the idle time between them.
            await asyncio.sleep(max(0.0, args.interval - latency))


async def dense(args: argparse.Namespace, out: Path, qs: list[Any], url: str) -> None:
    """Phase 2: ``dense`` placed by the committed profile, on the same server."""
    path = out / "dense.jsonl"
    done = {r["question"] for r in report.read_jsonl(path)}
    profile = json.loads(Path(args.profile).read_text())
    pid = Path(args.profile).stem
    shutil.copy(args.profile, out / "state" / "profiles" / f"{pid}.json")
    assert profile["slots"] == args.passages
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        # The server reads the profile folder in the background (every state_refresh_s): wait
        # until the copied profile is served.
        for _ in range(100):
            if (await client.get(f"/v1/bias-profiles/{pid}")).status_code == 200:
                break
            await asyncio.sleep(0.2)
        for q in qs:
            if q.id in done:
                continue
            extra = {"strategy": "dense", "placement": "bias_matched", "bias_profile": pid}
            t0 = time.perf_counter()
            r = await client.post("/v1/reorder", json=body(q, **extra))
            latency = time.perf_counter() - t0
            r.raise_for_status()
            j = r.json()
            report.append(
                path,
                {
                    "question": q.id,
                    "latency_s": latency,
                    "server_s": j["timing"]["total_s"],
                    "order": j["order"],
                },
            )


def baseline_records(records: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(question id, baseline) -> the committed record (its order and accuracy)."""
    labels = {v: k for k, v in BASELINES.items()}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    with gzip.open(records / "cache.jsonl.gz", "rt") as fh:
        for line in fh:
            rec = json.loads(line)
            name = labels.get(rec["key"].get("variant", ""))
            if name is not None and rec.get("status") == "ok" and rec.get("order"):
                out[(rec["key"]["question_id"], name)] = rec
    return out


def baseline_orders(records: Path) -> dict[tuple[str, str], list[int]]:
    """(question id, baseline) -> the committed record's order."""
    return {k: list(r["order"]) for k, r in baseline_records(records).items()}


async def answers(args: argparse.Namespace, out: Path, qs: list[Any]) -> None:
    """Phase 3: the generator answers every distinct order (resumes from ``answers.jsonl``)."""
    from offline.evaluation.runner import EvalConfig, Evaluator
    from service.batch.commandline import open_pipeline
    from service.config.settings import Settings

    path = out / "answers.jsonl"
    have = {(r["question"], tuple(r["order"])) for r in report.read_jsonl(path)}
    by_id = {q.id: q for q in qs}
    base = baseline_orders(Path(args.records))
    wanted: dict[str, set[tuple[int, ...]]] = {}
    for r in report.read_jsonl(out / "requests.jsonl"):
        wanted.setdefault(r["question"], set()).add(tuple(r["order"]))
    # The baselines' orders are answered again here for the first --recompute questions (the
    # committed answers came from another machine); the rest take the committed records'.
    for qid in sorted(wanted)[: args.recompute]:
        for name in BASELINES:
            if (qid, name) in base:
                wanted[qid].add(tuple(base[(qid, name)]))
    async with open_pipeline(Settings(model=args.model)) as pipe:
        ev = Evaluator(pipe, EvalConfig(out_dir=out / "unused", progress=False))
        for n, (qid, orders) in enumerate(sorted(wanted.items())):
            todo = sorted(o for o in orders if (qid, o) not in have)
            if not todo:
                continue
            got = await ev.answer_orders(by_id[qid], todo)
            for o, g in zip(todo, got, strict=True):
                report.append(
                    path,
                    {
                        "question": qid,
                        "order": list(o),
                        "answer": g.answer,
                        "accuracy": g.scores.accuracy if g.scores is not None else None,
                        "error": g.error,
                    },
                )
            print(f"answered {n + 1}/{len(wanted)}", flush=True)


def summarise(args: argparse.Namespace, out: Path, qs: list[Any]) -> dict[str, Any]:
    """Phase 4: paths, latency against the target, accuracy paired per request."""
    from offline.evaluation.stats import paired_comparison

    reqs = report.read_jsonl(out / "requests.jsonl")
    dense_rows = report.read_jsonl(out / "dense.jsonl")
    answered = report.read_jsonl(out / "answers.jsonl")
    acc = {(r["question"], tuple(r["order"])): r["accuracy"] for r in answered}
    committed = baseline_records(Path(args.records))
    base = {k: list(r["order"]) for k, r in committed.items()}
    # Where an order was not answered here, the committed record's accuracy stands in; how
    # often the two agree where both exist says what that costs.
    agree = [
        acc[(q, tuple(r["order"]))] == r["accuracy"]
        for (q, _), r in committed.items()
        if (q, tuple(r["order"])) in acc and r.get("accuracy") is not None
    ]
    here = {k for k, r in committed.items() if (k[0], tuple(r["order"])) in acc}
    for (q, _), r in committed.items():
        acc.setdefault((q, tuple(r["order"])), r.get("accuracy"))
    first = next((r["k"] for r in reqs if r["path"] in ("profile", "flat")), None)
    after = [r for r in reqs if first is not None and r["k"] >= first]
    # The caller waits for MoI on the moi path only (explore runs in the background).
    moi_lat = [r["latency_s"] for r in reqs if r["path"] == "moi"]
    dense_lat = [r["latency_s"] for r in dense_rows]
    paths: dict[str, int] = {}
    for r in reqs:
        paths[r["path"]] = paths.get(r["path"], 0) + 1
    explore_rate = 0.05  # the shipped RAG_REORDER_AUTO_EXPLORE_RATE
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    target = 1.5 * mean(dense_lat) + explore_rate * mean(moi_lat)
    # The share the stream actually explored (a binomial draw around the setting).
    explored = sum(r["path"] == "explore" for r in after) / len(after) if after else 0.0
    target_realized = 1.5 * mean(dense_lat) + explored * mean(moi_lat)
    arms: dict[str, list[float | None]] = {"auto": []}
    arms.update({name: [] for name in BASELINES})
    for r in reqs:
        arms["auto"].append(acc.get((r["question"], tuple(r["order"]))))
        for name in BASELINES:
            o = base.get((r["question"], name))
            arms[name].append(acc.get((r["question"], tuple(o))) if o is not None else None)
    accuracy = {
        name: mean([float(v) for v in vals if v is not None]) for name, vals in arms.items()
    }
    pairs: dict[str, dict[str, Any]] = {}
    for name in BASELINES:
        keep = [
            (a, b)
            for a, b in zip(arms["auto"], arms[name], strict=True)
            if a is not None and b is not None
        ]
        c = paired_comparison("accuracy", "auto", name, keep)
        pairs[name] = {
            "n": c.n, "diff": c.mean_diff, "ci": [c.ci_low, c.ci_high], "p": c.p_value,
            "wins": c.wins, "losses": c.losses,
        }  # fmt: skip
    same_as_dense = [
        tuple(r["order"]) == tuple(base.get((r["question"], "dense_profile"), ()))
        for r in after
        if r["path"] == "profile"
    ]
    trust = next((r["trust"] for r in reqs if r["path"] in ("profile", "flat")), None)
    result = {
        **report.provenance(),
        "model": args.model,
        "passages": args.passages,
        "requests": len(reqs),
        "paths": paths,
        "requests_before_trust": first,
        "trust_at_first_use": trust,
        "latency_s": {
            "auto_after_trust_mean": mean([r["latency_s"] for r in after]),
            "auto_profile_path_mean": mean(
                [r["latency_s"] for r in after if r["path"] == "profile"]
            ),
            "dense_alone_mean": mean(dense_lat),
            "moi_mean": mean(moi_lat),
            "target": target,
            "target_rule": "1.5 x dense alone + 0.05 (explore share) x MoI",
            "met": mean([r["latency_s"] for r in after]) <= target,
            "explored_share_after_trust": explored,
            "target_at_explored_share": target_realized,
            "met_at_explored_share": mean([r["latency_s"] for r in after]) <= target_realized,
        },
        "accuracy": accuracy,
        "auto_vs": pairs,
        "baseline_answers": {
            "answered_here": len(here),
            "committed": len(committed) - len(here),
            "agreement_where_both": mean([float(a) for a in agree]) if agree else None,
            "compared": len(agree),
        },
        "profile_path_orders_equal_to_dense_profile": (
            mean([float(x) for x in same_as_dense]) if same_as_dense else None
        ),
        "targets": {
            "vs_dense_profile_ci_low_above_-0.03": pairs["dense_profile"]["ci"][0] > -0.03,
            "above_shuffle": pairs["shuffle"]["diff"] > 0,
        },
    }
    (out / "summary.md").write_text(markdown(result))
    return result


def markdown(r: dict[str, Any]) -> str:
    lat = r["latency_s"]
    lines = [
        f"# auto on a cold server: {r['model']}, {r['passages']} passages, "
        f"{r['requests']} requests",
        "",
        f"Command: `{r['command']}`",
        "",
        f"- paths: {r['paths']}; the first trusted profile was used at request "
        f"{r['requests_before_trust']} (0-based: that many MoI requests before it)",
        f"- latency after trust: mean {lat['auto_after_trust_mean']:.3f} s (profile path "
        f"{lat['auto_profile_path_mean']:.3f} s); dense alone {lat['dense_alone_mean']:.3f} s; "
        f"MoI {lat['moi_mean']:.2f} s; target {lat['target']:.3f} s ({lat['target_rule']}): "
        f"{'met' if lat['met'] else 'NOT met'}; at the share explored "
        f"({lat['explored_share_after_trust']:.3f}) {lat['target_at_explored_share']:.3f} s: "
        f"{'met' if lat['met_at_explored_share'] else 'NOT met'}",
        f"- baseline answers: {r['baseline_answers']}",
        "",
        "| arm | accuracy | auto - arm [95% CI] | p | wins / losses |",
        "|---|---:|---|---:|---:|",
        f"| auto | {r['accuracy']['auto']:.3f} | | | |",
    ]
    for name, c in r["auto_vs"].items():
        lines.append(
            f"| {name} | {r['accuracy'][name]:.3f} | {c['diff']:+.3f} [{c['ci'][0]:+.3f}, "
            f"{c['ci'][1]:+.3f}] | {c['p']:.2g} | {c['wins']} / {c['losses']} |"
        )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out_dir)
    (out / "state" / "profiles").mkdir(parents=True, exist_ok=True)
    qs = questions(Path(args.data), args.passages)
    if args.phase in ("all", "stream"):
        proc, url = server(args, out)
        try:
            await stream(args, out, qs, url)
            await dense(args, out, qs, url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.phase in ("all", "answers"):
        await answers(args, out, qs)
    return summarise(args, out, qs)


def main() -> None:
    ap = report.parser("auto_stream", __doc__, data=True)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--records", default="results/eval/nq_open_dev", help="committed eval folder")
    ap.add_argument("--profile", required=True, help="committed calibrated profile (JSON)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds from one request's start to the next's (0: back to back)",
    )
    ap.add_argument("--phase", choices=["all", "stream", "answers", "summary"], default="all")
    ap.add_argument(
        "--recompute",
        type=int,
        default=200,
        help="questions whose baseline orders are answered again here (the rest: committed)",
    )
    ap.set_defaults(out=None)
    args = ap.parse_args()
    if args.out is None or args.out == str(report.RESULTS / "auto_stream.json"):
        args.out = str(Path(args.out_dir) / "summary.json")
    result = asyncio.run(run(args))
    report.write(result, args.out)


if __name__ == "__main__":
    main()
