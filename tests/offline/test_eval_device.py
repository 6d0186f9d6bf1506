"""scripts/device/parallel.py: the pool that runs the evaluation on a lent GPU. Its chunks must
cover every question once, its merge must keep every finished record once (and survive a line
torn by a stopped process), and a chunk that failed must run again on the next call.

The orchestration is tested against a stand-in for the CLI (``--rr``) that appends one record
per question, so these tests run in a second; the CLI's own ``eval`` and its resume are
tested in tests/offline/test_evaluation.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device" / "parallel.py"

# Stand-in CLI: `calibrate` prints a profile summary; `eval --data F --out D` appends a record
# per question of F to D/cache.jsonl unless the key is there, and fails on a question whose
# id is listed in $FAIL_ON (after recording the questions before it) and hangs on $HANG_ON's.
FAKE_CLI = r"""
import json, os, sys, time
args = sys.argv[1:]
if "calibrate" in args:
    print(json.dumps({"profile": os.environ["RAG_REORDER_BIAS_PROFILE_DIR"], "args": args}))
    sys.exit(0)
data = args[args.index("--data") + 1]
out = args[args.index("--out") + 1]
cache = os.path.join(out, "cache.jsonl")
have = set()
if os.path.exists(cache):
    for line in open(cache):
        have.add(json.loads(line)["key"]["question_id"])
