"""MoI's fits in worker processes: the same answer as in a thread, and a dead worker costs no
request."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import numpy as np

import solver
from service.config.settings import Settings
from service.runtime.solver_pool import SolverPool, default_workers, shared_pool


def die_in_a_worker() -> str:
    """Kills the worker process it runs in; in the server's own thread it answers."""
    if multiprocessing.parent_process() is not None:
        os._exit(1)
    return "thread"


def test_a_fit_in_a_worker_is_the_fit_in_this_process() -> None:
    perms = solver.plan("pruned_random", 6, seed=3)
    rng = np.random.default_rng(0)
    truth_u = rng.normal(size=6)
    bias = np.linspace(1.0, 0.2, perms.shape[1])
    scores = np.array([sum(bias[j] * truth_u[p] for j, p in enumerate(row)) for row in perms])
    scores = scores + rng.normal(scale=0.05, size=scores.shape)
    here = solver.fit(perms, scores, n_passages=6)
    pool = SolverPool(1)
    try:
        there = asyncio.run(pool.run(solver.fit, perms, scores, n_passages=6))
    finally:
        pool.close()
    assert there.order == here.order
    np.testing.assert_allclose(there.utilities, here.utilities, rtol=0, atol=1e-12)
    np.testing.assert_allclose(there.position_bias, here.position_bias, rtol=0, atol=1e-12)


def test_a_dead_worker_falls_back_to_a_thread_and_the_next_call_gets_a_new_pool() -> None:
    pool = SolverPool(1)
    try:
        assert asyncio.run(pool.run(die_in_a_worker)) == "thread"
        assert pool.restarts == 1
        assert asyncio.run(pool.run(os.getpid)) != os.getpid()  # a worker again
    finally:
        pool.close()


def test_settings_choose_the_pool() -> None:
    assert shared_pool(0) is None
    assert shared_pool(None) is shared_pool(default_workers())
    assert 1 <= default_workers() <= 8
    assert Settings().solver_processes is None
