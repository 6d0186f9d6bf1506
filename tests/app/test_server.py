"""The real server process (uvicorn) on the fake backend: drain on SIGTERM, exit codes, and a
client that really closes its socket."""

from __future__ import annotations

import json
import signal
import socket
import time
from contextlib import AbstractContextManager
from pathlib import Path

import anyio
import httpx
import pytest

from tests.app.conftest import PASSAGES, QUERY
from tests.app.processes import ServerProcess, server_process

pytestmark = pytest.mark.timeout(60)


def fake_server(tmp_path: Path, *extra: str) -> AbstractContextManager[ServerProcess]:
    return server_process(
        ["-m", "tests.app.fake_server", "--port", "{port}", *extra], tmp_path / "server.log"
    )


def metric(server: ServerProcess, line_start: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path: Path) -> None:
    with fake_server(tmp_path, "--delay", "1.5", "--drain-timeout", "20") as server:
        server.wait_ready(30)
        body = {"query": QUERY, "passages": PASSAGES}
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

            async def slow(i: int) -> None:
                r = await client.post(
                    "/v1/reorder", json=body, headers={"X-Request-Id": f"slow-{i}"}
                )
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(slow, i)
                with anyio.fail_after(10):
                    while metric(server, "rag_reorder_requests_in_flight") < 4:
                        await anyio.sleep(0.05)
                t_signal = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                await anyio.sleep(0.3)
                # Draining: not ready, and new work is refused with Retry-After.
                ready = await client.get("/ready")
                assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
                late = await client.post("/v1/rerank", json={"query": QUERY, "documents": PASSAGES})
                assert late.status_code == 503 and "retry-after" in late.headers
                assert (await client.get("/health")).status_code == 200
        assert statuses == [200, 200, 200, 200]  # none lost
        assert server.wait_exit(15) == 0
        assert time.monotonic() - t_signal < 10
        log = server.log()
        assert "draining 4 request(s)" in log and "backend closed" in log


async def test_engine_death_exits_non_zero(tmp_path: Path) -> None:
    with fake_server(tmp_path, "--die-after-ready") as server:
        server.wait_ready(30)
        # The canary (every 0.2 s here) finds the engine dead; the watchdog stops the process.
        code = server.wait_exit(20)
        assert code == 1, server.log()
        assert "fatal" in server.log()


async def test_closing_the_socket_cancels_the_request(tmp_path: Path) -> None:
    with fake_server(tmp_path) as server:
        server.wait_ready(30)
        host, port = server.base_url.removeprefix("http://").split(":")
        body = json.dumps({"query": "q?", "passages": PASSAGES[:2]}).encode()
        head = (
            "POST /v1/reorder HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: hang-1\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 10
            while metric(server, "rag_reorder_requests_in_flight") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        # Socket closed: the scoring call is cancelled and nothing stays in flight.
        deadline = time.monotonic() + 10
        failures = 'rag_reorder_request_failures_total{code="client_disconnected"'
        while metric(server, failures) < 1:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        assert metric(server, "rag_reorder_requests_in_flight") == 0
        assert metric(server, "rag_reorder_inflight_prompt_tokens") == 0
        assert "client disconnected" in server.log()
