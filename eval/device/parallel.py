"""Runs eval/run.sh's work as several `rag-reorder eval` processes sharing one GPU.

One process keeps a lent GPU busy only part of the time with a 135M model (it tokenises,
solves and decides between small forward batches), so the questions of each set are split
into chunks and a pool of processes runs them at once, each chunk in its own output folder
seeded with the set's committed cache (finished records are never recomputed). Before them,
the MoI bias profiles are calibrated exactly as eval/run.sh does (both sets at once). At the
deadline every unfinished process is stopped; the chunks' caches are then merged into
OUT/<set>/cache.jsonl, so what finished is kept and a later call (on the same machine, or on a
fresh one from the merged results) continues. Reports are rebuilt afterwards from the merged
cache with the full data file (eval/device/README.md).

The first chunk of each set keeps the positional rotations: it holds the set's first
questions, so it rotates the same ones the full run would.

Usage (on the device, after stage1/stage2; see eval/device/README.md):
    python3 eval/device/parallel.py --data /tmp/data --out /tmp/evalout --budget 520
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

K = 10  # passages per question, as eval/run.sh
CALIBRATION_QUESTIONS = 50
# test set -> the set its MoI bias profiles are calibrated on (eval/run.sh's run_set calls)
SETS = {"hotpot_dev": "nq_open_dev", "nq_open_dev": "hotpot_dev"}
POSITIONAL = "profiles/positional-nq_open_dev"
POSITIONAL_VARIANT = "positional"  # the cache key's variant of a positional rotation record


@dataclass
class Job:
    name: str
    test: str
    data: Path
    positional: bool

    def folder(self, work: Path) -> Path:
        return work / self.name


def calibrate(rr: list[str], data: Path, out: Path) -> list[subprocess.Popen[bytes]]:
    """Start the missing MoI bias-profile calibrations (eval/run.sh's first step per set)."""
    procs = []
    for test, calib in SETS.items():
        prof = out / "profiles" / test
        (prof / "positional").mkdir(parents=True, exist_ok=True)
        for f in (out / POSITIONAL / "positional").glob("*.json"):
            shutil.copy(f, prof / "positional" / f.name)
        target = prof / "calibrate-random.json"
        if target.is_file() and target.stat().st_size:
            continue
        cmd = [
            *rr,
            "calibrate",
            "--data",
            str(data / f"{calib}.jsonl"),
            "--limit",
            str(CALIBRATION_QUESTIONS),
            "--max-passages",
            str(K),
            "--design",
            "random",
        ]
        print("+", shlex.join(cmd), f"(profiles: {prof})", flush=True)
        env = {**os.environ, "RAG_REORDER_BIAS_PROFILE_DIR": str(prof)}
        script = f'{shlex.join(cmd)} > "{target}.tmp" && mv "{target}.tmp" "{target}"'
        procs.append(subprocess.Popen(["bash", "-c", script], env=env))
    return procs


def make_jobs(data: Path, work: Path, chunk: int) -> list[Job]:
    """Chunks of each set's questions as JSONL files under ``work``, largest set first."""
    jobs: list[Job] = []
    sets = {
        t: [ln for ln in (data / f"{t}.jsonl").read_text().splitlines() if ln.strip()] for t in SETS
    }
    for test, lines in sorted(sets.items(), key=lambda item: -len(item[1])):
        for i in range(0, len(lines), chunk):
            path = work / "data" / f"{test}-{i // chunk:02d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines[i : i + chunk]) + "\n")
            jobs.append(Job(f"{test}-{i // chunk:02d}", test, path, positional=i == 0))
    return jobs


def start(
    job: Job, rr: list[str], out: Path, work: Path, remaining: float, extra: list[str]
) -> subprocess.Popen[bytes]:
    folder = job.folder(work)
    if not folder.is_dir():  # first time: the set's finished records
        folder.mkdir(parents=True)
        cache = out / job.test / "cache.jsonl"
        if cache.is_file():
            shutil.copy(cache, folder / "cache.jsonl")
    cmd = [
        *rr,
        "eval",
        "--data",
        str(job.data),
        "--max-passages",
        str(K),
        "--out",
        str(folder),
        "--no-progress",
        *([] if job.positional else ["--no-positional"]),
        *extra,
    ]
    env = {**os.environ, "RAG_REORDER_BIAS_PROFILE_DIR": str(out / "profiles" / job.test)}
    log = (work / f"{job.name}.log").open("ab")
    return subprocess.Popen(
        ["timeout", str(int(remaining)), *cmd], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def cached_variants(out: Path, test: str) -> dict[str, set[str]]:
    """Question id -> the variants the set's committed cache holds for it."""
    cache = out / test / "cache.jsonl"
    have: dict[str, set[str]] = {}
    if cache.is_file():
        for line in cache.read_text(encoding="utf-8").splitlines():
            try:
                key = json.loads(line)["key"]
            except (ValueError, KeyError):
                continue
            have.setdefault(key["question_id"], set()).add(key["variant"])
    return have


def finished(job: Job, have: dict[str, set[str]]) -> bool:
    """Whether the set's committed cache (``cached_variants``) already holds every record
    ``job`` would compute.

    A chunk's process would only reload them and rebuild a throw-away report (minutes on a
    CPU: scipy's exact Wilcoxon test for 13 pairs), so such chunks are not started. The
    expected variants are the ones the cache holds for any question; the positional chunk
    also needs one positional record per question the cache ran rotations for.
    """
    variants = set().union(*have.values()) - {POSITIONAL_VARIANT}
    ids = [json.loads(ln)["id"] for ln in job.data.read_text().splitlines() if ln.strip()]
    if not variants or any(not variants <= have.get(i, set()) for i in ids):
        return False
    if job.positional:
        rotated = sum(POSITIONAL_VARIANT in v for v in have.values())
        return rotated > 0 and all(POSITIONAL_VARIANT in have[i] for i in ids[:rotated])
    return True


def merge(out: Path, work: Path) -> None:
    """Every chunk's records into OUT/<set>/cache.jsonl, one line per key, old lines first."""
    for test in SETS:
        target = out / test / "cache.jsonl"
        seen: dict[str, str] = {}
        sources = [target, *sorted(work.glob(f"{test}-*/cache.jsonl"))]
        for src in sources:
            if not src.is_file():
                continue
            for line in src.read_text(encoding="utf-8").splitlines():
                try:
                    key = json.dumps(json.loads(line)["key"], sort_keys=True)
                except (ValueError, KeyError):
                    continue  # a line torn by a stopped process: recomputed next time
                seen.setdefault(key, line)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(v + "\n" for v in seen.values()), encoding="utf-8")
        questions = {json.loads(key)["question_id"] for key in seen}
        print(f"{test}: {len(seen)} records, {len(questions)} questions", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/shards"))
    # 6 held 74-78 GiB of an H100; a 7th and 8th died of CUDA OOM at start-up.
    ap.add_argument("--procs", type=int, default=5, help="eval processes at once")
    ap.add_argument("--chunk", type=int, default=13, help="questions per process")
    ap.add_argument("--budget", type=float, default=520, help="seconds, then stop and merge")
    ap.add_argument("--rr", default="python3 -m app", help="the CLI to call")
    # The chunks' own reports are discarded (rebuilt from the merged cache), so a short
    # bootstrap there saves their CPU.
    ap.add_argument("--eval-args", default="--resamples 100")
    args = ap.parse_args()
    t0 = time.monotonic()
    deadline = t0 + args.budget
    rr = shlex.split(args.rr)
    extra = shlex.split(args.eval_args)
    args.work.mkdir(parents=True, exist_ok=True)

    for proc in calibrate(rr, args.data, args.out):
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if rc:
            print(f"calibration failed: rc={rc}", flush=True)
            return rc
    print(f"profiles ready after {time.monotonic() - t0:.0f} s", flush=True)

    jobs = make_jobs(args.data, args.work, args.chunk)
    have = {test: cached_variants(args.out, test) for test in SETS}
    for job in jobs:
        if finished(job, have[job.test]):
            (args.work / f"{job.name}.done").write_text("cached\n")
    pending = [j for j in jobs if not (args.work / f"{j.name}.done").exists()]
    print(f"chunks to run: {[j.name for j in pending] or 'none'}", flush=True)
    running: dict[str, tuple[Job, subprocess.Popen[bytes], float]] = {}
    # SIGTERM or Ctrl-C ends the run like the deadline: stop the chunks, merge what finished
    # (a CPU run in a session's background is stopped this way before CI).
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    while (pending or running) and time.monotonic() < deadline and not stopped:
        while pending and len(running) < args.procs:
            job = pending.pop(0)
            started = time.monotonic()
            running[job.name] = (
                job,
                start(job, rr, args.out, args.work, deadline - started, extra),
                started,
            )
        time.sleep(2)
        for name, (_job, proc, started) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            took = time.monotonic() - started
            if rc == 0:
                (args.work / f"{name}.done").write_text(f"{took:.1f}\n")
            print(f"{name}: rc={rc} after {took:.0f} s", flush=True)
    for name, (_, proc, _) in running.items():
        proc.terminate()
        proc.wait()
        print(f"{name}: stopped {'by a signal' if stopped else 'at the deadline'}", flush=True)
    merge(args.out, args.work)
    # Not started, stopped at the deadline or failed: the next call runs them.
    left = [j.name for j in jobs if not (args.work / f"{j.name}.done").exists()]
    print(f"finished in {time.monotonic() - t0:.0f} s; unfinished chunks: {left or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
