"""What the benchmarks that drive a real server process share: a free loopback port, starting
``python -m app serve`` and waiting for ``/ready``, and the latency percentile they report."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> list[Any]:
    """``psutil`` processes: ``pid`` and all its descendants (a server's solver workers, a
    vLLM server's engine core)."""
    import psutil  # vLLM's and the dev environment's; imported only where a bench measures CPU

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_s(processes: Sequence[Any]) -> float:
    """User + system CPU seconds of ``processes`` (a process gone since is left out)."""
    import psutil

    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (with a handful of samples p99 is the maximum)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def child_env(root: Path, env: dict[str, str]) -> dict[str, str]:
    """The server's environment: this one's, then ``env``, with ``root`` first on PYTHONPATH.

    Entries already on PYTHONPATH are kept after ``root``: on the lent GPU machine the
    service's own packages live there (eval/device/env.sh puts /tmp/site on it), and a server
    started with ``PYTHONPATH=root`` alone died on ``import pydantic`` (2026-11-27, H200).
    """
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(root), *inherited])}


def start_server(
    root: Path, port: int, env: dict[str, str], log: Path, *, ready_s: float
) -> subprocess.Popen[bytes]:
    """``python -m app serve`` on ``port`` with the code under ``root`` (its stdout and stderr
    into ``log``), returned once ``/ready`` answers 200.

    Raises:
        SystemExit: the server exited, or was not ready within ``ready_s`` (then killed).
    """
    cmd = [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=child_env(root, env),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    wait_until_up(proc, f"http://127.0.0.1:{port}/ready", log, ready_s=ready_s)
    return proc


def wait_until_up(
    proc: subprocess.Popen[bytes], url: str, log: Path, *, ready_s: float, poll_s: float = 0.2
) -> None:
    """Return once ``url`` answers 200 (a server process's readiness route).

    Raises:
        SystemExit: the process exited, or ``url`` did not answer 200 within ``ready_s`` (the
            process is then killed).
    """
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    proc.kill()
    raise SystemExit(f"server not ready in {ready_s:.0f} s; see {log}")
