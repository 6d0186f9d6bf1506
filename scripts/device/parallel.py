"""Runs eval/run.sh's (and eval/cross_model.sh's) work as several `rag-reorder eval`
processes sharing one GPU.

One process keeps a lent GPU busy only part of the time with a 135M model (it tokenises,
solves and decides between small forward batches), so the questions of each set are split
into chunks and a pool of processes runs them at once, each chunk in its own output folder
seeded with the set's committed cache (finished records are never recomputed). Before them,
the MoI bias profiles are calibrated exactly as eval/run.sh does (both sets at once). At the
deadline every unfinished process is stopped; the chunks' caches are then merged into
OUT/<set>/cache.jsonl, so what finished is kept and a later call (on the same machine, or on a
fresh one from the merged results) continues. Reports are rebuilt afterwards from the merged
cache with the full data file (scripts/device/README.md).

The first chunk of each set keeps the positional rotations: it holds the set's first
questions, so it rotates the same ones the full run would.

``--pairing SCORER,GENERATOR,NAME`` (repeatable) adds eval/cross_model.sh's runs to the pool:
each set's questions scored by SCORER and answered by GENERATOR into OUT/<set>__NAME/, the
generator's bias profile from OUT/profiles/<set>__NAME/ (calibrated first, as
eval/cross_model.sh does, when it is missing), no positional rotations. With a pairing the
same-model runs are left out unless ``--same-model`` asks for them too.

Usage (on the device, after scripts/device/stage.sh; see scripts/device/README.md):
    python3 scripts/device/parallel.py --data /tmp/data --out /tmp/evalout --budget 520
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The evaluation's own rule for an unfinished record (this import loads no model library).
from offline.evaluation.records import RETRYABLE_GENERATOR_ERRORS

K = 10  # passages per question, as eval/run.sh
CALIBRATION_QUESTIONS = 50
# eval/cross_model.sh's defaults: the generator's profile from 16 questions, 20 prompts each.
PAIRING_CALIBRATION = ("16", "20")
PAIRING_STRATEGIES = (
    "moi:pruned_random,retriever,shuffle,litm,query_likelihood,query_generation,bm25,dense"
)
# test set -> the set its MoI bias profiles are calibrated on (eval/run.sh's run_set calls)
SETS = {"hotpot_dev": "nq_open_dev", "nq_open_dev": "hotpot_dev"}
POSITIONAL = "profiles/positional-nq_open_dev"
POSITIONAL_VARIANT = "positional"  # the cache key's variant of a positional rotation record


def _finished_record(line: str) -> dict[str, object] | None:
    """The record on ``line`` when it is a finished one (parses, has a key, its generator did
    not fail), else ``None``."""
    try:
        rec = json.loads(line)
        rec["key"]
    except (ValueError, KeyError, TypeError):
        return None  # a line torn by a stopped process: recomputed next time
    if rec.get("generator_error") in RETRYABLE_GENERATOR_ERRORS:
        return None
    return rec  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Run:
    """One evaluation folder the pool fills: a data set, and for a pairing its two models."""

    test: str
    """The data set (``<data>/<test>.jsonl``)."""
    folder: str
    """OUT/<folder>/ holds its cache; OUT/profiles/<folder>/ its bias profiles."""
    scorer: str | None = None
    generator: str | None = None
    strategies: str | None = None

    @property
    def pairing(self) -> bool:
        return self.generator is not None

    def eval_args(self) -> list[str]:
        if not self.pairing:
            return []
        assert self.scorer and self.generator and self.strategies
        return [
            "--scorer", self.scorer, "--generator", self.generator,
            "--strategies", self.strategies,
        ]  # fmt: skip


def same_model_runs() -> list[Run]:
    return [Run(test, test) for test in SETS]


def pairing_runs(spec: str, strategies: str = PAIRING_STRATEGIES) -> list[Run]:
    """``SCORER,GENERATOR,NAME`` -> one run per set, as eval/cross_model.sh names them."""
    parts = spec.split(",")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--pairing wants SCORER,GENERATOR,NAME, got {spec!r}")
    scorer, generator, name = parts
    return [Run(test, f"{test}__{name}", scorer, generator, strategies) for test in SETS]


@dataclass
class Job:
    name: str
    data: Path
    positional: bool
    run: Run

    @property
    def test(self) -> str:
        return self.run.test

    @property
    def folder_name(self) -> str:
        return self.run.folder

    def folder(self, work: Path) -> Path:
        return work / self.name


def calibrate(
    rr: list[str], data: Path, out: Path, runs: list[Run] | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start the missing bias-profile calibrations: eval/run.sh's first step per set for a
    same-model run, eval/cross_model.sh's (the generator's, on the other set) for a pairing."""
    procs = []
    for run in same_model_runs() if runs is None else runs:
        calib = SETS[run.test]
        prof = out / "profiles" / run.folder
        target = prof / "calibrate-random.json"
        if run.pairing:
            prof.mkdir(parents=True, exist_ok=True)
            if target.is_file() and target.stat().st_size:
                continue
            questions, prompts = PAIRING_CALIBRATION
            assert run.generator is not None
            cmd = [
                *rr, "--model", run.generator, "calibrate",
                "--data", str(data / f"{calib}.jsonl"), "--limit", questions,
                "--num-prompts", prompts, "--max-passages", str(K), "--design", "random",
            ]  # fmt: skip
        else:
            (prof / "positional").mkdir(parents=True, exist_ok=True)
            for f in (out / POSITIONAL / "positional").glob("*.json"):
                shutil.copy(f, prof / "positional" / f.name)
            if target.is_file() and target.stat().st_size:
                continue
            cmd = [
                *rr, "calibrate", "--data", str(data / f"{calib}.jsonl"),
                "--limit", str(CALIBRATION_QUESTIONS), "--max-passages", str(K),
                "--design", "random",
            ]  # fmt: skip
        print("+", shlex.join(cmd), f"(profiles: {prof})", flush=True)
        env = {**os.environ, "RAG_REORDER_BIAS_PROFILE_DIR": str(prof)}
        script = f'{shlex.join(cmd)} > "{target}.tmp" && mv "{target}.tmp" "{target}"'
        procs.append(subprocess.Popen(["bash", "-c", script], env=env))
    return procs