fail = set(os.environ.get("FAIL_ON", "").split(","))
for line in open(data):
    qid = json.loads(line)["id"]
    if qid in fail:
        sys.exit(1)
    if qid == os.environ.get("HANG_ON"):
        time.sleep(120)
    if qid not in have:
        rec = {"key": {"question_id": qid, "variant": "shuffle"},
               "positional": "--no-positional" not in args, "args": args,
               "profiles": os.environ["RAG_REORDER_BIAS_PROFILE_DIR"]}
        with open(cache, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
"""


@pytest.fixture(scope="module")
def parallel() -> ModuleType:
    return load_script(SCRIPT, "eval_device_parallel")


def _data(folder: Path, sizes: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in sizes.items():
        lines = [json.dumps({"id": f"{name}-{i}", "question": "q"}) for i in range(n)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["key"]["question_id"] for line in path.read_text().splitlines()]


def test_chunks_cover_every_question_once_and_only_the_first_rotates(
    parallel: ModuleType, tmp_path: Path
) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 5, "nq_open_dev": 12})
    jobs = parallel.make_jobs(data, tmp_path / "work", chunk=4)
    assert [j.name for j in jobs][:1] == ["nq_open_dev-00"]  # the larger set first
    for test, n in (("hotpot_dev", 5), ("nq_open_dev", 12)):
        mine = [j for j in jobs if j.test == test]
        ids = [json.loads(line)["id"] for j in mine for line in j.data.read_text().splitlines()]
        assert ids == [f"{test}-{i}" for i in range(n)]
        assert [j.positional for j in mine] == [True] + [False] * (len(mine) - 1)


def test_merge_keeps_one_line_per_key_old_lines_first_and_skips_torn_ones(
    parallel: ModuleType, tmp_path: Path
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    old = {"key": {"question_id": "a", "variant": "v"}, "value": "old"}
    (out / "nq_open_dev").mkdir(parents=True)
    (out / "nq_open_dev" / "cache.jsonl").write_text(json.dumps(old) + "\n")
    (work / "nq_open_dev-00").mkdir(parents=True)
    new = {"key": {"variant": "v", "question_id": "a"}, "value": "new"}  # same key, reordered
    other = {"key": {"question_id": "b", "variant": "v"}}
    (work / "nq_open_dev-00" / "cache.jsonl").write_text(
        json.dumps(new) + "\n" + json.dumps(other) + "\n" + '{"key": {"question_id": "c"'
    )
    parallel.merge(out, work)
    lines = [json.loads(x) for x in (out / "nq_open_dev" / "cache.jsonl").read_text().splitlines()]
    assert lines == [old, other]


def test_a_packed_committed_cache_is_read_like_a_plain_one(
    parallel: ModuleType, tmp_path: Path
) -> None:
    # The repository keeps a set's records as cache.jsonl.gz (rag-reorder eval-report --pack):
    # the pool must resume from them and merge new chunks after them.
    import gzip

    out, work = tmp_path / "out", tmp_path / "work"
    old = {"key": {"question_id": "a", "variant": "v"}, "value": "old"}
    (out / "nq_open_dev").mkdir(parents=True)
    with gzip.open(out / "nq_open_dev" / "cache.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(old) + "\n")
    assert parallel.cached_variants(out, "nq_open_dev") == {"a": {"v"}}
    (work / "nq_open_dev-00").mkdir(parents=True)
    other = {"key": {"question_id": "b", "variant": "v"}}
    (work / "nq_open_dev-00" / "cache.jsonl").write_text(json.dumps(other) + "\n")
    parallel.merge(out, work)
    lines = [json.loads(x) for x in (out / "nq_open_dev" / "cache.jsonl").read_text().splitlines()]
    assert lines == [old, other]


def test_a_failed_chunk_runs_again_and_everything_is_merged(tmp_path: Path) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 3, "nq_open_dev": 7})
    out, work = tmp_path / "out", tmp_path / "work"
    (out / "profiles" / "positional-nq_open_dev" / "positional").mkdir(parents=True)
    (out / "hotpot_dev").mkdir(parents=True)
    seeded = {"key": {"question_id": "hotpot_dev-0", "variant": "shuffle"}, "seeded": True}
    (out / "hotpot_dev" / "cache.jsonl").write_text(json.dumps(seeded) + "\n")
    cli = tmp_path / "cli.py"
    cli.write_text(FAKE_CLI)
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--data",
        str(data),
        "--out",
        str(out),
        "--work",
        str(work),
        "--procs",
        "2",
        "--chunk",
        "3",
        "--budget",
        "60",
        "--rr",
        f"{sys.executable} {cli}",
    ]

    first = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "FAIL_ON": "nq_open_dev-4"},
        timeout=120,
        check=True,
    )
    assert "nq_open_dev-01: rc=1" in first.stdout
    assert "unfinished chunks: ['nq_open_dev-01']" in first.stdout  # failed: runs again
    assert not (work / "nq_open_dev-01.done").exists()
    for test in ("hotpot_dev", "nq_open_dev"):  # calibration ran once per set
        assert (out / "profiles" / test / "calibrate-random.json").is_file()
    nq = _ids(out / "nq_open_dev" / "cache.jsonl")
    assert sorted(nq) == sorted(f"nq_open_dev-{i}" for i in (0, 1, 2, 3, 6))

    second = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=120,
        check=True,
    )
    assert "nq_open_dev-01: rc=0" in second.stdout
    assert "unfinished chunks: none" in second.stdout
    assert "nq_open_dev-00" not in second.stdout  # finished chunks do not run again
    nq = _ids(out / "nq_open_dev" / "cache.jsonl")
    assert sorted(nq) == sorted(f"nq_open_dev-{i}" for i in range(7))
    hot = [json.loads(x) for x in (out / "hotpot_dev" / "cache.jsonl").read_text().splitlines()]
    assert hot[0] == seeded  # the committed record is kept, not recomputed
    assert sorted(r["key"]["question_id"] for r in hot) == [f"hotpot_dev-{i}" for i in range(3)]
    positional = {r["key"]["question_id"]: r["positional"] for r in hot[1:]}
    assert all("--scorer" not in r["args"] for r in hot[1:])  # same-model runs name no models
    assert positional == {"hotpot_dev-1": True, "hotpot_dev-2": True}  # first chunk rotates


def test_a_chunk_the_committed_cache_already_holds_is_not_started(
    parallel: ModuleType, tmp_path: Path
) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 2, "nq_open_dev": 6})
    out, work = tmp_path / "out", tmp_path / "work"
    jobs = {j.name: j for j in parallel.make_jobs(data, work, chunk=3)}

    def write(records: list[tuple[str, str]]) -> None:
        (out / "nq_open_dev").mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"key": {"question_id": q, "variant": v}}) for q, v in records]
        (out / "nq_open_dev" / "cache.jsonl").write_text("\n".join(lines) + "\n")

    every = [(f"nq_open_dev-{i}", v) for i in range(6) for v in ("shuffle", "moi:cyclic:x")]
    write(every[:-1])  # the last question misses a variant the others have
    assert (
        parallel.finished(jobs["nq_open_dev-00"], parallel.cached_variants(out, "nq_open_dev"))
        is False
    )  # no positional records
    assert (
        parallel.finished(jobs["nq_open_dev-01"], parallel.cached_variants(out, "nq_open_dev"))
        is False
    )
    rotations = [(f"nq_open_dev-{i}", "positional") for i in range(2)]
    write(every[:-1] + rotations)
    assert (
        parallel.finished(jobs["nq_open_dev-00"], parallel.cached_variants(out, "nq_open_dev"))
        is True
    )
    assert (
        parallel.finished(jobs["nq_open_dev-01"], parallel.cached_variants(out, "nq_open_dev"))
        is False
    )
    write(every + rotations[:1] + [("nq_open_dev-2", "positional")])  # a gap in the rotations
    assert (
        parallel.finished(jobs["nq_open_dev-00"], parallel.cached_variants(out, "nq_open_dev"))
        is False
    )
    assert (
        parallel.finished(jobs["nq_open_dev-01"], parallel.cached_variants(out, "nq_open_dev"))
        is True
    )
    assert (
        parallel.finished(jobs["hotpot_dev-00"], parallel.cached_variants(out, "hotpot_dev"))
        is False
    )  # no cache for the set

    write(every + rotations)
    (out / "profiles" / "positional-nq_open_dev" / "positional").mkdir(parents=True)
    cli = tmp_path / "cli.py"
    cli.write_text(FAKE_CLI)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), "--work",
         str(work), "--chunk", "3", "--budget", "60", "--rr", f"{sys.executable} {cli}"],
        capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=120,
        check=True,
    )  # fmt: skip
    assert "chunks to run: ['hotpot_dev-00']" in run.stdout
    assert not (work / "nq_open_dev-00.log").exists()  # never started
    assert "unfinished chunks: none" in run.stdout


def test_a_signal_stops_the_chunks_and_keeps_what_finished(tmp_path: Path) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 2, "nq_open_dev": 4})
    out, work = tmp_path / "out", tmp_path / "work"
    (out / "profiles" / "positional-nq_open_dev" / "positional").mkdir(parents=True)
    cli = tmp_path / "cli.py"
    cli.write_text(FAKE_CLI)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), "--work",
         str(work), "--procs", "1", "--chunk", "2", "--budget", "100",
         "--rr", f"{sys.executable} {cli}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"PATH": os.environ["PATH"], "HANG_ON": "nq_open_dev-3"},
    )  # fmt: skip
    partial = work / "nq_open_dev-01" / "cache.jsonl"
    deadline = time.monotonic() + 60
    while not (partial.is_file() and partial.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)  # chunk 01 has recorded question 2 and hangs on question 3
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout
    assert "nq_open_dev-01: stopped by a signal" in stdout
    assert "unfinished chunks: ['nq_open_dev-01', 'hotpot_dev-00']" in stdout
    nq = _ids(out / "nq_open_dev" / "cache.jsonl")
    assert sorted(nq) == [f"nq_open_dev-{i}" for i in range(3)]  # the finished ones, merged


def test_merge_replaces_a_failed_generation_with_a_later_finished_record(
    parallel: ModuleType, tmp_path: Path
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    failed = {"key": {"question_id": "a", "variant": "v"}, "generator_error": "generation failed"}
    (out / "nq_open_dev").mkdir(parents=True)
    (out / "nq_open_dev" / "cache.jsonl").write_text(json.dumps(failed) + "\n")
    assert parallel.cached_variants(out, "nq_open_dev") == {}  # not finished: runs again
    (work / "nq_open_dev-00").mkdir(parents=True)
    good = {"key": {"question_id": "a", "variant": "v"}, "generator_error": None}
    also_failed = {
        "key": {"question_id": "b", "variant": "v"},
        "generator_error": "gold answer scoring failed",
    }
    (work / "nq_open_dev-00" / "cache.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps(also_failed) + "\n"
    )
    parallel.merge(out, work)
    lines = [json.loads(x) for x in (out / "nq_open_dev" / "cache.jsonl").read_text().splitlines()]
    assert lines == [good]


def test_a_pairing_runs_both_sets_with_its_models_profiles_and_no_rotations(
    parallel: ModuleType, tmp_path: Path
) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 2, "nq_open_dev": 5})
    out, work = tmp_path / "out", tmp_path / "work"
    # The committed cache holds the first NQ question already: with the pairing's variants
    # as given by its --strategies, the chunk of that question alone is finished.
    name = "s__g"
    (out / f"nq_open_dev__{name}").mkdir(parents=True)
    (out / f"nq_open_dev__{name}" / "cache.jsonl").write_text(
        json.dumps({"key": {"question_id": "nq_open_dev-0", "variant": "shuffle"}}) + "\n"
    )
    runs = parallel.pairing_runs(f"org/s,org/g,{name}", "shuffle")
    jobs = parallel.make_jobs(data, work, 1, runs)
    assert [j.name for j in jobs][:2] == [f"nq_open_dev__{name}-00", f"nq_open_dev__{name}-01"]
    assert not any(j.positional for j in jobs)
    assert parallel.expected_variants(runs[0]) == {"shuffle"}
    with pytest.raises(ValueError, match="SCORER,GENERATOR,NAME"):
        parallel.pairing_runs("org/s,org/g")

    cli = tmp_path / "cli.py"
    cli.write_text(FAKE_CLI)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), "--work",
         str(work), "--chunk", "2", "--budget", "60", "--rr", f"{sys.executable} {cli}",
         "--pairing", f"org/s,org/g,{name}", "--strategies", "shuffle"],
        capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=120,
        check=True,
    )  # fmt: skip
    assert "unfinished chunks: none" in run.stdout
    assert f"nq_open_dev__{name}: 5 records, 5 questions (5 with every variant)" in run.stdout
    assert "--model org/g calibrate" in run.stdout  # the generator's profile, as cross_model.sh
    assert not (out / "nq_open_dev").exists()  # no same-model run without --same-model
    for test, n in (("hotpot_dev", 2), ("nq_open_dev", 5)):
        folder = out / f"{test}__{name}"
        assert (out / "profiles" / folder.name / "calibrate-random.json").is_file()
        recs = [json.loads(x) for x in (folder / "cache.jsonl").read_text().splitlines()]
        assert sorted(r["key"]["question_id"] for r in recs) == [f"{test}-{i}" for i in range(n)]
        for r in recs[1:] if test == "nq_open_dev" else recs:
            assert r["positional"] is False
            assert r["args"][r["args"].index("--scorer") + 1] == "org/s"
            assert r["args"][r["args"].index("--generator") + 1] == "org/g"
            assert r["profiles"] == str(out / "profiles" / folder.name)


def test_merge_only_merges_the_chunks_and_starts_nothing(tmp_path: Path) -> None:
    data = _data(tmp_path / "data", {"hotpot_dev": 1, "nq_open_dev": 2})
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "nq_open_dev-00").mkdir(parents=True)
    rec = {"key": {"question_id": "nq_open_dev-0", "variant": "shuffle"}}
    (work / "nq_open_dev-00" / "cache.jsonl").write_text(json.dumps(rec) + "\n")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), "--work",
         str(work), "--merge-only", "--rr", "false"],
        capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=60,
        check=True,
    )  # fmt: skip
    assert "nq_open_dev: 1 records, 1 questions" in run.stdout
    assert _ids(out / "nq_open_dev" / "cache.jsonl") == ["nq_open_dev-0"]
    assert "calibrate" not in run.stdout and not (out / "profiles").exists()


def test_merge_counts_the_questions_with_every_variant_of_a_pairing(
    parallel: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    (run,) = [r for r in parallel.pairing_runs("org/s,org/g,p", "shuffle,retriever")
              if r.test == "nq_open_dev"]  # fmt: skip
    (work / f"{run.folder}-00").mkdir(parents=True)
    recs = [("a", "shuffle"), ("a", "retriever"), ("b", "shuffle")]
    (work / f"{run.folder}-00" / "cache.jsonl").write_text(
        "".join(json.dumps({"key": {"question_id": q, "variant": v}}) + "\n" for q, v in recs)
    )
    parallel.merge(out, work, [run])
    # "b" lacks `retriever`: a --cached-only report can cover "a" alone.
    assert f"{run.folder}: 3 records, 2 questions (1 with every variant)" in capsys.readouterr().out


# Stand-in CLI for scripts/device/distill.sh: `distill --score-only` writes the preference set,
# `distill` the manifest, `distill-eval` the summary; each call is logged, and $FAIL_STEP
# makes that step exit 3; $LIMITS logs each step's --limit, $SLOW_SCORE makes scoring hang.
FAKE_DISTILL_CLI = r"""
import json, os, sys
args = sys.argv[1:]
step = "score" if "--score-only" in args else ("train" if args[0] == "distill" else "eval")
out = args[args.index("--out") + 1]
with open(os.environ["CALLS"], "a") as fh:
    fh.write(step + "\n")
if os.environ.get("FAIL_STEP") == step:
    sys.exit(3)
if os.environ.get("LIMITS"):
    with open(os.environ["LIMITS"], "a") as fh:
        fh.write(step + " " + args[args.index("--limit") + 1] + "\n")
os.makedirs(out, exist_ok=True)
if step == "score" and os.environ.get("SLOW_SCORE"):
    # Three questions scored, then the teacher is still busy when SCORE_FOR runs out.
    import time
    with open(os.path.join(out, "preferences.jsonl"), "w") as fh:
        fh.write(json.dumps({"meta": {}}) + "\n")
        fh.writelines(json.dumps({"id": f"q{i}"}) + "\n" for i in range(3))
    time.sleep(60)
elif step == "score":
    with open(os.path.join(out, "preferences.jsonl"), "w") as fh:
        fh.write(json.dumps({"meta": {}}) + "\n" + json.dumps({"id": "q0"}) + "\n")
elif step == "train":
    open(os.path.join(out, "distill.json"), "w").write("{}")
else:
    open(os.path.join(out, "summary.json"), "w").write("{}")
"""


def _distill_sh(tmp_path: Path, **env: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs scripts/device/distill.sh locally over the stand-in CLI, folders under ``tmp_path``;
    each call's keyword arguments add to ``env``."""
    cli = tmp_path / "cli.py"
    cli.write_text(FAKE_DISTILL_CLI)
    base = {
        "PATH": os.environ["PATH"], "LOCAL": "1", "RR": f"{sys.executable} {cli}",
        "CALLS": str(tmp_path / "calls.txt"), "WORK": str(tmp_path / "distill"),
        "OUT": str(tmp_path / "out"), "DATA": str(tmp_path),
    } | env  # fmt: skip

    def call(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(ROOT / "scripts" / "device" / "distill.sh")], cwd=ROOT, check=False,
            env=base | extra, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    return call


def test_the_distillation_calls_resume_step_by_step_and_pack_the_folder(tmp_path: Path) -> None:
    calls, work, out = tmp_path / "calls.txt", tmp_path / "distill", tmp_path / "out"
    call = _distill_sh(tmp_path)

    # Too little of the call left to train: the set is scored, training waits.
    first = call(BUDGET="20", TRAIN_MIN="100")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "training waits" in first.stdout
    # A failing step is reported in the exit status; the finished one is not run again.
    failed = call(FAIL_STEP="train")
    assert failed.returncode == 3 and not (work / "distill.json").exists()
    done = call()
    assert done.returncode == 0, done.stdout + done.stderr
    again = call()  # everything finished: nothing runs, the folder is packed again
    assert again.returncode == 0
    assert calls.read_text().split() == ["score", "train", "train", "eval"]
    with tarfile.open(out / "distill.tgz") as tar:
        names = set(tar.getnames())
    assert {
        "distill/preferences.jsonl",
        "distill/distill.json",
        "distill/dev/summary.json",
    } <= names


def test_score_for_trains_on_the_questions_scored_in_time(tmp_path: Path) -> None:
    limits = tmp_path / "limits.txt"
    call = _distill_sh(tmp_path, LIMITS=str(limits), HELD_BACK="1", TRAIN_MIN="5")

    # Scoring is cut after 3 s; too little is left to train in this call.
    cut = call(SLOW_SCORE="1", SCORE_FOR="3", BUDGET="40", TRAIN_MIN="38", LIMIT="1000")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert "the set is the first 3 questions" in cut.stdout and "training waits" in cut.stdout
    # The next call keeps the cut limit (from $WORK/.limit), not the LIMIT it is given.
    assert call(LIMIT="1000").returncode == 0
    assert limits.read_text().split("\n")[:-1] == ["score 1000", "train 3", "eval 200"]
