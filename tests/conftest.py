"""Session fixtures: real model folders built once per run (SmolLM2 once per machine), and
vLLM's OpenAI server on the embedded SmolLM2, started once per session (eager: ~40 s on the CPU) for
every module that talks to a real server (tests/service, tests/offline)."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests never reach the network; a missing file must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One BLAS thread, as `rag-reorder` itself runs (entrypoints/cli.py), set before numpy loads: with
# OpenBLAS's default of one thread a core, every small pinv/lstsq of a trust assessment waits
# for a second thread the OS has given to a neighbour. Beside two busy processes the learning
# tests ran for over 16 minutes against 10 s quiet (2026-11-29, docs/development.md, Tests).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench.server_process import wait_until_up
from service.config.settings import EMBEDDED_MODEL
from tests.app.processes import ROOT, free_port
from tests.support.models import build_tiny_llama, embedded_model_dir

# A test that takes one of these builds or loads a real model or starts a server: it is `slow`
# whether or not its module says so, and `make check` (-m "not slow") leaves it to `make test`.
_REAL_MODEL_FIXTURES = frozenset({"smollm2_dir", "tiny_model_dir", "vllm_server"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests that take a real model's fixture `slow` (tried first: before ``-m``)."""
    for item in items:
        if _REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@functools.cache
def _uses_vllm_server(module: str) -> bool:
    path = ROOT / module
    return path.suffix == ".py" and "vllm_server" in path.read_text(encoding="utf-8")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n 2 --dist loadfile`` (`make test`'s main suite): each module whole on one worker, so
    its module-scoped servers and models start once, as in a serial run; and the modules that
    take the session's vLLM server (~40 s to start eager, ~1 GB) on one worker together, so it
    starts once, not once per worker. xdist's own ``loadgroup`` would do this from marks, but
    with pytest 9 it ignores them (it renames ``item._nodeid``, which pytest no longer reads).
    Optional: without xdist (``.venv-vllm``) the hook is unknown and never called."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        _heaviest_first = False

        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "vllm_server" if _uses_vllm_server(module) else module

        def _assign_work_unit(self, node: Any) -> None:
            # xdist hands out modules most tests first, each to the next idle worker: the few
            # costly modules of few tests came last, and one worker ran on alone for them.
            # Heaviest first, the rest then evens the two workers out.
            if not self._heaviest_first:
                queue = sorted(self.workqueue.items(), key=lambda kv: -_WEIGHT.get(kv[0], 0.0))
                self.workqueue.clear()
                self.workqueue.update(queue)
                self._heaviest_first = True
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


# `make check`'s costliest modules, CPU-seconds on one worker (2026-12-07, after the stacked
# trust fit; docs/development.md, Tests): scheduled first, heaviest first. Only an order: a
# module missing here or grown since still runs, later.
_WEIGHT = {
    "tests/service/test_embedding.py": 15.0,
    "tests/solver/test_trust.py": 15.0,
    "tests/solver/test_fit.py": 9.0,
    "tests/service/test_background.py": 7.5,
    "tests/service/test_calibration.py": 7.5,
    "tests/solver/test_blind_profile.py": 4.5,
    "tests/service/test_generator_online.py": 4.0,
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct (cached under ~/.cache/rag-reorder)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


@pytest.fixture(scope="session")
def vllm_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no vLLM in {VLLM_VENV}: run scripts/vllm-venv.sh (`make test` builds it)",
            pytrace=False,
        )
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    env.pop("PYTHONPATH", None)
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(smollm2_dir),
        "--served-model-name",
        EMBEDDED_MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        # Eager, as the in-process engine on a CPU (service/backends/engines/vllm_engine.py):
        # without it the server compiles its model (torch.compile) before it answers, 126 s of one
        # start on these 2 cores (2026-11-28, the GPU script's CPU check).
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, f"{url}/v1/models", log_path, ready_s=900, poll_s=1)
        assert "enforce_eager=True" in log_path.read_text(errors="replace"), "compiled at start"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