def make_jobs(data: Path, work: Path, chunk: int, runs: list[Run] | None = None) -> list[Job]:
    """Chunks of each run's questions as JSONL files under ``work``: runs in the order given,
    within the runs of one kind (same-model, or one pairing) the largest set first. Only a
    same-model run's first chunk rotates (a pairing runs with ``--no-positional``)."""
    jobs: list[Job] = []
    questions = {
        t: [ln for ln in (data / f"{t}.jsonl").read_text().splitlines() if ln.strip()] for t in SETS
    }
    chosen = same_model_runs() if runs is None else runs
    group = {run: (run.scorer, run.generator) for run in chosen}
    first = {key: i for i, key in reversed(list(enumerate(group.values())))}
    ordered = sorted(chosen, key=lambda r: (first[group[r]], -len(questions[r.test])))
    for run in ordered:
        lines = questions[run.test]
        for i in range(0, len(lines), chunk):
            name = f"{run.folder}-{i // chunk:02d}"
            path = work / "data" / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines[i : i + chunk]) + "\n")
            positional = i == 0 and not run.pairing
            jobs.append(Job(name, path, positional=positional, run=run))
    return jobs


def start(
    job: Job, rr: list[str], out: Path, work: Path, remaining: float, extra: list[str]
) -> subprocess.Popen[bytes]:
    folder = job.folder(work)
    if not folder.is_dir():  # first time: the run's finished records
        folder.mkdir(parents=True)
        lines = cache_lines(out / job.run.folder)
        if lines:
            (folder / "cache.jsonl").write_text("".join(ln + "\n" for ln in lines), "utf-8")
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
        *job.run.eval_args(),
        *extra,
    ]
    env = {**os.environ, "RAG_REORDER_BIAS_PROFILE_DIR": str(out / "profiles" / job.run.folder)}
    log = (work / f"{job.name}.log").open("ab")
    return subprocess.Popen(
        ["timeout", str(int(remaining)), *cmd], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def cache_lines(folder: Path) -> list[str]:
    """A run folder's record lines: its packed ``cache.jsonl.gz`` (what the repository keeps),
    then its plain ``cache.jsonl`` (what runs append to), as ``RecordCache`` reads them."""
    lines: list[str] = []
    packed = folder / "cache.jsonl.gz"
    if packed.is_file():
        with gzip.open(packed, "rt", encoding="utf-8") as fh:
            lines += fh.read().splitlines()
    plain = folder / "cache.jsonl"
    if plain.is_file():
        lines += plain.read_text(encoding="utf-8").splitlines()
    return lines


def cached_variants(out: Path, folder: str) -> dict[str, set[str]]:
    """Question id -> the variants OUT/<folder>'s records (a set's committed cache) hold."""
    lines = cache_lines(out / folder)
    records = (rec for rec in map(_finished_record, lines) if rec is not None)
    return variants_by_question(rec["key"] for rec in records)


def variants_by_question(keys: Iterable[object]) -> dict[str, set[str]]:
    """Question id -> its variants, from records' cache keys."""
    have: dict[str, set[str]] = {}
    for key in keys:
        assert isinstance(key, dict)
        have.setdefault(key["question_id"], set()).add(key["variant"])
    return have


def finished(job: Job, have: dict[str, set[str]], expected: set[str] | None = None) -> bool:
    """Whether the set's committed cache (``cached_variants``) already holds every record
    ``job`` would compute.

    A chunk's process would only reload them and rebuild a throw-away report (minutes on a
    CPU: scipy's exact Wilcoxon test for 13 pairs), so such chunks are not started. The
    expected variants are the ones the cache holds for any question, and ``expected`` (the
    variants the run's eval selects: a variant the cache holds for no question yet, such as a
    newly added default one, is still expected); the positional chunk also needs one
    positional record per question the cache ran rotations for.
    """
    variants = (set().union(*have.values()) | (expected or set())) - {POSITIONAL_VARIANT}
    ids = [json.loads(ln)["id"] for ln in job.data.read_text().splitlines() if ln.strip()]
    if not variants or any(not variants <= have.get(i, set()) for i in ids):
        return False
    if job.positional:
        rotated = sum(POSITIONAL_VARIANT in v for v in have.values())
        return rotated > 0 and all(POSITIONAL_VARIANT in have[i] for i in ids[:rotated])
    return True


def expected_variants(run: Run, all_variants: bool = False) -> set[str]:
    """The variant labels ``rag-reorder eval`` selects for ``run`` (a pairing's
    ``--strategies``; with ``all_variants`` a same-model run's whole default set), else none."""
    if not run.pairing and not all_variants:
        return set()
    from offline.evaluation.variants import select_variants

    spec = run.strategies.split(",") if run.pairing and run.strategies else None
    cross = run.pairing and run.scorer != run.generator
    return {v.label for v in select_variants(spec, cross_model=cross)}


def merge(out: Path, work: Path, runs: list[Run] | None = None, all_variants: bool = False) -> None:
    """Every chunk's records into OUT/<folder>/cache.jsonl, one line per key, old lines first;
    a torn line, or a record whose generator failed (``RETRYABLE_GENERATOR_ERRORS``), is left
    out, so a later good record of its key takes its place. Prints each folder's counts, with
    the questions that have every expected variant (``expected_variants``) where it knows
    them: the number a report rebuilt with ``--cached-only`` can cover."""
    for run in same_model_runs() if runs is None else runs:
        target = out / run.folder / "cache.jsonl"
        seen: dict[str, str] = {}
        sources = [
            cache_lines(target.parent),
            *(
                src.read_text(encoding="utf-8").splitlines()
                for src in sorted(work.glob(f"{run.folder}-[0-9][0-9]/cache.jsonl"))
            ),
        ]
        for lines in sources:
            for line in lines:
                rec = _finished_record(line)
                if rec is not None:
                    seen.setdefault(json.dumps(rec["key"], sort_keys=True), line)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(v + "\n" for v in seen.values()), encoding="utf-8")
        variants = variants_by_question(json.loads(key) for key in seen)
        line = f"{run.folder}: {len(seen)} records, {len(variants)} questions"
        expected = expected_variants(run, all_variants)
        if expected:
            complete = sum(1 for have in variants.values() if expected <= have)
            line += f" ({complete} with every variant)"
        print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/shards"))
    # 6 held 74-78 GiB of an H100; a 7th and 8th died of CUDA OOM at start-up.
    ap.add_argument("--procs", type=int, default=5, help="eval processes at once")
    ap.add_argument("--chunk", type=int, default=13, help="questions per process")
    ap.add_argument("--budget", type=float, default=520, help="seconds, then stop and merge")
    ap.add_argument("--rr", default="python3 -m entrypoints", help="the CLI to call")
    # The chunks' own reports are discarded (rebuilt from the merged cache), so a short
    # bootstrap there saves their CPU.
    ap.add_argument("--eval-args", default="--resamples 100")
    ap.add_argument(
        "--pairing",
        action="append",
        default=[],
        metavar="SCORER,GENERATOR,NAME",
        help="add eval/cross_model.sh's runs of this pairing (both sets; repeatable)",
    )
    ap.add_argument("--strategies", default=PAIRING_STRATEGIES, help="a pairing's variants")
    ap.add_argument(
        "--same-model", action="store_true", help="with --pairing: run the same-model sets too"
    )
    ap.add_argument(
        "--all-variants",
        action="store_true",
        help="a same-model chunk is finished only with every default variant (not only those "
        "its cache holds for some question): runs variants added to the default set since",
    )
    ap.add_argument(
        "--merge-only",
        action="store_true",
        help="merge what the chunks under --work have finished into --out and stop (safe "
        "beside a running pool, whose own merge at the end starts from the merged file)",
    )
    args = ap.parse_args()
    runs = [r for spec in args.pairing for r in pairing_runs(spec, args.strategies)]
    if not runs or args.same_model:
        runs += same_model_runs()
    if args.merge_only:
        merge(args.out, args.work, runs, args.all_variants)
        return 0
    t0 = time.monotonic()
    deadline = t0 + args.budget
    rr = shlex.split(args.rr)
    extra = shlex.split(args.eval_args)
    args.work.mkdir(parents=True, exist_ok=True)

    for proc in calibrate(rr, args.data, args.out, runs):
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code:
            print(f"calibration failed: rc={code}", flush=True)
            return code
    print(f"profiles ready after {time.monotonic() - t0:.0f} s", flush=True)

    jobs = make_jobs(args.data, args.work, args.chunk, runs)
    have = {run.folder: cached_variants(args.out, run.folder) for run in runs}
    expect = {run.folder: expected_variants(run, args.all_variants) for run in runs}
    for job in jobs:
        if finished(job, have[job.folder_name], expect[job.folder_name]):
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
    merge(args.out, args.work, runs, args.all_variants)
    # Not started, stopped at the deadline or failed: the next call runs them.
    left = [j.name for j in jobs if not (args.work / f"{j.name}.done").exists()]
    print(f"finished in {time.monotonic() - t0:.0f} s; unfinished chunks: {left or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
