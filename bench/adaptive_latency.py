"""MoI's adaptive design against its default design through a real server: latency at 1 and 8
concurrent requests, prompts and prompt tokens per request, side by side in one run.

One ``python -m entrypoints serve`` on the embedded default (the packaged SmolLM2, CPU) with the MoI
bias profiles the evaluation uses (``results/eval/profiles/nq_open_dev``, copied to a scratch
folder), so the adaptive design fixes its bias as a server that has a profile does. Requests:
the first ``--queries`` NQ-Open dev questions with their first 10 passages, ``strategy: moi``,
``design.kind`` ``pruned_random`` (the default) or ``adaptive``.

- Concurrency 1: each question once per design, one request at a time, the two designs
  alternating (ABBA by question, so drift in the machine's load hits both alike).
- Concurrency 8: 8 questions sent at once per design (default first, then adaptive, then
  default again when ``--repeat`` is 2), the cross-request scheduler batching their prompts.

The request deadline is raised (``RAG_REORDER_REQUEST_TIMEOUT_S`` 1800) so the default design
at concurrency 8 on two cores is measured rather than refused. Rows go to ``<out>.jsonl`` as
they finish (a rerun resumes); the summary to ``<out>.json`` and ``<out>.md``::

    python -m bench.adaptive_latency --out results/bench/adaptive/latency.json
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import append, main, parser, provenance, read_jsonl
from bench.server_process import free_port, percentile, start_server

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "results" / "eval" / "profiles" / "nq_open_dev"
DESIGNS = ("pruned_random", "adaptive")


def _questions(path: Path, k: int) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines()[:k]:
        q = json.loads(line)
        out.append(
            {
                "query": q["question"],
                "passages": [
                    {"title": p.get("title"), "text": p["text"]} for p in q["passages"][:10]
                ],
            }
        )
    return out


async def _one(
    client: httpx.AsyncClient, q: dict[str, Any], design: str, level: int, tag: str
) -> dict[str, Any]:
    body = {**q, "strategy": "moi", "design": {"kind": design}}
    t0 = time.perf_counter()
    r = await client.post("/v1/reorder", json=body)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "design": design,
        "concurrency": level,
        "tag": tag,
        "status": r.status_code,
    }
    row["latency_s"] = wall
    if r.status_code == 200:
        b = r.json()
        row["prompt_tokens"] = b["usage"]["prompt_tokens"]
        row["prompts"] = b["usage"]["prompts_scored"]
        row["adaptive"] = b["diagnostics"]["adaptive"]
    else:
        row["error"] = r.text[:300]
    return row


async def run(args: Any) -> dict[str, Any]:
    out = Path(args.out)
    rows_path = out.with_suffix(".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_jsonl(rows_path)
    have = {r["tag"] for r in done}
    qs = _questions(Path(args.data), max(args.queries, 8))
    scratch = Path(tempfile.mkdtemp(prefix="adaptive-latency-"))
    shutil.copytree(PROFILES, scratch / "profiles")
    env = {
        "HF_HUB_OFFLINE": "1",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_BIAS_PROFILE_DIR": str(scratch / "profiles"),
        "RAG_REORDER_REQUEST_TIMEOUT_S": "1800",
    }
    port = free_port()
    proc = start_server(ROOT, port, env, scratch / "server.log", ready_s=600)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(3600)
        ) as client:
            # One untimed request per design first: the first forward of a shape is slower.
            for d in DESIGNS:
                await _one(client, qs[0], d, 1, f"warm-{d}")
            for i, q in enumerate(qs[: args.queries]):
                order = DESIGNS if i % 2 == 0 else DESIGNS[::-1]
                for d in order:
                    tag = f"c1-{i}-{d}"
                    if tag not in have:
                        append(rows_path, await _one(client, q, d, 1, tag))
            for rep in range(args.repeat):
                order = DESIGNS if rep % 2 == 0 else DESIGNS[::-1]
                for d in order:
                    tag = f"c8-{rep}-{d}"
                    if any(r["tag"].startswith(tag) for r in done):
                        continue
                    t0 = time.perf_counter()
                    batch = await asyncio.gather(
                        *(_one(client, q, d, 8, f"{tag}-{k}") for k, q in enumerate(qs[:8]))
                    )
                    wall = time.perf_counter() - t0
                    for row in batch:
                        row["batch_wall_s"] = wall
                        append(rows_path, row)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
    rows = read_jsonl(rows_path)
    summary = []
    for level in (1, 8):
        for d in DESIGNS:
            rs = [r for r in rows if r["concurrency"] == level and r["design"] == d]
            ok = [r for r in rs if r["status"] == 200]
            if not ok:
                continue
            lat = [r["latency_s"] for r in ok]
            walls = sorted({r["batch_wall_s"] for r in ok if "batch_wall_s" in r})
            summary.append(
                {
                    "design": d,
                    "concurrency": level,
                    "requests": len(rs),
                    "errors": len(rs) - len(ok),
                    "p50_s": percentile(lat, 50),
                    "p95_s": percentile(lat, 95),
                    "mean_s": sum(lat) / len(lat),
                    "requests_per_s": (len(ok) / sum(walls)) if walls else len(ok) / sum(lat),
                    "prompts": sum(r["prompts"] for r in ok) / len(ok),
                    "prompt_tokens": sum(r["prompt_tokens"] for r in ok) / len(ok),
                }
            )
    by = {(s["design"], s["concurrency"]): s for s in summary}
    ratios = {
        str(level): {
            k: by[("adaptive", level)][k] / by[("pruned_random", level)][k]
            for k in ("p50_s", "mean_s", "prompt_tokens", "requests_per_s")
        }
        for level in (1, 8)
        if ("adaptive", level) in by and ("pruned_random", level) in by
    }
    result = {**provenance(), "summary": summary, "adaptive_over_default": ratios}
    lines = [
        "| design | concurrency | requests | p50 s | p95 s | requests/s | prompts "
        "| prompt tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['design']} | {s['concurrency']} | {s['requests']} | {s['p50_s']:.1f} "
            f"| {s['p95_s']:.1f} | {s['requests_per_s']:.3f} | {s['prompts']:.1f} "
            f"| {s['prompt_tokens']:.0f} |"
        )
    for level, r in ratios.items():
        lines.append(
            f"\nAdaptive / default at concurrency {level}: p50 {r['p50_s']:.2f}x, prompt tokens "
            f"{r['prompt_tokens']:.2f}x, requests/s {r['requests_per_s']:.2f}x."
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    ap = parser("adaptive_latency", __doc__, data=True)
    ap.add_argument("--queries", type=int, default=4, help="questions at concurrency 1")
    ap.add_argument("--repeat", type=int, default=1, help="batches of 8 per design")
    raise SystemExit(main(ap, run))
