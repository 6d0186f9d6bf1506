"""The CPUs the process may use (``service.runtime.cpus``): cgroup v2 and v1 quotas read from files,
the affinity mask, the setting, and what is sized from them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.runtime.cpus import CpuBudget, cgroup_quota, cpu_budget
from service.runtime.solver_pool import default_workers


def _v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text + "\n")
    return root


def _v1(root: Path, quota: str, period: str = "100000") -> Path:
    folder = root / "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (folder / "cpu.cfs_period_us").write_text(period + "\n")
    return root


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    assert cgroup_quota(_v2(tmp_path / "a", "150000 100000")) == pytest.approx(1.5)
    assert cgroup_quota(_v2(tmp_path / "b", "max 100000")) is None
    assert cgroup_quota(_v2(tmp_path / "c", "garbage")) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    assert cgroup_quota(_v1(tmp_path / "a", "50000")) == pytest.approx(0.5)
    assert cgroup_quota(_v1(tmp_path / "b", "-1")) is None  # v1's "no quota"


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path) is None


def test_a_quota_below_the_cpus_in_the_mask_bounds_the_process(tmp_path: Path) -> None:
    # Half a CPU of quota: one thread (rounded up), whatever the mask holds.
    budget = cpu_budget(root=_v1(tmp_path, "50000"))
    assert budget.cpus == 1 and budget.quota == pytest.approx(0.5)
    if (os.cpu_count() or 1) > 1:
        assert budget.source == "cgroup"
    assert budget.torch_threads == 1 and budget.solver_processes == 1


def test_the_affinity_mask_is_read(tmp_path: Path) -> None:
    budget = cpu_budget(root=tmp_path)
    mask = len(os.sched_getaffinity(0))
    assert budget.affinity == mask and budget.cpus == min(mask, os.cpu_count() or 1)


def test_the_setting_wins_and_sizes_threads_and_the_pool(tmp_path: Path) -> None:
    budget = cpu_budget(6.0, root=_v1(tmp_path, "50000"))
    assert budget.source == "setting" and budget.cpus == 6
    # Every CPU but the event loop's: 5 threads, 5 fit workers.
    assert budget.torch_threads == 5 and budget.solver_processes == 5
    assert cpu_budget(2.5, root=tmp_path).cpus == 3  # a fraction of a CPU still runs a thread
    assert default_workers(40.0) == 8  # more workers than 8 only add memory


def test_the_figures_in_info_name_their_source() -> None:
    budget = CpuBudget(cpus=2, source="cgroup", host_cpus=64, affinity=64, quota=2.0)
    assert budget.describe() == {
        "cpus": 2,
        "source": "cgroup",
        "host_cpus": 64,
        "affinity": 64,
        "quota": 2.0,
        "torch_threads": 1,
        "solver_processes": 1,
    }
