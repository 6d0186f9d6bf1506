"""Positional profiles the way an operator makes them: a small QA file and the real
``rag-reorder calibrate-positions`` command on a real (tiny or SmolLM2) model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from entrypoints.cli import main as cli_main

Topic = tuple[str, str, str]  # question, answer, gold passage

TOPICS: list[Topic] = [
    ("Who wrote The Hobbit?", "Tolkien", "J. R. R. Tolkien wrote The Hobbit in 1937."),
    ("What is the capital of France?", "Paris", "Paris is the capital city of France."),
]
FILLERS = [
    "The Nile is a river in Africa.",
    "Copper is a chemical element.",
    "Chess is played on a board of 64 squares.",
    "The violin has four strings.",
]


def write_qa_file(path: Path, topics: list[Topic] = TOPICS) -> Path:
    """Questions with their gold passage in slot 2 among the four fillers (the dataset
    schema of ``../shared/data``)."""
    with path.open("w", encoding="utf-8") as fh:
        for k, (question, answer, gold) in enumerate(topics):
            passages = [{"title": "Filler", "text": t, "is_gold": False} for t in FILLERS]
            passages.insert(1, {"title": "Gold", "text": gold, "is_gold": True})
            record = {"id": f"q{k}", "question": question, "answers": [answer]}
            fh.write(json.dumps({**record, "passages": passages}) + "\n")
    return path


async def calibrate_positions(
    model_dir: Path,
    data: Path,
    capsys: pytest.CaptureFixture[str],
    *extra: str,
) -> tuple[dict[str, Any], str]:
    """Run ``rag-reorder calibrate-positions`` at 3 slots on the CPU transformers backend;
    the profiles go where the environment's ``RAG_REORDER_*`` settings say. Returns the
    printed JSON and the progress written to stderr."""
    argv = ["--backend", "transformers", "--model", str(model_dir), "--device", "cpu"]
    argv += ["calibrate-positions", "--data", str(data), "--max-passages", "3", *extra]
    code = await anyio.to_thread.run_sync(lambda: cli_main(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err
