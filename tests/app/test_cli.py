"""The one-shot command on the real embedded SmolLM2 model, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.short_data import short_dev_set

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "nq_open_dev.jsonl"


def _run(args: list[str], tmp_path: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles"),
        **{f"RAG_REORDER_{k.upper()}": v for k, v in settings.items()},
    }
    return subprocess.run(
        [sys.executable, "-m", "entrypoints", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
def test_reorder_calibrate_and_cyclic_on_smollm2(tmp_path: Path, smollm2_dir: Path) -> None:
    del smollm2_dir  # converted once by the fixture, so the command only loads it
    passages = tmp_path / "p.json"
    passages.write_text(
        json.dumps(
            [
                {"title": "Narnia", "text": "C. S. Lewis wrote the Chronicles of Narnia."},
                {"id": "lotr", "text": "The Lord of the Rings is a novel by J. R. R. Tolkien."},
                "Mount Everest is the highest mountain on Earth.",
                "The Hobbit was published in 1937.",
            ]
        )
    )
    q = "who wrote the lord of the rings"
    out = _run(["reorder", "--query", q, "--passages", str(passages)], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert sorted(res["order"]) == [0, 1, 2, 3]
    assert res["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # The default strategy, auto, learns from MoI's pruned random design.
    assert res["diagnostics"]["design"] == "pruned_random" and res["diagnostics"]["converged"]
    assert res["usage"]["prompts_scored"] == 8 and res["usage"]["scored_tokens"] > 0
    assert res["order"][0] == 1  # the passage that answers the question leads
    assert abs(sum(res["position_bias"]["coefficients"]) - 1.0) < 1e-9

    # Cyclic needs a calibrated profile: refused with exit 2 and a JSON error.
    cyc = ["reorder", "--query", q, "--passages", str(passages), "--design", "pruned_cyclic"]
    refused = _run([*cyc, "--prompt-passages", "2"], tmp_path)
    assert refused.returncode == 2
    assert json.loads(refused.stderr.strip().splitlines()[-1])["error"]["type"] == (
        "unidentifiable_design"
    )
    # Calibrate a 2-slot profile from real NQ queries (their passages cut to 12 words: the
    # same prompts planned, each scored, a fraction of the tokens), then the same request is
    # served.
    cal = _run(
        [
            "calibrate",
            "--data",
            str(short_dev_set(tmp_path / "nq_open_dev.jsonl", 3, source=DATA)),
            "--limit",
            "3",
            "--max-passages",
            "4",
            "--design",
            "pruned_random",
            "--prompt-passages",
            "2",
        ],
        tmp_path,
    )
    assert cal.returncode == 0, cal.stderr[-2000:]
    prof = json.loads(cal.stdout)
    assert prof["slots"] == 2 and prof["runs"] == 3 and prof["identification"] == "full"
    listed = json.loads(_run(["profiles"], tmp_path).stdout)
    assert [(p["slots"], p["oriented_by"]) for p in listed["bias"]] == [(2, "data")]
    assert listed["positional"] == []
    served = _run([*cyc, "--prompt-passages", "2"], tmp_path)
    assert served.returncode == 0, served.stderr[-2000:]
    body = json.loads(served.stdout)
    assert body["position_bias"]["orientation"] == "reference"
    assert body["position_bias"]["profile"] is not None


def test_bad_passages_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"title": "no text"}]')
    out = _run(["reorder", "--query", "q", "--passages", str(bad)], tmp_path)
    assert out.returncode == 2
    err = json.loads(out.stderr.strip().splitlines()[-1])["error"]
    assert "passages[0]" in err["message"] and err["param"] == "passages"


def test_reorder_takes_the_configured_default_strategy_and_its_placement(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    del smollm2_dir
    passages = tmp_path / "p.json"
    # BM25 for "real answer": 1 matches both terms, 2 one, 0 and 3 none (input order).
    passages.write_text(json.dumps(["nothing here", "a real answer", "an answer", "zilch"]))
    args = ["reorder", "--query", "real answer", "--passages", str(passages)]
    out = _run(args, tmp_path, strategy="bm25", placement="litm")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert (res["strategy"], res["ranking"], res["order"]) == ("bm25", [1, 2, 0, 3], [1, 0, 3, 2])
    assert res["diagnostics"]["placement"] == "litm"
    # Naming the strategy: its own order, the server's placement not applied.
    out = _run([*args, "--strategy", "bm25"], tmp_path, strategy="bm25", placement="litm")
    assert json.loads(out.stdout)["order"] == [1, 2, 0, 3]


# --- the command line explains itself ---------------------------------------------------


def _subcommands() -> dict[str, object]:
    import argparse

    from entrypoints.cli import _parser

    (action,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_has_an_example_that_parses() -> None:
    from entrypoints.cli import EXAMPLES, _parser

    commands = _subcommands()
    assert set(EXAMPLES) == set(commands)
    for name, parser in commands.items():
        assert "example:\n  rag-reorder " + name in parser.format_help()  # type: ignore[attr-defined]
        assert _parser().parse_args(EXAMPLES[name]).command == name
    assert "example:\n  rag-reorder serve" in _parser().format_help()


def test_eval_help_lists_the_names_the_server_accepts() -> None:
    from typing import get_args

    from service.strategies import strategy_names
    from service.strategies.request import DesignKind, Placement

    text = " ".join(_subcommands()["eval"].format_help().split())  # type: ignore[attr-defined]
    for name in (*strategy_names(), *get_args(DesignKind), *get_args(Placement)):
        assert name in text, name
    assert "--fresh" in text


def test_offline_commands_refuse_a_flag_below_its_bound_naming_it_and_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule for every offline command (offline/commands.py), before any model loads."""
    from entrypoints.cli import main

    out = ["--data", str(DATA), "--out", str(tmp_path / "o")]
    assert main(["eval", *out, "--limit", "0"]) == 2
    assert "--limit must be >= 1, got 0" in capsys.readouterr().err
    assert main(["distill", *out, "--student", "s", "--lora-r", "0"]) == 2
    assert "--lora-r must be >= 1, got 0" in capsys.readouterr().err
    assert main(["distill-eval", *out, "--student", "s", "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1, got 0" in capsys.readouterr().err


def test_an_engine_url_without_the_remote_backend_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Meant to score on the cluster; would have loaded a local model in a CPU pod instead.
    from entrypoints.cli import main

    monkeypatch.setenv("RAG_REORDER_ENGINE_URL", "http://vllm:8000")
    assert main(["--backend", "transformers", "profiles"]) == 2
    assert "RAG_REORDER_BACKEND=remote" in capsys.readouterr().err
    monkeypatch.setenv("RAG_REORDER_BACKEND", "auto")
    assert main(["profiles"]) == 2
    assert "is 'auto'" in capsys.readouterr().err


def test_a_default_strategy_the_registry_lacks_is_refused_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The settings cannot check the name (they sit below the registry): the command line does,
    # at exit 2 like any bad setting, not after a model load as the warm-up would.
    from entrypoints.cli import main

    monkeypatch.setenv("RAG_REORDER_STRATEGY", "nope")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "RAG_REORDER_STRATEGY 'nope' is not a strategy" in err
    assert "query_likelihood" in err


def test_profile_generator_refuses_bad_settings_before_any_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from entrypoints.cli import main

    base = ["profile-generator", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
    out = ["--data", str(DATA), "--out", str(tmp_path / "p")]
    assert main([*base, *out, "--slots", "1"]) == 2
    assert "--slots must be >= 2, got 1" in capsys.readouterr().err
    assert main([*base, *out, "--template", "nope"]) == 2
    assert "unknown prompt template 'nope'" in capsys.readouterr().err
    bad = tmp_path / "t.json"
    bad.write_text('{"name": "mine", "instruction": "x"}')
    assert main([*base, *out, "--template-file", str(bad)]) == 2
    assert "--template-file" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_eval_of_your_generator_checks_everything_before_any_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on these ports: every refusal below comes before a call, and the dry
    run estimates without one."""
    from entrypoints.cli import main

    api = ["--generator-url", "http://127.0.0.1:9/v1", "--reorder-url", "http://127.0.0.1:9"]
    out = ["--data", str(DATA), "--out", str(tmp_path / "e")]
    assert main(["eval", *out, *api]) == 2
    assert "needs both --generator-url and --generator-model" in capsys.readouterr().err
    named = [*api, "--generator-model", "m"]
    assert main(["eval", *out, *named, "--max-calls", "0"]) == 2
    assert "--max-calls must be >= 1, got 0" in capsys.readouterr().err
    assert main(["eval", *out, *named, "--generator", "google/gemma-3-270m"]) == 2
    assert "for the in-process evaluation" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "answers": ["a"], "passages": [{"text": 3}]}\n')
    assert main(["eval", "--data", str(bad), "--out", str(tmp_path / "b"), *named]) == 2
    assert "bad.jsonl:1: passages[0].text: expected a non-empty string, got 3" in (
        capsys.readouterr().err
    )
    assert main(["eval", *out, *named, "--limit", "3", "--dry-run", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "eval: 3 questions x 3 variants (default, retriever, shuffle)" in err
    assert "at most 9 generator calls" in err
    assert main(["convert-data", "--from", "litm", str(bad), str(tmp_path / "c.jsonl")]) == 2
    assert "bad.jsonl:1: ctxs: expected a non-empty list" in capsys.readouterr().err
