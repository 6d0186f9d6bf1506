"""``eval/purge_tokenizer_records.py``, and the committed caches it cleaned stay clean."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.committed import COMMITTED, committed_lines
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="module")
def purge() -> ModuleType:
    return load_script(ROOT / "eval" / "purge_tokenizer_records.py", "eval_purge")


def _record(q: str, variant: str, tokens: int | None, prompts: int = 2) -> str:
    cost = None if tokens is None else {"prompts": prompts, "prompt_tokens": tokens}
    key = {"question_id": q, "variant": variant, "max_passages": 2}
    return json.dumps({"key": key, "status": "ok", "generator_cost": cost})


def test_drops_only_the_records_with_too_many_tokens_per_character(
    purge: ModuleType, tmp_path: Path
) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    passages = [{"title": "T", "text": "x" * 99}, {"title": "U", "text": "y" * 99}] * 2
    (data / "set.jsonl").write_text(
        json.dumps({"id": "q", "question": "?" * 50, "passages": passages})
    )
    # 2 passages of 100 characters and a 50-character question: 250 characters a prompt.
    chars = purge.prompt_chars(data)
    assert chars[("q", 2)] == 250
    lines = [
        _record("q", "shuffle", 2 * 100),  # 0.4 tokens per character: kept
        _record("q", "moi", 2 * 250),  # 1.0: dropped
        _record("q", "retriever", None),  # no generator prompt: kept (the merge decides)
    ]
    (run / "cache.jsonl").write_text("\n".join(lines) + "\n")
    dropped = purge.purge(run, chars, 0.6)
    assert dict(dropped) == {"q": 1}
    kept = [json.loads(line)["key"]["variant"] for line in (run / "cache.jsonl").open()]
    assert kept == ["shuffle", "retriever"]


@pytest.fixture(scope="module")
def dev_chars(purge: ModuleType) -> dict[tuple[str, int], int]:
    chars: dict[tuple[str, int], int] = purge.prompt_chars(DATA)
    return chars


@pytest.mark.parametrize("folder", COMMITTED)
def test_no_committed_record_was_computed_with_a_broken_tokenizer(
    purge: ModuleType, dev_chars: dict[tuple[str, int], int], folder: str
) -> None:
    # The 2026-11-25 H100 records of Gemma-3 took 0.9-1.2 tokens per character (transformers
    # 5.17's tokenizer); every right one takes 0.2-0.4. None may come back into the evidence.
    worst = max(
        (purge.tokens_per_char(json.loads(line), dev_chars) or 0.0)
        for line in committed_lines(folder)
    )
    assert 0.1 < worst <= 0.6, f"{folder}: a record takes {worst:.2f} tokens per character"
