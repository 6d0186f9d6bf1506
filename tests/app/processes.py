"""Starting the real server as a subprocess on a free loopback port, and stopping it.

Standard library and httpx only: the client's tests load this file in their own virtualenv,
where the repository root is not on the path (``clients/python/tests/servers.py``). So the
one readiness wait and port picker, ``bench/server_process.py`` (also standard library and
httpx), is loaded here by its file rather than imported as ``bench.server_process``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _bench_server_process() -> ModuleType:
    name = "rag_reorder_bench_server_process"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "server_process.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_helpers = _bench_server_process()
free_port: Callable[[], int] = _helpers.free_port
wait_until_up: Callable[..., Any] = _helpers.wait_until_up

__all__ = ["QUIET", "ROOT", "ServerProcess", "free_port", "server_process"]

QUIET = {"RAG_REORDER_RATE_CANARY": "false"}
"""What every server started here runs with unless its test's ``env`` says otherwise (as
``settings_for`` does in-process): the rate canary measures a real engine before ``/ready``
(9-11 s a start on this CPU), which only the tests of admission and its rates need; those
pass ``RAG_REORDER_RATE_CANARY=true``."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        """Return once ``/ready`` answers 200; ``ServerNotUp`` (with the log's tail) if the
        server exits or is not ready in ``timeout`` seconds."""
        wait_until_up(
            self.proc, f"{self.base_url}/ready", self.log_path, ready_s=timeout, poll_s=0.1
        )

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

    ``args`` must contain ``{port}``, replaced by a free loopback port; ``env`` is added to
    this process's environment and ``QUIET``, and wins over both. ``python``: the
    interpreter (default: this one); the client's tests, which run where the server is not
    installed, pass the server's virtualenv's.
    """
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **QUIET, **(env or {})}
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
