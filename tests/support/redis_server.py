"""A real ``redis-server`` process for the state-store tests: started on a free loopback port,
killed and restarted on that port to test faults.

A machine without ``redis-server`` fails these tests (a skipped check is a defect): the
project's setup installs it (``scripts/redis-server.sh``, run by ``make test``).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.app.processes import free_port

INSTALL = (
    "redis-server is not installed: run scripts/redis-server.sh (apt-get install redis-server)"
)


class RedisServer:
    """One ``redis-server`` with a password, no persistence (a restart comes back empty).

    Args:
        workdir: its working folder (log file).
        password: ``requirepass``.
    """

    def __init__(self, workdir: Path, password: str = "test-secret") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError(INSTALL)
        self.binary = binary
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL without the password (the tests pass it as ``state_password``)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--requirepass", self.password, "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                client.close()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.workdir / "redis.log"
                    raise AssertionError(
                        f"redis-server did not start: {log.read_text() if log.exists() else ''}"
                    ) from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a node lost or an OOM kill does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
