"""The default path (``auto`` placing by a trusted profile, no language-model call) under
closed-loop load, against ``dense`` as it was before it was batched, in one run.

Three cases, each a real ``python -m entrypoints serve`` process (``bench/server_process.py``)
on the ``paced`` backend (no model: nothing here calls one, and the paced engine takes no CPU),
with a trusted profile for the server's model, ``qa_default`` and 5 slots written into its profile
folder before the first request (what ``auto`` finds after a restart of a replica that learned
it), and ``auto_explore_rate = 0`` so no request is drawn for a background check:

- ``auto_scores``: ``auto`` with the caller's retriever score on every passage: ranked by those
  scores, placed by the profile; no model of any kind.
- ``auto_scores_2w``: the same with two HTTP worker processes on one port and the engine in a
  process of its own (``RAG_REORDER_WORKERS=2``, ``entrypoints/workers.py``): the CPU of the
  server's whole process tree is counted.
- ``auto_dense``: ``auto`` with no scores: ranked by ``dense`` (all-MiniLM-L6-v2, batched
  across concurrent requests), placed by the profile; the encoder's cache off
  (``RAG_REORDER_DENSE_CACHE_ENTRIES=0``), so every query and passage is computed.
- ``auto_dense_2w``: the same with two HTTP worker processes, each encoding its own requests.
- ``auto_dense_cached``: the same with the cache on (its default size): the requests cycle
  through ``--queries`` questions, so after the warm-up every text is a hit; the figure for
  traffic whose chunks and queries repeat, an upper bound.
- ``dense_before``: ``strategy: dense`` on the code of ``--baseline-root`` (by default
  ``--baseline-commit``, the parent of the commit that batched the encoder, exported with
  ``git archive`` into a temporary folder): one request's passages at a time behind a
  process-wide lock, as it was.

NQ-Open dev questions (``--data``) with their first 10 passages. At each concurrency level,
that many closed-loop clients (each sends its next request when the previous answer arrives)
for ``--seconds`` (at least ``--min-requests``): requests/s, p50/p99 latency, errors, and the
server's CPU ms per request (its process tree's user + system CPU time over the level, divided
by the requests). The 1-minute load average before and after each level is recorded: the
machine is shared, and another engineer's work shows there. So are the longest stretch of the
level with no response (``stall_ms``) and the seconds the server's threads were runnable but
off a core (``server_cpu_wait_s``, Linux schedstat): a stall the scheduler made shows in the
second, one the server made itself does not.

The clients are one keep-alive HTTP/1.1 connection each, bodies encoded once
(``Connection``), their CPU per request recorded (``client_cpu_ms_per_request``, about
0.15 ms): the clients share the server's cores, and with httpx's client (about 1.5 ms a
request) they, not the server, set the no-model path's requests/s.

Targets: ``auto_scores`` at least 500 requests/s at 16 concurrent; ``auto_dense`` at least 3x
``dense_before`` at 16 concurrent.

Usage: python -m bench.default_path [--levels 1,4,16,64] [--seconds 8] [--queries 50]
           [--cases auto_scores,auto_scores_2w,auto_dense,auto_dense_cached,dense_before]
           [--baseline-commit 146c332^] [--baseline-root <checkout>]
           [--out results/bench/default_path/default_path.json]
Writes the JSON and a markdown table beside it (.md) after every case.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import report
from bench.server_process import (
    cpu_s,
    free_port,
    percentile,
    process_tree,
    run_delay_s,
    start_server,
)
from service.learning.learner import learning_slots
from service.state.profile_store import ProfileStore, ProfileTrust

CASES = (
    "auto_scores", "auto_scores_2w", "auto_dense", "auto_dense_2w", "auto_dense_cached",
    "dense_before",
)  # fmt: skip
CASE_ENV = {
    "auto_dense": {"RAG_REORDER_DENSE_CACHE_ENTRIES": "0"},
    # Two workers, each with its encoder (one torch thread each on two CPUs).
    "auto_dense_2w": {"RAG_REORDER_DENSE_CACHE_ENTRIES": "0", "RAG_REORDER_WORKERS": "2"},
    # Two HTTP worker processes on one port, one engine process (entrypoints/workers.py).
    "auto_scores_2w": {"RAG_REORDER_WORKERS": "2"},
}
PASSAGES = 10
# A recency-shaped profile for 5 slots (the learning design's slot count for 10 passages).
COEFFICIENTS = (0.1, 0.15, 0.2, 0.25, 0.3)
SERVER_ENV = {
    "RAG_REORDER_BACKEND": "paced",
    "RAG_REORDER_CANARY_INTERVAL_S": "0",
    "RAG_REORDER_RATE_CANARY": "false",
    "RAG_REORDER_ACCESS_LOG": "false",
    "RAG_REORDER_TRAFFIC_SAMPLE_RATE": "0",
    "RAG_REORDER_AUTO_EXPLORE_RATE": "0",
    "RAG_REORDER_MAX_CONCURRENT_REQUESTS": "256",
    "RAG_REORDER_REQUEST_TIMEOUT_S": "600",
    "RAG_REORDER_LOG_LEVEL": "warning",
    # Nothing here is learned from: no reassessment may replace the seeded profile.
    "RAG_REORDER_AUTO_RECALIBRATE_S": "1000000",
}
# The paced backend's model id (``PacedBackend``: ``paced/<paced_profile>/<model>``), checked
# against the server's /info before the first request.
MODEL_ID = "paced/h200-transformers-bf16/HuggingFaceTB/SmolLM2-135M-Instruct"


def bodies(data: Path, queries: int, case: str) -> list[dict[str, Any]]:
    """Request bodies for ``case``: the first ``queries`` questions, 10 passages each."""
    rows = [json.loads(line) for line in data.read_text().splitlines()[:queries]]
    out = []
    for row in rows:
        texts = [f"{p['title']}: {p['text']}" for p in row["passages"][:PASSAGES]]
        passages: list[Any] = texts
        if case.startswith("auto_scores"):
            # The retriever's scores, falling with its order, as a caller would pass them.
            passages = [{"text": t, "score": 1.0 - 0.05 * k} for k, t in enumerate(texts)]
        body: dict[str, Any] = {"query": row["question"], "passages": passages}
        if case == "dense_before":
            body["strategy"] = "dense"
        out.append(body)
    return out


def trust_profile(folder: Path, model: str) -> str:
    """Store a trusted profile for ``model`` (the server's), ``qa_default``, 5 slots."""
    slots = learning_slots(PASSAGES)
    assert slots == len(COEFFICIENTS)
    now = time.time()
    trust = ProfileTrust(
        verdict="shaped",
        reason="seeded by bench/default_path.py",
        runs=50,
        flat_p=1e-6,
        spread=1.0,
        spread_upper=1.2,
        stability=1.0,
        top_slots=(4, 3),
        placement_slots=slots,
        resamples=200,
        covariance=tuple(tuple(0.0 for _ in COEFFICIENTS) for _ in COEFFICIENTS),
        assessed_at=now,
        source="calibration",
        trusted_since=now,
    )
    prof = ProfileStore(folder).put(
        model=model, template="qa_default", coefficients=COEFFICIENTS,
        identification="answers", runs=50, prompts=1000, r2=1.0, source="calibration",
        oriented_by="data", trust=trust,
    )  # fmt: skip
    return prof.id


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs pre-encoded JSON bodies and reads the
    status and body, nothing else: the load generator shares the server's 2 cores, and
    httpx's client costs about as much CPU a request as the no-model path's server (in-process,
    the two together took 3.0 CPU ms a request), so with it the clients, not the server, set
    the no-model path's requests/s."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        try:
            self._writer.write(head + body)
            status_line = await self._reader.readline()
            if not status_line:
                raise ConnectionError("the server closed the connection")
            length, close = 0, False
            while (line := await self._reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            data = await self._reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError):
            await self.close()
            raise
        if close:
            await self.close()
        return int(status_line.split()[1]), data

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def encoded(bodies: list[dict[str, Any]], port: int) -> list[tuple[bytes, bytes]]:
    """Each body's request head and JSON bytes, encoded once before the levels."""
    out = []
    for body in bodies:
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/reorder HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
        ).encode()
        out.append((head, data))
    return out


