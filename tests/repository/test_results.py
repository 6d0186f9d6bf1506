"""The committed results stay lean and reproducible: no tracked file under results/eval or
results/bench grows past a stated size, an evaluation keeps its records compressed and its
manifest, not what they rebuild, and a committed report is rebuilt byte for byte from them by
`rag-reorder eval-report` (checked here on one small folder)."""

from __future__ import annotations

import filecmp
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from offline.evaluation.rebuild import MANIFEST_FILE, rebuild_report
from tests.support.committed import COMMITTED

ROOT = Path(__file__).resolve().parents[2]
MAX_TRACKED_BYTES = 2 * 1024 * 1024
"""The largest file a results folder may commit (today's largest: a 1.9 MB LoRA adapter)."""
REBUILT = ("summary.md", "bias_by_slot.png", "positional_by_slot.png", "quality_vs_tokens.png")
SMALL_RUN = ROOT / "results" / "eval" / "hotpot_dev__gemma-3-270m__gemma-3-270m"


def tracked(*folders: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--", *folders], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines()]


def test_no_tracked_result_file_is_larger_than_the_limit() -> None:
    files = tracked("results/eval", "results/bench")
    assert files, "git ls-files found no results: not a checkout?"
    big = [
        f"{f.relative_to(ROOT)}: {f.stat().st_size} bytes"
        for f in files
        if f.stat().st_size > MAX_TRACKED_BYTES
    ]
    assert not big, f"over {MAX_TRACKED_BYTES} bytes:\n" + "\n".join(big)


def test_results_live_in_one_home_apart_from_the_code() -> None:
    # Evidence under results/, scripts in bench/ and eval/: a search of the code lands in code.
    code = ("bench", "eval", "scripts", "app", "service", "solver", "offline")
    stray = [f for f in tracked(*code) if "results" in f.relative_to(ROOT).parts[:-1]]
    assert not stray, "results outside results/:\n" + "\n".join(map(str, stray))


def test_no_script_reads_or_writes_the_old_results_homes() -> None:
    # eval/context.py kept writing to eval/results/context after the move (and read its bias
    # profiles from a folder that no longer existed, so MoI placed by the data's own fit).
    old = re.compile(r"""(eval|bench)/results|["'](eval|bench)["']\s*/\s*["']results["']""")
    code = ("bench", "eval", "scripts", "app", "service", "solver", "offline", "entrypoints")
    stale = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in tracked(*code)
        if f.suffix == ".py"
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert not stale, "the results moved to results/:\n" + "\n".join(stale)


def test_no_runtime_logs_or_state_are_committed() -> None:
    # A run's logs and its server's state are rewritten by every run; what a doc cites from a
    # log stays in that folder's logs.md (.gitignore keeps the rest out).
    runtime = [
        f.relative_to(ROOT)
        for f in tracked("results")
        if f.suffix in {".log", ".sqlite", ".db"} or "state" in f.relative_to(ROOT).parts[:-1]
    ]
    assert not runtime, "runtime output committed:\n" + "\n".join(map(str, runtime))


def test_the_committed_evaluations_are_found() -> None:
    # Tests parametrised by COMMITTED (tests/offline) would skip silently on an empty list.
    assert len(COMMITTED) >= 6, COMMITTED


def test_evaluations_commit_their_records_packed_and_nothing_they_rebuild() -> None:
    files = tracked("results/eval")
    names = {f.name for f in files}
    assert "results.json" not in names and "cache.jsonl" not in names
    runs = {f.parent for f in files if f.name == MANIFEST_FILE}
    assert SMALL_RUN in runs
    for run in runs:
        assert (run / "cache.jsonl.gz") in files, run


@pytest.mark.slow
def test_a_committed_report_is_rebuilt_byte_for_byte_from_its_records(tmp_path: Path) -> None:
    copy = tmp_path / SMALL_RUN.name
    shutil.copytree(SMALL_RUN, copy)
    for name in REBUILT:
        (copy / name).unlink()
    rebuild_report(copy)
    for name in REBUILT:
        assert filecmp.cmp(SMALL_RUN / name, copy / name, shallow=False), name
    assert (copy / "results.json").is_file()  # rebuilt too, not committed
