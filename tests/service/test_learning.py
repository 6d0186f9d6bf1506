"""``service.learning.learner.ProfileLearner``: learning -> trusted -> explore -> drift, restarts,
the lock between replicas that share a folder, and what a read-only learner does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import solver
from service.backends.base import in_background
from service.config.settings import Settings
from service.learning.learner import Decision, LearnKey, ProfileLearner, allowed_to_learn
from service.state.profile_store import ProfileStore
from service.state.state_store import lock_name
from solver import trust as trust_rules
from tests.solver.conftest import bias_shape, synthesize
from tests.support import slow_fits

pytestmark = pytest.mark.anyio

MODEL, TEMPLATE, N = "m", "qa_default", 10
KEY = LearnKey(MODEL, TEMPLATE, 5)


def settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=tmp_path, auto_recalibrate_s=0, **kw)


def learner(tmp_path: Path, **kw: Any) -> ProfileLearner:
    s = settings(tmp_path, **kw)
    return ProfileLearner(s, ProfileStore(s.profiles_path))


def run(bias: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    perms = solver.plan("pruned_random", N, seed=0)
    return perms, synthesize(perms, rng.normal(size=N) * 2, bias, 0.1, rng)


async def feed(lr: ProfileLearner, d: Decision, k: int, bias: np.ndarray) -> None:
    rng = np.random.default_rng(k)
    for _ in range(k):
        assert lr.record(d, *run(bias, rng))
    await lr.cycle(KEY)


# Minutes of learning cycles on the CPU: `make test` runs it, not `make check`.
@pytest.mark.slow
async def test_learns_trusts_and_places(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_explore_rate=0.0)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    assert d.path == "moi" and d.key == KEY and "no runs" in d.reason
    await feed(lr, d, 4, bias_shape("recency", 5))
    d = lr.decide(MODEL, TEMPLATE, N, None)
    assert d.path == "moi" and "fewer than 5" in d.reason and d.learning_runs == 4
    await feed(lr, d, 2, bias_shape("recency", 5))
    d = lr.decide(MODEL, TEMPLATE, N, None)
    assert d.path == "profile" and d.profile is not None
    trust = d.profile.trust
    assert trust is not None and trust.verdict == "shaped" and trust.source == "traffic"
    assert trust.runs == 6 and trust.top_slots == (9, 8) and trust.trusted_since is not None
    assert lr.counters.recalibrations["trusted"] == 1
    # Stored where every replica and a restart find it, with the figures.
    again = learner(tmp_path, auto_explore_rate=0.0).decide(MODEL, TEMPLATE, N, None)
    assert again.path == "profile" and again.profile is not None
    assert again.profile.trust == trust
    lr.close()


# Minutes of learning cycles on the CPU: `make test` runs it, not `make check`.
@pytest.mark.slow
async def test_explore_runs_detect_drift_and_learning_starts_again(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_explore_rate=1.0)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    await feed(lr, d, 6, bias_shape("recency", 5))
    d = lr.decide(MODEL, TEMPLATE, N, None)
    assert d.path == "explore" and d.key == KEY
    await feed(lr, d, 4, bias_shape("recency", 5))  # agrees; too few to test anyway
    assert lr.counters.drift_events == 0
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "explore"
    await feed(lr, d, 10, bias_shape("primacy", 5))  # the generator changed
    assert lr.counters.drift_events == 1
    after = lr.decide(MODEL, TEMPLATE, N, None)
    assert after.path == "moi" and "drift" in after.reason
    stored = ProfileStore(settings(tmp_path).profiles_path).get(MODEL, TEMPLATE, 5)
    assert stored is not None and stored.trust is not None
    assert stored.trust.verdict == "undecided" and stored.trust.learning_since is not None
    # Only runs after the drift count: five new primacy runs give a new, primacy profile.
    await feed(lr, after, 6, bias_shape("primacy", 5))
    relearned = lr.decide(MODEL, TEMPLATE, N, None)
    assert relearned.path == "explore" and relearned.profile is not None
    assert relearned.profile.trust is not None
    assert relearned.profile.trust.top_slots == (0, 1) and relearned.profile.trust.runs == 6
    lr.close()


async def test_no_drift_folds_explore_runs_into_the_profile(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_explore_rate=1.0)
    await feed(lr, lr.decide(MODEL, TEMPLATE, N, None), 6, bias_shape("recency", 5))
    first = lr.decide(MODEL, TEMPLATE, N, None)
    assert first.profile is not None and first.profile.trust is not None
    await feed(lr, first, 8, bias_shape("recency", 5))
    later = lr.decide(MODEL, TEMPLATE, N, None)
    assert later.profile is not None and later.profile.trust is not None
    assert later.profile.trust.runs == 14  # refitted on every pooled run
    assert later.profile.trust.trusted_since == first.profile.trust.trusted_since
    assert lr.counters.drift_events == 0
    lr.close()


async def test_replicas_sharing_a_folder_take_turns_and_read_the_result(tmp_path: Path) -> None:
    a, b = learner(tmp_path, auto_explore_rate=0.0), learner(tmp_path, auto_explore_rate=0.0)
    da = a.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for k in range(6):
        (a if k % 2 else b).record(da, *run(bias_shape("recency", 5), rng))
    a._writer.submit(lambda: None).result()
    b._writer.submit(lambda: None).result()
    with b._lock(KEY) as held:  # b is assessing: a must not
        assert held
        await a.cycle(KEY)
        assert a.decide(MODEL, TEMPLATE, N, None).path == "moi"
    await a.cycle(KEY)  # a pools both replicas' runs
    assert a.decide(MODEL, TEMPLATE, N, None).path == "profile"
    await b.cycle(KEY)  # b reads what a stored
    found = b.decide(MODEL, TEMPLATE, N, None)
    assert found.path == "profile" and found.profile is not None
    assert found.profile.trust is not None and found.profile.trust.runs == 6
    a.close()
    b.close()


async def test_an_abandoned_lock_expires(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_lock_ttl_s=0.001)
    lr.root.mkdir(parents=True)
    stale = lr.root / "m__qa_default__L5.lock"
    stale.write_text("a replica that died")
    import os

    os.utime(stale, (time.time() - 10, time.time() - 10))
    with lr._lock(KEY) as held:
        assert held
    assert not stale.exists()
    lr.close()


def test_named_profiles_are_taken_as_given(tmp_path: Path) -> None:
    lr = learner(tmp_path)
    store = lr.profiles
    named = store.put(
        model="generator", template="qa_default", coefficients=[0.1, 0.2, 0.7],
        identification="answers", runs=50, prompts=150, r2=1.0, source="answers",
        oriented_by="data",
    )  # fmt: skip
    d = lr.decide(MODEL, TEMPLATE, N, named)
    assert d.path == "profile" and d.operator and d.profile == named and d.key is None


def test_too_few_passages_and_a_foreign_generator_run_moi(tmp_path: Path) -> None:
    assert learner(tmp_path).decide(MODEL, TEMPLATE, 3, None).path == "moi"
    s = settings(tmp_path, generator_model="big/generator")
    assert not allowed_to_learn(s)
    assert allowed_to_learn(settings(tmp_path, generator_model="big/generator",
                                     auto_learn_from_scorer=True))  # fmt: skip
    lr = ProfileLearner(s, ProfileStore(s.profiles_path), allowed=allowed_to_learn(s))
    d = lr.decide(MODEL, TEMPLATE, N, None)
    assert d.path == "moi" and d.key is None and "not the generator" in d.reason


def test_runs_that_cannot_be_pooled_are_not_kept(tmp_path: Path) -> None:
    lr = learner(tmp_path)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    perms, s = run(bias_shape("recency", 5), np.random.default_rng(0))
    failed = s.copy()
    failed[0] = np.nan
    assert not lr.record(d, perms, failed)
    assert not lr.record(d, perms[:, :4], s)
    ro = ProfileLearner.read_only(lr.settings, lr.profiles)
    assert not ro.record(d, perms, s) and ro.explore_rate == 0.0
    lr.close()


def test_no_caller_holds_more_than_its_share_while_others_contribute(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_max_caller_share=0.5)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)

    def keep(who: str | None) -> bool:
        return lr.record(d, *run(bias_shape("recency", 5), rng), who)

    # One caller alone is not bounded (one RAG backend in front): it has no one to dominate.
    assert all(keep("10.0.0.1") for _ in range(6))
    # A second caller arrives: the first, the first caller included, keeps nothing until it
    # is back within half of the recent runs.
    assert keep("10.0.0.2")
    assert not keep("10.0.0.1")
    assert lr.counters.caller_capped == 1
    held = {"10.0.0.1": 0, "10.0.0.2": 0}
    for k in range(40):
        who = "10.0.0.1" if k % 4 else "10.0.0.2"
        kept = keep(who)
        held[who] += kept
        recent = [c for _, c in lr._callers[KEY]]
        # A run is kept only if its caller then holds at most 5 of the latest 8 (the runs
        # that decide trust and drift): half of them and one.
        assert not kept or recent.count(who) <= 5
    assert held["10.0.0.2"] == 10  # the caller under its share is never refused
    # Runs with no caller (the command line) are not counted against anyone.
    assert keep(None)
    lr.close()


def test_an_honest_callers_old_runs_do_not_let_another_add_as_many_in_a_row(
    tmp_path: Path,
) -> None:
    # The review's case: after an honest caller's 40 runs, a second one kept 41 in a row,
    # enough to fill a drift test's window with its own runs and force a drift.
    lr = learner(tmp_path, auto_max_caller_share=0.5)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for _ in range(40):
        assert lr.record(d, *run(bias_shape("recency", 5), rng), "10.0.0.2")
    kept = sum(lr.record(d, *run(bias_shape("primacy", 5), rng), "10.0.0.9") for _ in range(41))
    assert kept == 5  # of any 8 consecutive kept runs (a drift window), at most 5
    lr.close()


async def test_caller_counts_decay_and_outlive_a_drift(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_max_caller_share=0.5, auto_caller_window_s=0.3)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)

    def keep(who: str) -> bool:
        return lr.record(d, *run(bias_shape("recency", 5), rng), who)

    assert all(keep("10.0.0.1") for _ in range(3))
    assert keep("10.0.0.2")  # a caller seen once (an operator's curl)
    assert not keep("10.0.0.1")
    await anyio.sleep(0.35)  # its run no longer counts: the backend is alone again
    assert all(keep("10.0.0.1") for _ in range(3))
    lr.close()


def test_a_lone_caller_is_bounded_when_the_operator_asks(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_max_caller_share=0.5, auto_bound_lone_caller=True)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)

    def keep(who: str) -> bool:
        return lr.record(d, *run(bias_shape("recency", 5), rng), who)

    # The first caller (after a start, say) cannot supply the runs that decide trust alone.
    assert keep("10.0.0.1")
    assert not keep("10.0.0.1")
    # Two callers take turns.
    assert [keep(w) for w in ("10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1")] == [True] * 4
    lr.close()


async def test_the_caller_share_and_a_lone_callers_bound_hold_per_worker_process(
    tmp_path: Path,
) -> None:
    # Two workers of one server (RAG_REORDER_WORKERS=2): two learners on one store. The
    # share, and whether a caller is alone, are each worker's, as the settings and
    # docs/operations.md ("Bounds and their scope") state.
    def two(**kw: Any) -> tuple[ProfileLearner, ProfileLearner]:
        kw.update(auto_max_caller_share=0.5, auto_caller_window_s=0.3)
        return learner(tmp_path, **kw), learner(tmp_path, **kw)

    rng = np.random.default_rng(0)

    def keeps(lr: ProfileLearner, who: str, k: int) -> int:
        d = lr.decide(MODEL, TEMPLATE, N, None)
        return sum(lr.record(d, *run(bias_shape("recency", 5), rng), who) for _ in range(k))

    w1, w2 = two()
    assert keeps(w1, "10.0.0.2", 1) == 1
    assert keeps(w1, "10.0.0.9", 6) == 2  # bounded where another caller contributes: 2 of 3
    assert keeps(w2, "10.0.0.9", 6) == 6  # alone on the other worker: not bounded there
    for lr in (w1, w2):
        lr.close()

    # With auto_bound_lone_caller a caller alone has one run kept per window on each
    # worker: a one-caller deployment still learns, at W runs a window.
    w1, w2 = two(auto_bound_lone_caller=True)
    assert (keeps(w1, "10.0.0.9", 6), keeps(w2, "10.0.0.9", 6)) == (1, 1)
    await anyio.sleep(0.35)  # its runs no longer count
    assert (keeps(w1, "10.0.0.9", 6), keeps(w2, "10.0.0.9", 6)) == (1, 1)
    for lr in (w1, w2):
        lr.close()


async def test_explore_runs_wait_for_an_idle_engine_and_yield_to_requests(
    tmp_path: Path,
) -> None:
    import anyio

    lr = learner(tmp_path)
    d = Decision("explore", "checking", None, KEY)
    busy = True
    lr.idle = lambda: not busy
    started = anyio.Event()
    good = run(bias_shape("recency", 5), np.random.default_rng(0))

    async def slow() -> tuple[np.ndarray, np.ndarray]:
        started.set()
        await anyio.sleep(60)
        return good

    marked: list[bool] = []

    async def quick() -> tuple[np.ndarray, np.ndarray]:
        # Its engine calls are the service's own work: after callers', in short forwards.
        marked.append(in_background())
        return good

    async def until(cond: Any) -> None:
        with anyio.fail_after(10):
            while not cond():
                await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lr.run_shadows)
        await until(lambda: lr._shadow_wake is not None)
        assert lr.explore_later(d, slow)
        assert not lr.explore_later(d, quick)  # one at a time: the second is dropped
        await anyio.sleep(0.3)
        assert not started.is_set()  # a request is using the engine: it waits
        busy = False
        await started.wait()
        busy = True  # a request starts using the engine: the explore run gives way
        await until(lambda: lr.counters.shadow_runs["preempted"] == 1)
        busy = False
        assert lr.explore_later(d, quick)
        await until(lambda: lr.counters.shadow_runs["recorded"] == 1)
        tg.cancel_scope.cancel()
    assert marked == [True] and not in_background()
    assert lr.counters.shadow_runs == {
        "recorded": 1,
        "preempted": 1,
        "dropped": 1,
        "failed": 0,
        "expired": 0,
    }
    lr._writer.submit(lambda: None).result()
    assert len(lr.explore.runs(KEY.sample())) == 1 and len(lr.runs.runs(KEY.sample())) == 1
    lr.close()


async def test_a_slow_assessment_refreshes_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fit that takes longer than the lock's expiry: the holder refreshes the lock, so
    # another replica does not take it for a dead holder's and assess beside it.
    a, b = learner(tmp_path, auto_lock_ttl_s=0.3), learner(tmp_path, auto_lock_ttl_s=0.3)
    d = a.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for _ in range(6):
        assert a.record(d, *run(bias_shape("recency", 5), rng))
    monkeypatch.setattr(trust_rules, "assess", slow_fits.slow_assess)
    name = lock_name(MODEL, TEMPLATE, 5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.cycle, KEY)
        await anyio.sleep(0.7)  # more than twice the expiry into the fit
        assert b.locks.acquire(name, 0.3) is None
    assert a.decide(MODEL, TEMPLATE, N, None).path == "profile"
    assert b.locks.acquire(name, 0.3) is not None  # released once done
    a.close()
    b.close()


def explore_decision(lr: ProfileLearner) -> Decision:
    """An explore request's decision (built here: whether ``decide`` draws one also depends
    on the background queue, which these tests do not run)."""
    st = lr._status[KEY]
    assert st.trusted and st.stored is not None
    return Decision("explore", "test", st.stored, KEY)


async def test_drift_is_still_tested_once_the_pool_is_full(tmp_path: Path) -> None:
    # At auto_max_runs the pool's length stops changing (each run pushes the oldest out);
    # the drift test must not stop with it.
    lr = learner(tmp_path, auto_max_runs=10, auto_explore_rate=1.0)
    await feed(lr, lr.decide(MODEL, TEMPLATE, N, None), 10, bias_shape("recency", 5))
    assert lr.decide(MODEL, TEMPLATE, N, None).path in ("profile", "explore")
    rng = np.random.default_rng(1)
    for _ in range(4):  # the generator changed: reversed
        for _ in range(5):
            assert lr.record(explore_decision(lr), *run(bias_shape("primacy", 5), rng))
        await lr.cycle(KEY)
        if lr.counters.drift_events:
            break
    assert lr.counters.drift_events == 1
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "moi"
    lr.close()


async def test_an_undecided_key_at_the_cap_is_reassessed(tmp_path: Path) -> None:
    lr = learner(tmp_path, auto_max_runs=10, auto_explore_rate=0.0)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for _ in range(10):  # scores that are noise: nothing can be told from them
        perms = solver.plan("pruned_random", N, seed=0)
        assert lr.record(d, perms, rng.normal(size=perms.shape[0]))
    await lr.cycle(KEY)
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "moi"
    # The pool is full; ten clear runs replace the noise and must be assessed.
    await feed(lr, d, 10, bias_shape("recency", 5))
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "profile"
    lr.close()


async def test_a_failed_store_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr = learner(tmp_path, auto_explore_rate=0.0)
    d = lr.decide(MODEL, TEMPLATE, N, None)
    rng = np.random.default_rng(0)
    for _ in range(6):
        assert lr.record(d, *run(bias_shape("recency", 5), rng))

    def full(**kw: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(lr.profiles, "put", full)
    with pytest.raises(OSError, match="No space"):
        await lr.cycle(KEY)  # run_forever logs it and counts a failed recalibration
    monkeypatch.undo()
    await lr.cycle(KEY)  # no new run, but the trusted profile was never stored
    assert lr.decide(MODEL, TEMPLATE, N, None).path == "profile"
    assert lr.profiles.get(MODEL, TEMPLATE, 5) is not None
    lr.close()


async def test_a_profile_is_trusted_only_if_odd_passage_counts_place_stably(
    tmp_path: Path,
) -> None:
    # 9 and 10 passages share the 5-slot key. This profile places 10 passages stably but 9 by
    # a coin toss (tests/solver/test_trust.py): it must not be trusted for either.
    from tests.solver.test_trust import _peaked_runs

    lr = learner(tmp_path, auto_explore_rate=0.0)
    d = lr.decide(MODEL, TEMPLATE, 9, None)
    assert d.key == KEY
    for perms, scores in _peaked_runs(10, 0.5):
        assert lr.record(d, perms, scores)
    await lr.cycle(KEY)
    after = lr.decide(MODEL, TEMPLATE, 9, None)
    assert after.path == "moi" and "of 9 passages" in after.reason
    lr.close()