async def level(
    port: int, bodies: list[tuple[bytes, bytes]], concurrency: int, seconds: float,
    min_requests: int, expect_path: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Closed-loop clients, one connection each, for ``seconds`` (and at least
    ``min_requests`` requests). ``stall_ms`` is the longest time in the level in which no
    response arrived: a server that queues shows short gaps, one that stops shows a long one."""
    latencies: list[float] = []
    errors: list[str] = []
    sent = 0
    deadline = time.perf_counter() + seconds
    want = None if expect_path is None else f'"path":"{expect_path}"'.encode()
    t0 = time.perf_counter()
    last = t0
    stall = 0.0

    async def one_client() -> None:
        nonlocal sent, last, stall
        conn = Connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline or sent < min_requests:
                head, body = bodies[sent % len(bodies)]
                sent += 1
                t = time.perf_counter()
                try:
                    status, data = await conn.post(head, body)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    errors.append(type(exc).__name__)
                    continue
                now = time.perf_counter()
                stall, last = max(stall, now - last), now
                if status != 200:
                    errors.append(str(status))
                    continue
                # A substring, not a JSON parse: this client's CPU is the server's too.
                if want is not None and want not in data:
                    errors.append(f"path {json.loads(data)['auto']['path']}")
                    continue
                latencies.append(now - t)
        finally:
            await conn.close()

    client_cpu0 = time.process_time()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": 1000 * percentile(latencies, 50) if latencies else math.nan,
        "p99_ms": 1000 * percentile(latencies, 99) if latencies else math.nan,
        "stall_ms": 1000 * stall,
        "client_cpu_ms_per_request": 1000
        * (time.process_time() - client_cpu0)
        / max(1, len(latencies)),
    }


async def run_case(
    case: str, args: argparse.Namespace, server_root: Path, tmp: Path
) -> dict[str, Any]:
    folder = tmp / f"profiles-{case}"
    # Written before the server starts, as a replica that restarts finds it.
    profile = trust_profile(folder, MODEL_ID) if case != "dense_before" else None
    env = {
        **SERVER_ENV,
        "RAG_REORDER_BIAS_PROFILE_DIR": str(folder),
        # The converted model kept between runs (a fresh folder converts it again, 30 s), the
        # learned runs of other work not (a learner that finds runs reassesses).
        "RAG_REORDER_CACHE_DIR": args.cache_dir,
        "RAG_REORDER_TRAFFIC_SAMPLE_DIR": str(tmp / f"traffic-{case}"),
        **CASE_ENV.get(case, {}),
    }
    port = free_port()
    log = tmp / f"server-{case}.log"
    proc = start_server(server_root, port, env, log, ready_s=args.ready_s)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            model = (await client.get("/info")).json()["model"]
        assert model == MODEL_ID, f"the server's model is {model!r}, not {MODEL_ID!r}"
        reqs = encoded(bodies(Path(args.data), args.queries, case), port)
        expect = None if case == "dense_before" else "profile"
        # Warm-up: the encoder loads, the profile is read, the first requests' one-offs;
        # every body once where the cache is on (so the cached case is all hits after).
        warm = 8 if case in ("auto_dense", "auto_dense_2w") else len(reqs)
        await level(port, reqs, 4, 0.0, warm, expect)
        levels = []
        for c in args.levels:
            tree = process_tree(proc.pid)
            cpu0, load0, delay0 = cpu_s(tree), os.getloadavg()[0], run_delay_s(tree)
            row = await level(port, reqs, c, args.seconds, max(c, args.min_requests), expect)
            used = cpu_s(tree) - cpu0
            # Runnable but off a core, summed over the server's threads: what the shared
            # machine took from the level (a stall with this near the wall time is the
            # scheduler's; one with this near 0 is the server waiting on itself).
            row["server_cpu_wait_s"] = run_delay_s(tree) - delay0
            row["server_cpu_ms_per_request"] = 1000 * used / max(1, row["requests"])
            row["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            print(
                f"{case} c={c:>2}: {row['requests']} ok {row['errors']} err, "
                f"{row['requests_per_s']:.1f} req/s, p50 {row['p50_ms']:.1f} ms, "
                f"p99 {row['p99_ms']:.1f} ms, {row['server_cpu_ms_per_request']:.2f} CPU "
                f"ms/req (client {row['client_cpu_ms_per_request']:.2f}), longest stall "
                f"{row['stall_ms']:.0f} ms, waited for a CPU {row['server_cpu_wait_s']:.1f} s, "
                f"load {row['load_1min']}",
                flush=True,
            )
            levels.append(row)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            embed = (await client.get("/info")).json().get("dense")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "case": case,
        "server_root": str(server_root),
        "profile": profile,
        "levels": levels,
        "dense_info": embed,
    }


def verdicts(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def at16(case: str) -> float | None:
        rows = [r for r in cases.get(case, {}).get("levels", []) if r["concurrency"] == 16]
        return rows[0]["requests_per_s"] if rows else None

    out: dict[str, Any] = {}
    a, b, c = at16("auto_scores"), at16("auto_dense"), at16("dense_before")
    a2 = at16("auto_scores_2w")
    if a is not None:
        out["auto_scores_rps_at_16"] = a
    if a2 is not None:
        out["auto_scores_2w_rps_at_16"] = a2
    if a is not None or a2 is not None:
        # With one process or several: the target allows the front end's worker processes.
        out["auto_scores_target_met"] = max(a or 0.0, a2 or 0.0) >= 500
    b2 = at16("auto_dense_2w")
    if b2 is not None and c:
        out["auto_dense_2w_over_dense_before_at_16"] = b2 / c
    if (b is not None or b2 is not None) and c:
        if b is not None:
            out["auto_dense_over_dense_before_at_16"] = b / c
        out["auto_dense_target_met"] = max(b or 0.0, b2 or 0.0) / c >= 3
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# The default path under load (bench/default_path.py)",
        "",
        f"`{result['command']}` on {result['machine']['platform']}, "
        f"{result['machine']['cpu_count']} CPUs (shared; 1-minute load average before and after "
        f"each level in the last column). Baseline code: {result['baseline']}.",
        "",
        "| case | concurrency | requests | errors | req/s | p50 ms | p99 ms | server CPU "
        "ms/request | client CPU ms/request | longest stall ms | server waited for a CPU s "
        "| load 1 min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def opt(row: dict[str, Any], key: str, fmt: str) -> str:
        # Runs before the light client and the stall figures have no such field.
        return format(row[key], fmt) if key in row else "-"

    for case in result["cases"].values():
        for row in case["levels"]:
            lines.append(
                f"| {case['case']} | {row['concurrency']} | {row['requests']} | "
                f"{row['errors']} | {row['requests_per_s']:.1f} | {row['p50_ms']:.1f} | "
                f"{row['p99_ms']:.1f} | {row['server_cpu_ms_per_request']:.2f} | "
                f"{opt(row, 'client_cpu_ms_per_request', '.2f')} | "
                f"{opt(row, 'stall_ms', '.0f')} | {opt(row, 'server_cpu_wait_s', '.1f')} | "
                f"{row['load_1min'][0]:.2f} / {row['load_1min'][1]:.2f} |"
            )
    lines += ["", "Verdicts: `" + json.dumps(result["verdicts"]) + "`", ""]
    return "\n".join(lines)


def baseline_root(args: argparse.Namespace, tmp: Path) -> tuple[Path, str]:
    if args.baseline_root:
        return Path(args.baseline_root), f"`{args.baseline_root}`"
    dest = tmp / "baseline"
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", args.baseline_commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest, f"commit `{args.baseline_commit}` (git archive)"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    result: dict[str, Any] = {**report.provenance(), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="default-path-") as name:
        tmp = Path(name)
        # Only dense_before runs the old code (git archive: a copy without .git, as on a
        # lent GPU, runs the other cases).
        base, said = baseline_root(args, tmp) if "dense_before" in args.cases else (ROOT, "none")
        result["baseline"] = said
        for case in args.cases:
            root = base if case == "dense_before" else ROOT
            result["cases"][case] = await run_case(case, args, root, tmp)
            result["verdicts"] = verdicts(result["cases"])
            report.write(result, out)
            out.with_suffix(".md").write_text(markdown(result))
    return result


def main() -> int:
    ap = report.parser("default_path", __doc__, data=True)
    ap.set_defaults(out=str(report.RESULTS / "default_path" / "default_path.json"))
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16, 64])  # fmt: skip
    ap.add_argument("--seconds", type=float, default=8.0, help="each level's duration")
    ap.add_argument("--min-requests", type=int, default=20)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    ap.add_argument("--baseline-commit", default="146c332^",
                    help="the code dense_before runs (before the batched encoder)")  # fmt: skip
    ap.add_argument("--baseline-root", default=None, help="a checkout instead of the commit")
    ap.add_argument("--ready-s", type=float, default=600.0)
    ap.add_argument("--cache-dir", default="/tmp/rag-reorder-bench-cache",
                    help="the servers' cache_dir (the converted model is kept there)")  # fmt: skip
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
