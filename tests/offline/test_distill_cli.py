"""``rag-reorder distill`` end to end on a tiny random model (teacher and student alike): the
preference set, the adapter, its manifest, and a resumed run that scores nothing again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrypoints.cli import main
from offline.distill.preferences import read_preferences
from service.model_assets.adapter import read_manifest
from tests.support.positional import write_qa_file


def test_distill_command_writes_an_adapter_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qa = write_qa_file(tmp_path / "qa.jsonl")
    out = tmp_path / "adapter"
    args = [
        "--model", str(tiny_model_dir), "--device", "cpu",
        "distill", "--data", str(qa), "--student", str(tiny_model_dir),
        "--passages", "3", "--permutations", "4", "--permutations-per-step", "2",
        "--held-back", "1", "--epochs", "1", "--batch-questions", "1",
        "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["questions"] == 2 and printed["scored_now"] == 2
    manifest = read_manifest(out)
    assert manifest.base_model == str(tiny_model_dir) and manifest.teacher == str(tiny_model_dir)
    assert (manifest.passages, manifest.permutations, manifest.steps) == (3, 4, 1)
    meta, prefs = read_preferences(out / "preferences.jsonl")
    assert meta.passages == 3 and [len(p.orders) for p in prefs] == [4, 4]

    # Resumed: the teacher scores nothing again; other sizes on the same set are refused.
    assert main([*args, "--score-only"]) == 0
    assert json.loads(capsys.readouterr().out)["scored_now"] == 0
    assert main([*args[:-2], "--permutations", "5", "--out", str(out)]) == 2
    assert "built with" in capsys.readouterr().err
