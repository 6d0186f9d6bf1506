"""tests/support/short_data.py: the slow tests' short dev set changes the passages' text only."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.short_data import DEV, short_dev_set


def test_only_each_passages_text_is_cut_and_every_other_field_kept(tmp_path: Path) -> None:
    out = short_dev_set(tmp_path / "d" / "dev.jsonl", 3, words=5)
    full = [json.loads(line) for line in DEV.read_text().splitlines()[:3]]
    short = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(short) == 3
    for long_row, short_row in zip(full, short, strict=True):
        texts = [p.pop("text") for p in long_row["passages"]]
        cut = [p.pop("text") for p in short_row["passages"]]
        assert short_row == long_row  # ids, questions, answers, titles, gold: as they were
        assert cut == [" ".join(t.split()[:5]) for t in texts]
        assert all(len(c.split()) == 5 for c in cut)  # the dev set's passages are longer
