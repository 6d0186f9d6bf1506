"""Starting the real server as a subprocess on a free loopback port, and stopping it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/ready not 200 within {timeout} s:\n{self.log()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout} s:\n{self.log()}") from None


@contextmanager
def server_process(
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> Iterator[ServerProcess]:
    """Run ``python <args>`` from the repository root; killed on exit if still running.

    ``args`` must contain ``{port}``, replaced by a free loopback port. ``python``: the
    interpreter (default: this one); the client's tests, which run where the server is not
    installed, pass the server's virtualenv's.
    """
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [python or sys.executable, *(a.replace("{port}", str(port)) for a in args)],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
