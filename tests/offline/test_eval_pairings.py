"""``eval/pairings.py``: the README's table across scorer/generator pairings, from caches."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "pairings.py"


@pytest.fixture(scope="module")
def pairings() -> ModuleType:
    return load_script(SCRIPT, "eval_pairings")


def _rec(q: str, variant: str, acc: float, ll: float, status: str = "ok") -> str:
    key = {"question_id": q, "variant": variant, "scorer": "org/s", "generator": "org/g"}
    return json.dumps({"key": key, "status": status, "accuracy": acc, "gold_logprob_per_token": ll})


def test_pairs_only_questions_where_every_variant_finished(
    pairings: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        _rec("q1", "moi", 1.0, -1.0),
        _rec("q1", "shuffle", 0.0, -2.0),
        _rec("q2", "moi", 1.0, -1.5),
        _rec("q2", "shuffle", 1.0, -1.0),
        _rec("q3", "moi", 0.0, -3.0),  # shuffle never finished on q3: not paired
        _rec("q3", "shuffle", 0.0, -9.0, status="error"),
    ]
    (tmp_path / "cache.jsonl").write_text("\n".join(lines) + "\n")
    p = pairings.compare(tmp_path, "moi", ["shuffle"], resamples=200)
    assert p.questions == 2 and (p.scorer, p.generator) == ("org/s", "org/g")
    acc, ll = p.comparisons
    # Differences by hand: accuracy (1 - 0, 1 - 1) -> mean 0.5; LL (+1.0, -0.5) -> mean 0.25.
    assert (acc.metric, acc.mean_diff, acc.wins, acc.losses) == ("accuracy", 0.5, 1, 0)
    assert (ll.mean_diff, ll.wins, ll.losses) == (0.25, 1, 1)
    assert p.means["moi"] == {"accuracy": 1.0, "gold_logprob_per_token": -1.25}
    assert pairings.main([str(tmp_path), "--variant", "moi", "--baselines", "shuffle"]) == 0
    table = capsys.readouterr().out
    assert "| s → g | 2 | accuracy | 1.000 | +0.500 [" in table
    # A baseline the run never had is "not run"; the others are still paired.
    p = pairings.compare(tmp_path, "moi", ["inverse", "shuffle"], resamples=200)
    assert p.questions == 2 and {c.baseline for c in p.comparisons} == {"shuffle"}
    table = pairings.markdown([p], "moi", ["inverse", "shuffle"])
    assert "| s → g | 2 | accuracy | 1.000 | not run | +0.500 [" in table
    with pytest.raises(SystemExit, match="no question has lore finished"):
        pairings.compare(tmp_path, "lore", ["moi"], resamples=200)
