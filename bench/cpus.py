"""Threads sized to the CPUs the process has (issue 70): the same load on the real embedded
server confined to fewer CPUs than the host has, before and after, side by side.

Before issue 70 the server sized torch's intra-op threads (torch's default: the host's cores)
and the solver pool (``os.cpu_count() - 1``) from the host, whatever its affinity mask or
cgroup quota allowed; after, from ``service.runtime.cpus``. Both run here from the same virtualenv:
"before" is a git worktree of ``--before`` (default: the commit before issue 70), "after"
this checkout. Each server is started confined, in turn (ABAB...), and gets the same
``--requests`` MoI requests of 10 passages (``--concurrency`` at a time); the table reports
each one's median latency and the ratio after/before, measured in one run.

Confinements (``--confine``):
- ``taskset``: ``taskset -c 0``, one CPU in the affinity mask;
- ``quota``: a cgroup v1 child of the ``cpu`` controller with ``cpu.cfs_quota_us`` one
  period (1 CPU of quota, both CPUs in the mask: a Kubernetes CPU limit). Needs root and a
  writable ``/sys/fs/cgroup/cpu``.

Usage: python -m bench.cpus --confine taskset --out results/bench/cpus/taskset.json
Rows are appended to ``<out>.jsonl`` as measured; a rerun skips those done.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench import report
from bench.server_process import child_env, free_port, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "6564b51"
"""The last commit before issue 70."""
CGROUP = Path("/sys/fs/cgroup/cpu/rag-reorder-bench")
SAMPLE = ROOT / "tests" / "data" / "litm_sample.jsonl"
N = 6
"""Passages a request: 10 prompts of 3 (pruned random's fewest for 6), ~10 s on one CPU."""


def passages() -> tuple[str, list[str]]:
    rows = [json.loads(line) for line in SAMPLE.open()][:2]
    return rows[0]["question"], [c["text"] for r in rows for c in r["ctxs"]][:N]


def prefix(confine: str) -> list[str]:
    if confine == "taskset":
        return ["taskset", "-c", "0"]
    CGROUP.mkdir(exist_ok=True)
    period = int((CGROUP / "cpu.cfs_period_us").read_text())
    (CGROUP / "cpu.cfs_quota_us").write_text(str(period))
    # The shell joins the cgroup, then becomes the server: every thread it starts is in it.
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"]


def worktree(commit: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"rag-reorder-{commit}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
    return path


def serve(root: Path, confine: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = child_env(root, {"RAG_REORDER_BIAS_PROFILE_DIR": str(log.parent / "profiles")})
    cmd = [*prefix(confine), sys.executable, "-m", "entrypoints", "serve", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wait_until_up(proc, f"http://127.0.0.1:{port}/ready", log, ready_s=600)
    return proc, f"http://127.0.0.1:{port}"


def load(url: str, requests: int, concurrency: int) -> list[dict[str, Any]]:
    query, texts = passages()

    def one(k: int) -> dict[str, Any]:
        body = {
            "query": query,
            "passages": texts[k % N :] + texts[: k % N],
            "strategy": "moi",
            "design": {"kind": "pruned_random", "num_prompts": 10, "seed": k},
        }
        t = time.perf_counter()
        r = httpx.post(f"{url}/v1/reorder", json=body, timeout=600)
        row = {"status": r.status_code, "latency_s": time.perf_counter() - t}
        if r.status_code == 200:
            row["scoring_s"] = r.json()["timing"]["scoring_s"]
        else:
            row["error"] = r.text[:300]
        return row

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(requests)))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpus", description=__doc__.splitlines()[0])
    ap.add_argument("--confine", choices=["taskset", "quota"], default="taskset")
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_path = out.with_suffix(".jsonl")
    rows = report.read_jsonl(rows_path)
    done = {(r["round"], r["version"]) for r in rows}
    roots = {"before": worktree(args.before), "after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for version in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                if (rnd, version) in done:
                    continue
                log = Path(tmp) / f"{version}-{rnd}.log"
                proc, url = serve(roots[version], args.confine, log)
                try:
                    info = httpx.get(f"{url}/info", timeout=10).json()
                    load(url, 1, 1)  # the first request's one-time costs, not measured
                    measured = load(url, args.requests, args.concurrency)
                finally:
                    proc.terminate()
                    proc.wait(60)
                row = {"round": rnd, "version": version, "confine": args.confine,
                       "cpus": info.get("cpus"), "requests": measured}  # fmt: skip
                failed = [q for q in measured if q["status"] != 200]
                if failed:
                    raise SystemExit(f"{version}: {len(failed)} request(s) failed: {failed[0]}")
                report.append(rows_path, row)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"confine": args.confine, "before": args.before, "versions": {}}
    for version in ("before", "after"):
        ok = [q for r in rows if r["version"] == version for q in r["requests"]]
        lat = [q["latency_s"] for q in ok if q["status"] == 200]
        summary["versions"][version] = {
            "requests": len(lat),
            "errors": sum(q["status"] != 200 for q in ok),
            "median_latency_s": statistics.median(lat),
            "cpus": next(r["cpus"] for r in rows if r["version"] == version),
        }
    v = summary["versions"]
    summary["after_over_before"] = v["after"]["median_latency_s"] / v["before"]["median_latency_s"]
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
