"""``RAG_REORDER_WORKERS=2``: two HTTP workers and one engine process, as real processes.

One server for the module (the paced engine on SmolLM2's tokenizer: no weights to load);
the tests run in file order, the last one stops it: requests served by both workers with
one set of counters, a worker's crash, the engine process's crash, SIGTERM under load.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.app.processes import ServerProcess, server_process

pytestmark = pytest.mark.slow

PASSAGES = [f"Passage {i} says something about topic {i % 3} and more words." for i in range(10)]
BODY = {"query": "which passage is about topic two?", "passages": PASSAGES}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("workers")
    env = {
        "RAG_REORDER_BACKEND": "paced",
        "RAG_REORDER_MODEL": str(smollm2_dir),
        "RAG_REORDER_WORKERS": "2",
        "RAG_REORDER_SOLVER_PROCESSES": "0",
        "RAG_REORDER_CACHE_DIR": str(folder),
        "RAG_REORDER_CANARY_INTERVAL_S": "0",
        "RAG_REORDER_DRAIN_TIMEOUT_S": "20",
    }
    with server_process(["-m", "app", "serve", "--port", "{port}"], folder / "log", env) as s:
        s.wait_ready(120)
        # /ready answers once one worker serves; on a busy machine the other was still
        # importing after 24 requests (.ci/run of 0e1492c), and the first took them all.
        wait_for(lambda: len(started(s)) == 2, 120, "both workers' servers started")
        yield s


def started(server: ServerProcess) -> set[str]:
    """The pids of the workers whose HTTP server has started (uvicorn's log line)."""
    return {line.split("[")[1].split("]")[0] for line in server.log().splitlines()
            if "Started server process" in line}  # fmt: skip


def children(server: ServerProcess, role: str) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children() if role in p.cmdline()]


def reorder(server: ServerProcess, **extra: str) -> int:
    try:
        body = {**BODY, **extra}
        return httpx.post(f"{server.base_url}/v1/reorder", json=body, timeout=30).status_code
    except httpx.TransportError as exc:
        return -len(type(exc).__name__)  # a refused or reset connection, never a status


def counter(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s: {what}")
        time.sleep(0.2)


def ready(server: ServerProcess) -> int:
    return httpx.get(f"{server.base_url}/ready", timeout=5).status_code


def test_both_workers_serve_one_port_and_every_scrape_sums_their_counters(
    server: ServerProcess,
) -> None:
    assert len(children(server, "worker")) == 2 and len(children(server, "engine")) == 1
    before = counter(server, "rag_reorder_prompt_tokens_total")
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: reorder(server), range(24)))
    assert codes == [200] * 24
    assert len(started(server)) == 2
    # Whichever worker answers the scrape, the sum is the same: both workers' tokens.
    sums = {counter(server, "rag_reorder_prompt_tokens_total") - before for _ in range(6)}
    assert len(sums) == 1 and sums.pop() > 0
    # The engine process's forwards are in the same scrape.
    assert counter(server, "rag_reorder_batch_fill_ratio_count") > 0


def test_a_killed_worker_is_restarted_and_the_other_serves_meanwhile(server: ServerProcess) -> None:
    victim = children(server, "worker")[0]
    victim.kill()
    victim.wait(10)
    assert [reorder(server) for _ in range(6)] == [200] * 6
    wait_for(lambda: len(children(server, "worker")) == 2, 30, "a new worker")
    assert victim.pid not in {p.pid for p in children(server, "worker")}
    assert "exited with -9; restarting it" in server.log()


def test_the_engine_process_dying_turns_ready_503_until_its_restart_is_reached(
    server: ServerProcess,
) -> None:
    # Both workers ready first (the one restarted above may still be warming up).
    wait_for(lambda: all(ready(server) == 200 for _ in range(6)), 60, "both workers ready")
    engine = children(server, "engine")[0]
    engine.kill()
    engine.wait(10)
    assert reorder(server) == 503
    wait_for(lambda: ready(server) == 503, 10, "/ready 503")
    wait_for(lambda: all(ready(server) == 200 for _ in range(6)), 60, "/ready 200 again")
    assert [reorder(server) for _ in range(4)] == [200] * 4
    assert engine.pid not in {p.pid for p in children(server, "engine")}


def test_sigterm_drains_every_worker_then_exits_0(server: ServerProcess) -> None:
    processes = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children()]
    results: list[tuple[float, int]] = []
    signalled: list[float] = []

    def client() -> None:
        # Requests back to back until the server turns it away. MoI's, which score 20 prompts
        # (about 0.1 s each here): by now auto places by a trusted profile in a few
        # milliseconds, and with nothing in flight at the signal there is no drain to check.
        for _ in range(200):
            code = reorder(server, strategy="moi")
            results.append((time.monotonic(), code))
            if code != 200:
                return

    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(client) for _ in range(8)]
        wait_for(lambda: len(results) >= 16, 60, "requests flowing")
        signalled.append(time.monotonic())
        server.proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.result()
    assert server.wait_exit(60) == 0
    # In flight at the signal: answered (200). After it: 503 while draining, or refused once
    # the port is closed; never a reset connection or another error.
    codes = {code for _, code in results}
    assert codes <= {200, 503, -len("ConnectError")}, codes
    # Should it fail: what the clients saw from 1 s before the signal on, and the server's
    # last log lines.
    near = [(round(t - signalled[0], 3), code) for t, code in results if t > signalled[0] - 1]
    drained = any(code == 200 and t > signalled[0] for t, code in results)
    assert drained, (near, server.log()[-3000:])
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
