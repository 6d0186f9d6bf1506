"""What the benchmarks that drive a real server process share: a free loopback port, starting
``python -m entrypoints serve`` and waiting for ``/ready``, and the latency percentile they report.

``free_port`` and ``wait_until_up`` are also the tests' (``tests/app/processes.py``, the vLLM
server fixture in ``tests/conftest.py``): one way to wait for a server process.
"""

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


def _schedstat_s(processes: Sequence[Any], field: int) -> float:
    """One field of Linux's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds), summed over
    every thread of ``processes``, in seconds. Threads gone since are left out; 0 where there
    is no schedstat."""
    total = 0
    for proc in processes:
        tasks = Path(f"/proc/{proc.pid}/task")
        try:
            tids = list(tasks.iterdir())
        except OSError:
            continue
        for tid in tids:
            try:
                total += int((tid / "schedstat").read_text().split()[field])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def thread_cpu_s(processes: Sequence[Any]) -> float:
    """CPU seconds of every thread of ``processes``, to the nanosecond (schedstat's first
    field), where ``cpu_s`` counts 10 ms clock ticks: for a call of tens of milliseconds."""
    return _schedstat_s(processes, 0)


def run_delay_s(processes: Sequence[Any]) -> float:
    """Seconds the threads of ``processes`` spent runnable but waiting for a CPU (schedstat's
    second field): on a shared machine, how long the scheduler kept them off a core."""
    return _schedstat_s(processes, 1)


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (with a handful of samples p99 is the maximum)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def child_env(root: Path, env: dict[str, str]) -> dict[str, str]:
    """The server's environment: this one's, then ``env``, with ``root`` first on PYTHONPATH.

    Entries already on PYTHONPATH are kept after ``root``: on the lent GPU machine the
    service's own packages live there (scripts/device/env.sh puts /tmp/site on it), and a server
    started with ``PYTHONPATH=root`` alone died on ``import pydantic`` (2026-11-27, H200).
    """
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(root), *inherited])}


def start_server(
    root: Path, port: int, env: dict[str, str], log: Path, *, ready_s: float
) -> subprocess.Popen[bytes]:
    """``python -m entrypoints serve`` (``python -m app serve`` in a checkout from before
    issue 91) on ``port`` with the code under ``root`` (its stdout and stderr
    into ``log``), returned once ``/ready`` answers 200.

    Raises:
        ServerNotUp: the server exited, or was not ready within ``ready_s`` (then killed).
    """
    ways_in = "entrypoints" if (root / "entrypoints" / "__main__.py").exists() else "app"
    cmd = [sys.executable, "-m", ways_in, "serve", "--host", "127.0.0.1", "--port", str(port)]
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


class ServerNotUp(RuntimeError):
    """A server process exited, or did not answer its readiness URL in time (it was killed);
    the message ends with its log's tail."""


def wait_until_up(
    proc: subprocess.Popen[bytes], url: str, log: Path, *, ready_s: float, poll_s: float = 0.2
) -> None:
    """Return once ``url`` answers 200 (a server process's readiness route: ``/ready``, or
    vLLM's ``/v1/models``).

    Raises:
        ServerNotUp: the process exited, or ``url`` did not answer 200 within ``ready_s`` (the
            process is then killed).
    """
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerNotUp(f"server exited with {proc.returncode}; {_tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    proc.kill()
    raise ServerNotUp(f"{url} not 200 within {ready_s:g} s; {_tail(log)}")


def _tail(log: Path, chars: int = 4000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return f"no log at {log}"
    return f"its log ({log}) ends:\n{text[-chars:]}"
