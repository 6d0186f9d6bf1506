"""Scored designs of sampled live MoI requests, kept to calibrate a bias profile from traffic.

docs/api.md lets a profile be calibrated "from sampled live traffic": the permutations a request
already scored for its own fit are exactly the runs ``solver.calibrate`` pools, so a sampled
request costs nothing extra. With ``traffic_sample_rate`` > 0, each MoI request whose design
can identify the bias on its own (``random``, ``hybrid``: the shape at N slots;
``pruned_random``: everything at L slots) and scored every prompt is kept with that
probability, as numbers only (permutation indices and per-prompt scores, never query or
passage text), in a ring of the latest ``traffic_sample_max_runs`` per (model, template,
design group, slot count). Cyclic designs are not kept (they identify no bias), nor are
variable-pruned ones (ragged prompts), runs that cannot identify a bias on their own (too few
prompts, served with a stored profile) or requests where a prompt failed.

By default the sample lives in the process: each replica keeps its own and a restart empties
it. With ``traffic_sample_dir`` (a folder every replica mounts, e.g. the bias-profile volume)
each replica also appends what it keeps to its own file there (``TrafficSpool``), and a
calibration on any replica pools the latest ``traffic_sample_max_runs`` runs of every replica
that wrote there, surviving restarts. The appends run on one worker thread, in order, so a
slow volume never holds up a request; a failed append is logged, and the run then stays only in
this replica's memory (its gauge counts it; a pooled calibration, which reads the folder, does
not).
``offer`` runs on the event loop thread (no locks on the in-memory rings); reading the spool
blocks, so callers on the event loop run ``runs``/``pooled_counts`` in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

import solver
from service.state.files import write_atomic

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_WARN_EVERY_S = 60.0
# A file is pruned only after this long unwritten: a replica appending between the read that
# found its file stale and the unlink would lose that one run (the window is microseconds
# wide; the idle time makes it need a replica quiet for a minute that appends in it).
_IDLE_BEFORE_PRUNE_S = 60.0
_FIELDS = frozenset({"t", "model", "template", "design", "slots", "perms", "scores"})

DesignGroup = Literal["random", "pruned_random"]
"""``random`` pools the full-length designs (``random`` and ``hybrid``, N slots);
``pruned_random`` the pruned-random ones (L slots)."""

_GROUP_OF: dict[str, DesignGroup] = {
    "random": "random",
    "hybrid": "random",
    "pruned_random": "pruned_random",
    # Its rows are distinct prompts of L passages, as pruned random's: pooled with them.
    "adaptive": "pruned_random",
}


@dataclass(frozen=True)
class SampleKey:
    model: str
    template: str
    design: DesignGroup
    slots: int


@dataclass(frozen=True)
class SampleCount:
    key: SampleKey
    runs: int


Run = tuple[np.ndarray, np.ndarray]


SpoolName = Literal["sample", "auto/runs", "auto/explore", "auto/generator", "auto/outcomes"]
"""The run spools: the calibration-from-traffic sample, ``auto``'s learning and explore runs,
and the generator's attributed answers (``service.learning.generator_online``: a "run" is the
order shown, one row, and the answer's weight per slot), and the outcomes callers report
(``service.learning.outcomes``: a "run" is the arm, and the reward with the arms' odds)."""


class RunSpool(Protocol):
    """Sampled runs pooled by every replica, bounded per key (the latest ``max_runs``)."""

    max_runs: int

    @property
    def where(self) -> str:
        """Where the runs are kept, for log lines (no secrets)."""
        ...

    def append(self, key: SampleKey, run: Run, at: float) -> None:
        """Keep one run of ``key`` kept at ``at`` (``time.time()``)."""
        ...

    def runs(self, key: SampleKey, *, since: float | None = None) -> list[Run]:
        """The latest ``max_runs`` runs of ``key``, oldest first; with ``since``, only those
        kept at or after it. Blocks; raises ``service.errors.StateUnavailable`` if they
        cannot be read."""
        ...

    def counts(self) -> list[SampleCount]:
        """Runs ``runs`` would pool, per key. Blocks; may raise
        ``service.errors.StateUnavailable``."""
        ...

    def watermark(self, key: SampleKey) -> object:
        """A value that changes whenever any replica appends a run of ``key`` (and only
        rarely otherwise): equal to an earlier one, nothing new arrived, whether or not the
        pool is at ``max_runs``. Cheap (no run is read); blocks; may raise
        ``service.errors.StateUnavailable``."""
        ...


class TrafficSampler:
    """Keeps a random share of live MoI runs (module docstring)."""

    def __init__(
        self,
        rate: float,
        max_runs: int,
        *,
        seed: int | None = None,
        spool: RunSpool | None = None,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.rate = rate
        self.max_runs = max_runs
        self.spool = spool
        self._rng = np.random.default_rng(seed)
        self._runs: dict[SampleKey, deque[Run]] = {}
        # One worker: the spool's appends land in the order the runs were kept.
        self._writer = ThreadPoolExecutor(1, "traffic-spool") if spool is not None else None
        self._last_warning = -_WARN_EVERY_S

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    def offer(
        self, *, model: str, template: str, kind: str, perms: np.ndarray, scores: np.ndarray
    ) -> DesignGroup | None:
        """Keep this run with probability ``rate`` if it can serve a calibration.

        Returns:
            The design group it was kept under, or ``None`` (not drawn, or not usable).
        """
        group = _GROUP_OF.get(kind)
        if group is None or not self.enabled or perms.ndim != 2 or perms.shape[0] < 2:
            return None
        if (perms < 0).any() or not np.isfinite(scores).all():
            return None  # ragged (variable pruning) or a failed prompt
        # A request can run a design that identifies no bias on its own when a stored profile
        # supplies it; one such run would make every later calibration from this key fail.
        design, _ = solver.as_design(perms).compact()
        if solver.identifiability(design).level == "none":
            return None
        if self.rate < 1.0 and self._rng.random() >= self.rate:
            return None
        key = SampleKey(model, template, group, int(perms.shape[1]))
        ring = self._runs.get(key)
        if ring is None:
            ring = self._runs[key] = deque(maxlen=self.max_runs)
        run = (perms.copy(), np.asarray(scores, dtype=np.float64).copy())
        ring.append(run)
        if self._writer is not None:
            self._writer.submit(self._spool_append, key, run, time.time())
        return group

    def runs(self, model: str, template: str, design: DesignGroup, slots: int) -> list[Run]:
        """The runs a calibration pools for this key, oldest first: this replica's, or with a
        spool the latest ``max_runs`` of every replica's (blocks on the spool's folder)."""
        key = SampleKey(model, template, design, slots)
        if self.spool is None:
            return list(self._runs.get(key, ()))
        self.flush()
        return self.spool.runs(key)

    def counts(self) -> list[SampleCount]:
        """How many runs each key holds in this replica, sorted by model, template, design
        and slots (what the ``traffic_sample_runs`` gauge reports)."""
        held = sorted(((k, len(ring)) for k, ring in self._runs.items() if ring), key=_order)
        return [SampleCount(k, n) for k, n in held]

    def pooled_counts(self) -> list[SampleCount]:
        """``counts`` of what ``runs`` pools: every replica's with a spool (blocks)."""
        if self.spool is None:
            return self.counts()
        self.flush()
        return self.spool.counts()

    def flush(self) -> None:
        """Wait until every run kept so far is in the spool (blocks)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the pending spool appends; later runs are kept in memory only."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _spool_append(self, key: SampleKey, run: Run, at: float) -> None:
        assert self.spool is not None
        try:
            self.spool.append(key, run, at)
        except OSError as exc:  # a full or read-only volume must not fail requests
            now = time.monotonic()
            if now - self._last_warning >= _WARN_EVERY_S:
                self._last_warning = now
                log.warning("traffic sample: could not append to %s: %s", self.spool.where, exc)


class TrafficSpool:
    """Every replica's sampled runs in a shared folder: ``<root>/<key>/<replica>.jsonl``, one
    JSON line a run (permutation indices, scores, time: numbers only). Each replica appends to
    its own file only, and rewrites it with its latest ``max_runs`` lines once it holds twice
    that, so files stay bounded and no two processes write one file. Readers skip a line torn
    by a crash or a concurrent append.

    Files of gone replicas (every pod of a rollout gets a new name) are deleted once none of
    their runs is among the latest ``max_runs`` of their key any more and they have not been
    written for ``_IDLE_BEFORE_PRUNE_S``; each replica prunes when it compacts its own file and
    when a calibration reads the folder, so the folder stays bounded under pod churn. Parsed
    files are cached by (inode, size, mtime): a read re-parses only what changed.

    Args:
        root: the shared folder (created on first append).
        max_runs: runs pooled per key, the latest of all replicas'.
        replica: this sampler's file name (default ``<hostname>-<pid>-<random>``: unique per
            pod, restart and app; a gone replica's runs age out of the latest ``max_runs``).
    """

    def __init__(self, root: Path, max_runs: int, replica: str | None = None) -> None:
        self.root = root
        self.max_runs = max_runs
        default = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.replica = _SAFE.sub("_", replica or default)
        self._lines: dict[SampleKey, int] = {}
        # Readers run on worker threads beside the writer thread: one lock for the parse cache.
        self._parsed: dict[Path, tuple[tuple[int, int, int], list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return str(self.root)

    def folder(self, key: SampleKey) -> Path:
        name = f"{key.model}__{key.template}__{key.design}__L{key.slots}"
        return self.root / _SAFE.sub("_", name)

    def append(self, key: SampleKey, run: Run, at: float) -> None:
        """Append one run to this replica's file of ``key`` (compacting it when due)."""
        path = self.folder(key) / f"{self.replica}.jsonl"
        lead = ""
        if key not in self._lines:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lines[key] = len(_read_lines(path))
            if path.is_file() and path.stat().st_size and not _ends_with_newline(path):
                lead = "\n"  # a crash tore the last line: do not glue this one to it
        line = run_record(key, run, at)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(lead + line + "\n")
        self._lines[key] += 1
        if self._lines[key] >= 2 * self.max_runs:
            keep = _read_lines(path)[-self.max_runs :]
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
            self._lines[key] = len(keep)
            self._prune(self._files(path.parent))

    def runs(self, key: SampleKey, *, since: float | None = None) -> list[Run]:
        """The latest ``max_runs`` runs of ``key`` over every replica's file, oldest first;
        with ``since`` (a ``time.time()``), only those appended at or after it."""
        files = self._files(self.folder(key))
        records = sorted(
            (
                r
                for _, recs in files
                for r in recs
                if _key_of(r) == key and (since is None or float(r["t"]) >= since)
            ),
            key=lambda r: float(r["t"]),
        )[-self.max_runs :]
        self._prune(files)
        return [run_of(r) for r in records]

    def watermark(self, key: SampleKey) -> object:
        """Every replica's file of ``key`` with its inode, size and time: an append grows
        one, a compaction replaces one, so equal watermarks mean no run arrived."""
        out = []
        for path in sorted(self.folder(key).glob("*.jsonl")):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # pruned by another replica since the glob
            out.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def counts(self) -> list[SampleCount]:
        """Runs ``runs`` would pool, per key found in the folder."""
        held: dict[SampleKey, int] = {}
        for _, recs in self._files(self.root, "*/*.jsonl"):
            for r in recs:
                key = _key_of(r)
                held[key] = held.get(key, 0) + 1
        return [SampleCount(k, min(n, self.max_runs)) for k, n in sorted(held.items(), key=_order)]

    def _files(
        self, folder: Path, pattern: str = "*.jsonl"
    ) -> list[tuple[Path, list[dict[str, Any]]]]:
        """Each spool file under ``folder`` with its records, parsed again only if changed."""
        out = []
        seen = set()
        for path in sorted(folder.glob(pattern)):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # pruned by another replica since the glob
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                cached = self._parsed.get(path)
            if cached is None or cached[0] != stamp:
                cached = (stamp, _read_lines(path))
                with self._lock:
                    self._parsed[path] = cached
            out.append((path, cached[1]))
            seen.add(path)
        with self._lock:  # forget files gone from this folder
            for path in [p for p in self._parsed if p.parent.is_relative_to(folder)]:
                if path not in seen and path.match(pattern):
                    del self._parsed[path]
        return out

    def _prune(self, files: list[tuple[Path, list[dict[str, Any]]]]) -> None:
        """Delete other replicas' files of one key folder (as ``_files`` listed them) that no
        longer hold a pooled run."""
        times: dict[SampleKey, list[float]] = {}
        for _, recs in files:
            for r in recs:
                times.setdefault(_key_of(r), []).append(float(r["t"]))
        cutoff = {  # the oldest pooled time per key; keys not yet full keep every file
            k: sorted(ts)[-self.max_runs] for k, ts in times.items() if len(ts) > self.max_runs
        }
        idle_since = time.time() - _IDLE_BEFORE_PRUNE_S
        for path, recs in files:
            if path.stem == self.replica or not recs:
                continue  # our own file is bounded by compaction; an empty one may be new
            if all(_key_of(r) in cutoff and float(r["t"]) < cutoff[_key_of(r)] for r in recs):
                try:
                    if path.stat().st_mtime < idle_since:
                        path.unlink()
                except FileNotFoundError:
                    pass  # another replica pruned it first
                except OSError as exc:  # read-only volume: reading still works
                    log.debug("traffic sample: could not prune %s: %s", path, exc)


def run_record(key: SampleKey, run: Run, at: float, run_id: str | None = None) -> str:
    """One kept run as its stored JSON line (numbers only and a random id; no newline). The
    id makes a write idempotent: a store that is sent the run twice (a retried write it had
    applied) keeps it once, and readers count it once."""
    return json.dumps(
        {
            "id": run_id or uuid.uuid4().hex,
            "t": at,
            "model": key.model,
            "template": key.template,
            "design": key.design,
            "slots": key.slots,
            "perms": run[0].tolist(),
            "scores": run[1].tolist(),
        },
        allow_nan=False,
    )


def run_of(record: dict[str, Any]) -> Run:
    """A stored record's run."""
    return (
        np.asarray(record["perms"], dtype=np.int64),
        np.asarray(record["scores"], dtype=np.float64),
    )


def well_formed(record: object) -> bool:
    """Whether a parsed line is a run record (a torn or foreign line is skipped)."""
    return isinstance(record, dict) and record.keys() >= _FIELDS


def _key_of(record: dict[str, Any]) -> SampleKey:
    return SampleKey(
        str(record["model"]), str(record["template"]), record["design"], int(record["slots"])
    )


def _order(item: tuple[SampleKey, int]) -> tuple[str, str, str, int]:
    k = item[0]
    return (k.model, k.template, k.design, k.slots)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The well-formed records of one spool file (none if it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # torn by a crash, or being appended right now
        if well_formed(rec):
            out.append(rec)
    return out


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
