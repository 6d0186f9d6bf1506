"""The live-traffic sample behind calibration from traffic (``service.state.traffic``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from service.state import traffic
from service.state.traffic import SampleKey, TrafficSampler, TrafficSpool

PERMS = np.array([[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1]])
SCORES = np.array([-3.0, -2.5, -2.0, -2.8])


def offer(s: TrafficSampler, kind: str = "random", **kw: np.ndarray) -> str | None:
    return s.offer(
        model="m",
        template="t",
        kind=kind,
        perms=kw.get("perms", PERMS),
        scores=kw.get("scores", SCORES),
    )


def test_keeps_copies_grouped_by_design_and_slots() -> None:
    s = TrafficSampler(1.0, 10)
    perms = PERMS.copy()
    assert s.offer(model="m", template="t", kind="hybrid", perms=perms, scores=SCORES) == "random"
    perms[0, 0] = 9  # the caller's array changing later does not change the sample
    assert offer(s, "pruned_random", perms=PERMS[:, :2]) == "pruned_random"
    (run,) = s.runs("m", "t", "random", 3)
    assert run[0][0, 0] == 0 and np.array_equal(run[1], SCORES)
    assert [(c.key.design, c.key.slots, c.runs) for c in s.counts()] == [
        ("pruned_random", 2, 1),
        ("random", 3, 1),
    ]
    assert s.runs("m", "other-template", "random", 3) == []


@pytest.mark.parametrize(
    ("kind", "perms", "scores"),
    [
        ("cyclic", PERMS, SCORES),  # identifies no bias
        ("pruned_cyclic", PERMS[:, :2], SCORES),
        ("pruned_random", np.array([[0, 1], [2, -1], [1, 0], [2, 0]]), SCORES),  # ragged
        ("random", PERMS, np.array([-3.0, np.nan, -2.0, -2.8])),  # a failed prompt
        ("random", PERMS[:1], SCORES[:1]),  # one prompt
        # two prompts of 2 of 4 passages: identifies no bias on its own
        ("pruned_random", np.array([[0, 1], [2, 3]]), SCORES[:2]),
    ],
)
def test_refuses_runs_that_cannot_serve_a_calibration(
    kind: str, perms: np.ndarray, scores: np.ndarray
) -> None:
    s = TrafficSampler(1.0, 10)
    assert offer(s, kind, perms=perms, scores=scores) is None
    assert s.counts() == []


def test_rate_draws_that_share_and_zero_keeps_nothing() -> None:
    s = TrafficSampler(0.25, 10_000, seed=1)
    kept = sum(offer(s) is not None for _ in range(4000))
    assert 900 < kept < 1100  # binomial(4000, 0.25): mean 1000, sd 27
    off = TrafficSampler(0.0, 10)
    assert not off.enabled and offer(off) is None


def test_ring_keeps_the_latest_runs() -> None:
    s = TrafficSampler(1.0, 3)
    for k in range(5):
        offer(s, scores=SCORES + k)
    runs = s.runs("m", "t", "random", 3)
    assert [r[1][0] for r in runs] == [-1.0, 0.0, 1.0]  # offers 2, 3, 4


@pytest.mark.parametrize(("rate", "max_runs"), [(-0.1, 1), (1.5, 1), (0.5, 0)])
def test_bad_settings_are_refused(rate: float, max_runs: int) -> None:
    with pytest.raises(ValueError):
        TrafficSampler(rate, max_runs)


# --- the shared folder (TrafficSpool): every replica's runs pooled --------------------------


def spooled(root: Path, replica: str, max_runs: int = 10) -> TrafficSampler:
    return TrafficSampler(1.0, max_runs, spool=TrafficSpool(root, max_runs, replica=replica))


def test_a_calibration_on_any_replica_pools_every_replicas_runs(tmp_path: Path) -> None:
    a, b = spooled(tmp_path, "pod-a"), spooled(tmp_path, "pod-b")
    offer(a, scores=SCORES + 1)
    offer(b, scores=SCORES + 2)
    offer(a, scores=SCORES + 3)
    b.flush()  # another replica's appends land when its worker gets to them (here: now)
    for s in (a, b):  # each replica sees all three, oldest first, exact numbers
        runs = s.runs("m", "t", "random", 3)
        assert [r[1][0] for r in runs] == [-2.0, -1.0, 0.0]
        assert all(np.array_equal(r[0], PERMS) and r[0].dtype == np.int64 for r in runs)
        assert [(c.key, c.runs) for c in s.pooled_counts()] == [
            (SampleKey("m", "t", "random", 3), 3)
        ]
    assert [c.runs for c in a.counts()] == [2]  # the gauge stays per replica
    a.close()
    b.close()
    # A replica started later (a restart, a new pod) pools what the others left.
    assert len(spooled(tmp_path, "pod-c").runs("m", "t", "random", 3)) == 3


def test_the_pool_is_the_latest_max_runs_and_files_stay_bounded(tmp_path: Path) -> None:
    a, b = spooled(tmp_path, "a", max_runs=4), spooled(tmp_path, "b", max_runs=4)
    for k in range(20):
        offer(a if k % 2 else b, scores=SCORES + k)
    b.flush()
    assert [r[1][0] for r in a.runs("m", "t", "random", 3)] == [13.0, 14.0, 15.0, 16.0]
    assert a.spool is not None
    for f in a.spool.folder(SampleKey("m", "t", "random", 3)).glob("*.jsonl"):
        assert len(f.read_text().splitlines()) < 2 * 4  # compacted to the latest 4 at 8
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_torn_line_is_skipped_and_not_glued_to_the_next(tmp_path: Path) -> None:
    s = spooled(tmp_path, "a")
    offer(s, scores=SCORES)
    s.close()
    assert s.spool is not None
    path = s.spool.folder(SampleKey("m", "t", "random", 3)) / "a.jsonl"
    with path.open("a") as fh:
        fh.write('{"t": 1e12, "perms": [[0, 1')  # the process died mid-append
    again = spooled(tmp_path, "a")
    offer(again, scores=SCORES + 1)
    assert [r[1][0] for r in again.runs("m", "t", "random", 3)] == [-3.0, -2.0]


def test_an_unwritable_folder_keeps_serving_from_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    s = spooled(blocker, "a")
    assert offer(s) == "random"  # the request's path is not affected
    s.flush()
    assert "could not append" in caplog.text
    assert [c.runs for c in s.counts()] == [1]


def test_keys_that_share_a_folder_name_stay_apart(tmp_path: Path) -> None:
    s = spooled(tmp_path, "a")
    s.offer(model="org/m", template="t", kind="random", perms=PERMS, scores=SCORES)
    s.offer(model="org_m", template="t", kind="random", perms=PERMS, scores=SCORES + 1)
    assert s.spool is not None
    assert s.spool.folder(SampleKey("org/m", "t", "random", 3)) == s.spool.folder(
        SampleKey("org_m", "t", "random", 3)
    )
    assert [r[1][0] for r in s.runs("org/m", "t", "random", 3)] == [-3.0]
    assert [(c.key.model, c.runs) for c in s.pooled_counts()] == [("org/m", 1), ("org_m", 1)]


def age(folder: Path, seconds: float) -> None:
    """Make every spool file in ``folder`` look last written ``seconds`` ago."""
    for f in folder.glob("*.jsonl"):
        st = f.stat()
        os.utime(f, (st.st_atime - seconds, st.st_mtime - seconds))


def test_files_of_gone_replicas_are_pruned_once_out_of_the_pool(tmp_path: Path) -> None:
    key = SampleKey("m", "t", "random", 3)
    for pod in ("rollout-1", "rollout-2"):  # replicas of an earlier rollout, long gone
        old = spooled(tmp_path, pod, max_runs=3)
        offer(old, scores=SCORES)
        old.close()
    mixed = spooled(tmp_path, "rollout-3", max_runs=3)
    offer(mixed, scores=SCORES)
    offer(mixed, scores=SCORES)
    mixed.close()
    new = spooled(tmp_path, "current", max_runs=3)
    assert new.spool is not None
    folder = new.spool.folder(key)
    offer(new, scores=SCORES + 10)
    offer(new, scores=SCORES + 10)
    age(folder, 3600.0)
    new.runs("m", "t", "random", 3)
    # The pool is current's 2 and rollout-3's newest: rollout-1 and -2 hold none of it.
    assert sorted(f.stem for f in folder.glob("*.jsonl")) == ["current", "rollout-3"]
    offer(new, scores=SCORES + 10)
    assert [r[1][0] for r in new.runs("m", "t", "random", 3)] == [7.0, 7.0, 7.0]
    assert sorted(f.stem for f in folder.glob("*.jsonl")) == ["current"]
    assert [(c.key, c.runs) for c in new.pooled_counts()] == [(key, 3)]


def test_a_recently_written_stale_file_is_kept(tmp_path: Path) -> None:
    quiet = spooled(tmp_path, "quiet", max_runs=2)
    offer(quiet, scores=SCORES)
    quiet.close()
    busy = spooled(tmp_path, "busy", max_runs=2)
    for _ in range(3):
        offer(busy, scores=SCORES + 1)
    assert busy.spool is not None
    folder = busy.spool.folder(SampleKey("m", "t", "random", 3))
    busy.runs("m", "t", "random", 3)  # quiet's run is out of the pool but written just now
    assert (folder / "quiet.jsonl").is_file()
    age(folder, 3600.0)
    busy.runs("m", "t", "random", 3)
    assert not (folder / "quiet.jsonl").exists()


def test_reads_parse_only_files_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = spooled(tmp_path, "a"), spooled(tmp_path, "b")
    offer(a)
    offer(b)
    a.flush()  # a first append reads its file too: let both land before counting parses
    b.flush()
    parsed: list[str] = []
    real = traffic._read_lines
    monkeypatch.setattr(
        traffic,
        "_read_lines",
        lambda p: parsed.append(p.stem) or real(p),  # type: ignore[func-returns-value]
    )
    assert len(a.runs("m", "t", "random", 3)) == 2
    assert sorted(parsed) == ["a", "b"]
    parsed.clear()
    a.pooled_counts()
    assert len(a.runs("m", "t", "random", 3)) == 2
    assert parsed == []  # nothing changed: the cache answered
    offer(b, scores=SCORES + 1)
    b.flush()
    assert len(a.runs("m", "t", "random", 3)) == 3
    assert parsed == ["b"]
