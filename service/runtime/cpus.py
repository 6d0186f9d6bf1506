"""The CPUs this process may use, and the threads and processes sized from them (issue 70).

``os.cpu_count()`` is the host's count: in a pod with a 2-CPU limit on a 64-core node it is 64,
and a service that sizes torch's threads and its solver pool from it runs 64 intra-op threads
and 8 fit workers on two CPUs' worth of quota, each forward then waiting on the others and
on the throttled quota. What the process may really use is the smallest of:

- its **affinity mask** (``taskset``, a cpuset cgroup, Kubernetes' static CPU manager):
  ``os.sched_getaffinity(0)``;
- its **cgroup CPU quota**: cgroup v2 ``cpu.max`` (``"200000 100000"``: 2 CPUs; ``"max ..."``:
  none), or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (``-1``: none), rounded up (1.5
  CPUs of quota still runs two threads, each part of the time);
- the operator's ``cpus`` setting, when set (it wins: the probe can be wrong in a sandbox).

From that count: torch's intra-op threads and the solver pool's workers each take the CPUs
but one, at least one, so the event loop (HTTP, tokenising, the scheduler) keeps a core of its
own; on one CPU everything shares it. Measured on this 2-core machine (docs/operations.md,
"CPUs"): a SmolLM2 forward beside one busy process took 5.0 s on torch's default 2 threads and
2.9 s on 1.

Pure reading of ``/proc`` and ``/sys``; the paths are parameters so tests give their own files.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

CpuSource = Literal["setting", "cgroup", "affinity", "host"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_SOLVER_PROCESSES = 8
"""More fit workers than this only add memory (a fit is milliseconds; issue 57)."""


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs the process may use, where the figure came from, and what is sized from it."""

    cpus: int
    """Whole CPUs the process may keep busy (at least 1)."""
    source: CpuSource
    """What bounded it: the ``cpus`` setting, the cgroup quota, the affinity mask, or the
    host's count when neither bounds it."""
    host_cpus: int
    """``os.cpu_count()``: what a process that ignores its limits would size itself to."""
    affinity: int | None
    """CPUs in the affinity mask (``None``: not available on this platform)."""
    quota: float | None
    """CPUs of cgroup quota (``None``: no quota)."""

    @property
    def torch_threads(self) -> int:
        """torch's intra-op threads: every CPU but the event loop's, at least one."""
        return max(1, self.cpus - 1)

    @property
    def solver_processes(self) -> int:
        """The solver pool's default workers: every CPU but the event loop's, 1 to 8."""
        return min(MAX_SOLVER_PROCESSES, max(1, self.cpus - 1))

    def pool_size(self, setting: int | None = None) -> int:
        """The solver pool's workers: the ``solver_processes`` setting when set, else
        ``solver_processes``."""
        return self.solver_processes if setting is None else setting

    def describe(self, solver_processes: int | None = None) -> dict[str, object]:
        """The figures for ``/info`` and the start-up log, with the pool as
        ``solver_processes`` (the setting) sizes it."""
        return {
            "cpus": self.cpus,
            "source": self.source,
            "host_cpus": self.host_cpus,
            "affinity": self.affinity,
            "quota": self.quota,
            "torch_threads": self.torch_threads,
            "solver_processes": self.pool_size(solver_processes),
        }


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs of the cgroup quota of this process (``None``: no quota, or no cgroup to read).

    Reads the process's own cgroup (``/proc/self/cgroup``) under ``root`` when it can, else
    ``root`` itself (a container sees its own cgroup mounted there).
    """
    for folder in _cgroup_folders(root):
        v2 = folder / "cpu.max"
        if v2.is_file():
            return _parse_v2(_read(v2))
        quota, period = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
        if quota.is_file() and period.is_file():
            return _parse_v1(_read(quota), _read(period))
    return None


def _cgroup_folders(root: Path) -> list[Path]:
    """Where this process's CPU controller may be: its own cgroup's folder (v2 unified path,
    or v1's ``cpu`` hierarchy), then the mount's root."""
    folders: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            folders.append(root / rel)
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                folders.append(root / mount / rel)
    folders.append(root)
    for mount in ("cpu", "cpu,cpuacct"):
        folders.append(root / mount)
    return folders


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _parse_v2(text: str) -> float | None:
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _parse_v1(quota_text: str, period_text: str) -> float | None:
    try:
        quota, period = float(quota_text), float(period_text)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def affinity_cpus() -> int | None:
    """CPUs in this process's affinity mask (``None`` where the platform has none)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return len(getaffinity(0))
    except OSError:
        return None


@lru_cache(maxsize=8)
def process_budget(setting: float | None = None) -> CpuBudget:
    """``cpu_budget`` of this process, probed once per ``cpus`` setting: the solver pool asks
    its size at every fit, and the probe reads files. A limit changed under a running
    process is not followed (a resized pod restarts its containers by default)."""
    return cpu_budget(setting)


def cpu_budget(setting: float | None = None, *, root: Path = CGROUP_ROOT) -> CpuBudget:
    """The CPUs this process may use (module docstring).

    Args:
        setting: the operator's ``cpus`` setting (``None``: probe).
        root: the cgroup mount (tests pass a folder of their own).

    Returns:
        The budget, with where it came from.
    """
    host = os.cpu_count() or 1
    affinity = affinity_cpus()
    quota = cgroup_quota(root)
    if setting is not None:
        return CpuBudget(max(1, math.ceil(setting)), "setting", host, affinity, quota)
    count: int = host
    source: CpuSource = "host"
    if affinity is not None and affinity < count:
        count, source = affinity, "affinity"
    if quota is not None and math.ceil(quota) < count:
        count, source = max(1, math.ceil(quota)), "cgroup"
    return CpuBudget(count, source, host, affinity, quota)
