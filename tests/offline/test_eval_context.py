"""``eval/context.py`` (issue 93's evidence): the stored fit another generator's pass reads
gives the very windows the live fit gives, and the report pairs every context with ``all``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import solver
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.context.window import ContextOptions, DistractorOptions, build_window
from service.passage import Passage
from service.prompting.templates import get_template
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "context.py"


@pytest.fixture(scope="module")
def context() -> ModuleType:
    return load_script(SCRIPT, "eval_context")


def test_the_stored_fit_gives_the_live_fits_windows(context: ModuleType) -> None:
    rng = np.random.default_rng(0)
    n, slots = 10, 5
    utilities = np.array([2.0, 0.5, 0.5, 0.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5])
    bias = np.array([0.3, 0.2, 0.2, 0.15, 0.15])
    perms = np.array([rng.permutation(n)[:slots] for _ in range(40)])
    scores = (utilities[perms] * bias).sum(axis=1) + rng.normal(0, 0.01, len(perms))
    live = solver.fit(perms, scores, n_passages=n, variance="jackknife")
    ranking = list(live.order)
    # The record goes through JSON, as the pass that reads it does.
    stored = context.stored_fit(json.loads(json.dumps({"fit": context.fit_record(ranking, live)})))
    passages = [Passage(f"passage {i} " + "word " * (3 + i), f"T{i}") for i in range(n)]
    placed = solver.place_ranking(ranking, "bias_matched", bias[::-1])
    options = [
        ContextOptions(distractors=DistractorOptions()),
        ContextOptions(distractors=DistractorOptions(rule="credibly_above")),
        ContextOptions(max_context_tokens=200),
    ]
    windows = []
    for fit in (live, stored):
        windows.append(
            [
                build_window(
                    order=placed,
                    ranking=ranking,
                    fit=fit,
                    passages=passages,
                    options=o,
                    tokenizer=ByteTokenizer(),
                    tokenizer_name="bytes",
                    tokenizer_is_generator=True,
                    template=get_template("qa_default"),
                )
                for o in options
            ]
        )
    assert [w.order for w in windows[0]] == [w.order for w in windows[1]]
    assert [w.dropped for w in windows[0]] == [w.dropped for w in windows[1]]
    # The rules did drop something here, so the comparison is not between two full contexts.
    assert all(len(w.order) < n for w in windows[0])


def test_the_report_pairs_each_context_with_all(
    context: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def variant(acc: float, tokens: int) -> dict[str, float | int]:
        return {
            "accuracy": acc,
            "em": acc,
            "f1": acc,
            "prompt_tokens": tokens,
            "documents_tokens": tokens - 50,
            "gold_kept": 1,
        }

    recs = [
        {
            "id": f"q{k}",
            "variants": {
                "all": variant(1.0 if k % 2 else 0.0, 1000),
                "top3": variant(0.0, 400),
                "top5": variant(0.0, 600),
                "budget@top3": variant(1.0 if k % 2 else 0.0, 380),  # all's answers, -62%
                "budget@top5": variant(1.0 if k % 3 else 0.0, 590),
            },
        }
        for k in range(10)
    ]
    monkeypatch.setattr(context, "OUT", tmp_path)
    (tmp_path / "nq_open_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = argparse.Namespace(set="nq_open_dev", generator=None, passages=10)
    table = context.report(args).splitlines()
    assert table[0].startswith("nq_open_dev: 10 questions")
    all_row = next(r for r in table if r.startswith("| all |"))
    top3 = next(r for r in table if r.startswith("| top3 |"))
    assert "| 0.500 |" in all_row and "+0.0%" in all_row
    assert "| 0.000 |" in top3 and "-60.0%" in top3 and "-0.500 [" in top3
    # The goal: >= 30% fewer tokens and the interval's lower bound >= -0.02.
    assert top3.endswith("| not shown: a loss beyond 0.02 |")
    assert next(r for r in table if r.startswith("| budget@top3 |")).endswith("| met |")
    # The budget rule against the retriever's top-K at (about) equal tokens.
    k3 = next(r for r in table if r.startswith("| 3 |"))
    assert "0.500 / 0.000" in k3 and "380 / 400" in k3 and "+0.500 [" in k3


def test_result_files_name_the_generator_and_any_passage_count_but_ten(
    context: ModuleType,
) -> None:
    def path(**kw: object) -> str:
        args = argparse.Namespace(**{"set": "nq_open_dev", "generator": None, "passages": 10, **kw})
        return context.out_path(args).name

    assert path() == "nq_open_dev.jsonl"  # the committed 10-passage runs keep their names
    assert path(passages=20) == "nq_open_dev__p20.jsonl"
    assert path(generator="google/gemma-3-270m") == "nq_open_dev__gemma-3-270m.jsonl"
    assert path(generator="google/gemma-3-270m", passages=20) == (
        "nq_open_dev__gemma-3-270m__p20.jsonl"
    )
    # The SmolLM2 run a generator's pass reads its fits from: the same passage count.
    args = argparse.Namespace(set="nq_open_dev", generator="google/gemma-3-270m", passages=20)
    assert context.out_path(args, scorer=True).name == "nq_open_dev__p20.jsonl"
    assert context._shard("1/2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        context._shard("2/2")
