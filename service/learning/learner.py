"""What the profile-first strategy (``auto``) knows: the scoring model's position profile,
learned from the MoI runs it serves, whether it is trusted yet, and whether it still holds.

The lifecycle (docs/operations.md, "The profile-first strategy", has the diagram):

    learning --(trusted: shaped)--> profile --(explore runs disagree)--> learning
             \\--(trusted: flat)---> flat    --(explore runs disagree)--> learning

- **learning**: a request runs MoI with the learning design (``pruned_random``, the default
  MoI design: it fixes the bias's orientation from the data) and its scored runs, numbers
  only, are appended to the learning pool. No profile is placed by yet.
- **trusted**: ``solver.trust.assess`` found the pooled profile distinguishable from flat
  with a stable placement (``shaped``), or shown flat. Requests are ranked cheaply and placed
  by it (``profile``), or kept best first (``flat``): no model call. A share
  ``auto_explore_rate`` still runs MoI (``explore``); those runs also feed a drift test
  (``solver.trust.drift``) against the stored profile, and a disagreement beyond both fits'
  uncertainty that changes the placement sends the key back to learning, from then on.

Nothing here runs in a request's path but ``decide`` (a dictionary lookup and a random draw)
and ``record`` (an append handed to a writer thread). The fits, bootstraps and drift tests run
in ``run_forever``, a background task, on a thread at the lowest CPU priority, at most
once per ``auto_recalibrate_s`` per key and only when new runs arrived.

Learning runs live in a folder (``<bias_profile_dir>/auto/runs``, explore runs in ``.../explore``,
one append-only file per replica: ``service.state.traffic.TrafficSpool``), or with ``state_url`` in
Redis (``service.state.state_store``), so a restart keeps what was learned, and replicas that share
the folder or the Redis pool their runs. Of those replicas only the holder of a lock (with an
expiry, so a killed holder does not block the rest) fits and stores; every replica reads the
stored profile, which carries its trust figures (``StoredProfile.trust``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import anyio.to_thread
import numpy as np

import solver
from service.backends.base import background_work
from service.config.settings import Settings
from service.errors import StateUnavailable
from service.learning.generator_online import GeneratorSampler
from service.learning.outcomes import OutcomeMonitor
from service.runtime.background import shared_worker
from service.state.profile_store import ProfileStore, ProfileTrust, StoredProfile, profile_id
from service.state.state_store import (
    FolderState,
    StateStore,
    held,
    lock_name,
)
from service.state.traffic import Run, RunSpool, SampleKey
from solver import trust as trust_rules

if TYPE_CHECKING:
    from service.backends.base import LogprobBackend

log = logging.getLogger(__name__)

_T = TypeVar("_T")

AutoPath = Literal["profile", "flat", "moi", "explore", "cold", "holdout", "pass_through"]
AUTO_PATHS: tuple[AutoPath, ...] = (
    "profile", "flat", "moi", "explore", "cold", "holdout", "pass_through"
)  # fmt: skip
"""``holdout`` and ``pass_through``: a placed path's request served the control order by the
randomized holdout or ``outcome_policy`` ``act`` (``service.learning.outcomes``)."""
MIN_PASSAGES = 4
"""Fewer passages than this: a pruned design shows one passage a prompt, which measures no
position bias, so there is nothing to learn and ``auto`` runs MoI (a few prompts)."""
LEARNING_DESIGN: solver.DesignKind = "pruned_random"
Recalibration = Literal["trusted", "undecided", "failed"]
ShadowOutcome = Literal["recorded", "preempted", "dropped", "failed", "expired"]
ShadowKind = Literal["explore", "learning"]
ShadowRun = Callable[[], Awaitable[tuple[np.ndarray, np.ndarray]]]
"""A MoI run to be run in the background (an explore request's, or a learning run of a
request served on the cold path): its design and scores."""
_IDLE_POLL_S = 0.1
SHADOW_MAX_WAIT_S = 300.0
"""A background run that found no idle engine for this long is given up (``expired``), so
traffic that never idles cannot hold the slot forever and a fresh one can be drawn."""


def learning_slots(n_passages: int) -> int | None:
    """Prompt slots L of the learning design for N passages (``pruned_random``'s default,
    ceil(N / 2)); ``None`` below ``MIN_PASSAGES``."""
    if n_passages < MIN_PASSAGES:
        return None
    return solver.default_prompt_passages(n_passages)


@dataclass(frozen=True)
class LearnKey:
    """What a learned profile describes: one scoring model, template and slot count."""

    model: str
    template: str
    slots: int

    def sample(self) -> SampleKey:
        return SampleKey(self.model, self.template, "pruned_random", self.slots)


@dataclass(frozen=True)
class Decision:
    """How ``auto`` serves one request."""

    path: AutoPath
    reason: str
    profile: StoredProfile | None = None
    """The profile placed by (``profile``), shown flat (``flat``), or checked (``explore``)."""
    key: LearnKey | None = None
    """Where the request's MoI runs are recorded (``moi`` while learning, ``explore``)."""
    learning_runs: int = 0
    """Runs pooled for this key so far (this replica's view)."""
    operator: bool = False
    """The profile was named by the request or the operator, and taken as given."""


@dataclass
class KeyStatus:
    """One key's state, as ``/info`` and the metrics report it."""

    key: LearnKey
    stored: StoredProfile | None = None
    pooled_runs: int = 0
    """Runs pooled at the last assessment."""
    last: ProfileTrust | None = None
    """The last assessment (stored or not)."""
    explore_runs: int = 0
    """Explore runs since the stored profile was trusted, at the last drift test."""
    assessed_at: float = 0.0
    """Monotonic time of the last assessment."""
    stamp: object = None
    """``ProfileStore.stamp`` of the stored profile when last read."""
    watermark: object = field(default_factory=object)
    """``RunSpool.watermark`` of the runs the last completed assessment saw (at first a
    value no spool returns): it is assessed again only once it moves."""

    @property
    def trusted(self) -> bool:
        return (
            self.stored is not None
            and self.stored.trust is not None
            and (self.stored.trust.trusted)
        )


def _outcomes() -> dict[ShadowOutcome, int]:
    return {"recorded": 0, "preempted": 0, "dropped": 0, "failed": 0, "expired": 0}


@dataclass
class LearnerCounters:
    """Totals the metrics export (event-loop thread only)."""

    paths: dict[AutoPath, int] = field(default_factory=lambda: dict.fromkeys(AUTO_PATHS, 0))
    recalibrations: dict[Recalibration, int] = field(
        default_factory=lambda: {"trusted": 0, "undecided": 0, "failed": 0}
    )
    drift_events: int = 0
    caller_capped: int = 0
    """Runs not kept because their caller already held its share (``auto_max_caller_share``)."""
    shadow_runs: dict[ShadowOutcome, int] = field(default_factory=_outcomes)
    """Explore runs by outcome."""
    learning_runs: dict[ShadowOutcome, int] = field(default_factory=_outcomes)
    """Background learning runs (requests served on the cold path) by outcome."""
    explore_skipped: int = 0
    """Requests drawn to explore while a background run was still pending or running: served
    by the profile without one (explore is sized to what the engine can run, not drawn and
    dropped)."""


class ProfileLearner:
    """Learns, trusts and watches the scoring model's profile for ``auto`` (module docstring).

    Args:
        settings: the ``auto_*`` settings and the profile folder.
        profiles: where trusted profiles are stored and read.
        root: the runs' folder (default ``<profiles_path>/auto``), for the folder store.
        replica: this process's file name in the shared folders (default: host, pid, random).
        allowed: whether a profile learned from the scoring model may place requests (false
            when the operator says the generator is another model and did not allow it).
        prepare: loads what the cheap path needs (the dense encoder); run once, in a worker
            thread, before the first trusted profile is used, so no request waits for it.
        state: where runs and locks are kept (default: the folder, ``root``); its
            ``profiles`` should be ``profiles``.
    """

    def __init__(
        self,
        settings: Settings,
        profiles: ProfileStore,
        *,
        root: Path | None = None,
        replica: str | None = None,
        allowed: bool = True,
        prepare: Callable[[], object] | None = None,
        state: StateStore | None = None,
    ) -> None:
        self.settings = settings
        self.profiles = profiles
        self.allowed = allowed
        self._prepare = prepare
        self._prepared = False
        self.rules = rules_of(settings)
        self.root = root or settings.profiles_path / "auto"
        name = replica or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.replica = name
        store = state or FolderState(settings.profiles_path, auto_root=self.root)
        self.locks = store.locks
        runs = store.spool("auto/runs", settings.auto_max_runs, name)
        explore = store.spool("auto/explore", settings.auto_max_runs, name)
        assert runs is not None and explore is not None  # every store keeps auto's runs
        self.runs: RunSpool = runs
        self.explore: RunSpool = explore
        self.counters = LearnerCounters()
        self._status: dict[LearnKey, KeyStatus] = {}
        self._recorded: dict[LearnKey, int] = {}
        """Runs this replica recorded per key since its pool was last read."""
        self._callers: dict[LearnKey, deque[tuple[float, str]]] = {}
        """Per key, the latest runs this replica kept: (monotonic time, caller)."""
        self._rng = np.random.default_rng(settings.seed)
        self._writer = ThreadPoolExecutor(1, "auto-spool")
        self._background = shared_worker(settings.auto_fit_nice)
        self._in_flight = 0
        """Assessments of this learner now in the background worker (``close`` ends them)."""
        self._wake: anyio.Event | None = None
        self._closed = False
        self.explore_rate = settings.auto_explore_rate
        self.shadow_backend: LogprobBackend | None = None
        """The engine behind no admission: explore runs use it in the background (set by the
        server once loaded; ``None``: an explore run uses the request's own backend)."""
        self.idle: Callable[[], bool] = lambda: True
        """Whether no request is using the engine now (the server's admission tells)."""
        self._shadow: _Pending | None = None
        self._shadow_wake: anyio.Event | None = None
        self.generator: GeneratorSampler | None = None
        """The generator's online sampler (``generator_url`` set; the server sets it): its
        trusted profile is placed by before any learned from the scorer."""
        self.outcomes: OutcomeMonitor | None = None
        """The randomized holdout and the uplift (``holdout_rate`` with feedback on; the
        server sets it)."""

    @classmethod
    def read_only(cls, settings: Settings, profiles: ProfileStore) -> ProfileLearner:
        """A learner that decides from the stored profiles alone, never explores and keeps
        nothing (the command line, a pipeline without the server's learner)."""
        learner = cls(settings, profiles, allowed=allowed_to_learn(settings))
        learner.explore_rate = 0.0
        learner._closed = True
        return learner

    # --- the request path (event-loop thread) ---------------------------------------

    def decide(
        self, model: str, template: str, n_passages: int, named: StoredProfile | None
    ) -> Decision:
        """How to serve a request of ``n_passages`` passages (module docstring). Cheap: a
        stored profile is read from disk once per key, then refreshed by ``run_forever``."""
        if named is not None:
            if named.trust is not None and named.trust.verdict == "flat":
                return Decision("flat", f"bias profile {named.id!r} is flat", named, operator=True)
            return Decision(
                "profile", f"bias profile {named.id!r}, named, taken as given", named,
                operator=True,
            )  # fmt: skip
        online = self.generator.placing(n_passages) if self.generator is not None else None
        if online is not None:
            # Measured on the generator itself (its answers): what a profile learned from the
            # scorer's log-probs only stands in for. Its drift is the sampler's refit.
            assert online.trust is not None
            path: AutoPath = "flat" if online.trust.verdict == "flat" else "profile"
            why = f"the generator's profile learned online from its answers: {online.trust.reason}"
            return Decision(path, why, online)
        slots = learning_slots(n_passages)
        if slots is None:
            return Decision(
                "moi", f"{n_passages} passage(s): too few to learn a position profile from"
            )
        if not self.allowed:
            return Decision(
                "moi",
                "the scoring model is not the generator (RAG_REORDER_GENERATOR_MODEL) and no "
                "generator profile is named (RAG_REORDER_PLACEMENT_PROFILE); a profile learned "
                "from the scorer is not used unless RAG_REORDER_AUTO_LEARN_FROM_SCORER is set",
            )
        key = LearnKey(model, template, slots)
        st = self._status.get(key)
        if st is None:
            st = self._status[key] = KeyStatus(key)
            self._reload(st)
        if st.trusted:
            prof = st.stored
            assert prof is not None and prof.trust is not None
            rate = self.explore_rate
            if rate > 0 and self._rng.random() < rate:
                if self._shadow is None:
                    return Decision(
                        "explore", f"explore share {rate:g}: checking {prof.id!r} for drift",
                        prof, key, st.pooled_runs,
                    )  # fmt: skip
                # The engine is still on the last background run: explore only as often as
                # it can be run, rather than draw runs that would be dropped.
                self.counters.explore_skipped += 1
            path = "flat" if prof.trust.verdict == "flat" else "profile"
            return Decision(path, prof.trust.reason, prof, key, st.pooled_runs)
        held = st.pooled_runs + self._recorded.get(key, 0)
        why = st.last.reason if st.last is not None else "no runs assessed yet"
        return Decision("moi", f"learning ({held} run(s)): {why}", st.stored, key, held)

    def count(self, path: AutoPath) -> None:
        """Count a request served by ``path`` (after it succeeded)."""
        self.counters.paths[path] += 1

    def record(
        self,
        decision: Decision,
        perms: np.ndarray,
        scores: np.ndarray,
        caller: str | None = None,
    ) -> bool:
        """Keep a MoI run of ``decision``'s key for learning (and, for ``explore``, for the
        drift test). Returns whether it was kept: runs with a failed prompt, a design other
        than the learning design's shape, or from a caller over its share, are not."""
        key = decision.key
        if key is None or self._closed:
            return False
        if perms.ndim != 2 or perms.shape[1] != key.slots or (perms < 0).any():
            return False
        if not np.isfinite(scores).all():
            return False  # a failed prompt: the run is not comparable to the others
        if not self._within_share(key, caller):
            self.counters.caller_capped += 1
            return False
        run = (perms.copy(), np.asarray(scores, dtype=np.float64).copy())
        at = time.time()
        self._writer.submit(self._append, self.runs, key, run, at)
        if decision.path == "explore":
            self._writer.submit(self._append, self.explore, key, run, at)
        self._recorded[key] = self._recorded.get(key, 0) + 1
        self._status.setdefault(key, KeyStatus(key))
        if self._wake is not None:
            self._wake.set()
        return True

    def _within_share(self, key: LearnKey, caller: str | None) -> bool:
        """Whether keeping a run of ``caller`` leaves it within ``auto_max_caller_share`` of
        ``key``'s recent runs on this replica; counts the run if so.

        The profile every caller is placed by must not be one caller's to shape, nor one
        caller's to reset by forcing a drift. The share is taken over the runs that decide
        those: the latest ``max(auto_min_runs, drift_min_runs)`` kept runs, each counting for
        ``auto_caller_window_s`` only (counts decay: an honest caller's old runs do not let
        another add as many in a row, and a caller seen once does not bound the rest for
        good). Every caller is bounded while another caller's run is in that window, the
        first included, and the window outlives a drift, so the caller that forced one is
        not "first" after it. A caller alone in it is bounded only with
        ``auto_bound_lone_caller`` (a deployment with one RAG backend learns from it alone).
        In memory, per replica: a restart forgets the counts, not the runs.
        """
        if caller is None:
            return True  # the command line, in-process calls: not a remote caller
        limit = max(self.rules.min_runs, self.rules.drift_min_runs)
        window = self._callers.get(key)
        if window is None:
            window = self._callers[key] = deque(maxlen=limit)
        now = time.monotonic()
        while window and now - window[0][0] > self.settings.auto_caller_window_s:
            window.popleft()
        share = self.settings.auto_max_caller_share
        mine = sum(1 for _, c in window if c == caller)
        alone = mine == len(window)
        # Half a run of slack: two callers at 0.5 take turns instead of blocking each other.
        if (not alone or self.settings.auto_bound_lone_caller) and (
            mine + 1 > share * (len(window) + 1) + 0.5
        ):
            return False
        window.append((now, caller))
        return True

    @property
    def background_free(self) -> bool:
        """Whether a background run (explore or learning) could be queued now."""
        return not self._closed and self._shadow is None and self._shadow_wake is not None

    def explore_later(self, decision: Decision, run: ShadowRun, caller: str | None = None) -> bool:
        """Queue an explore request's MoI run for the background (``run_shadows``): it runs
        when no request uses the engine and is cancelled if one starts to. At most one
        background run is held: a second while one waits or runs is dropped (``decide``
        draws explore only while none is, so that happens only to requests decided together).
        Returns whether it was queued."""
        return self._queue("explore", decision, run, caller)

    def learn_later(self, decision: Decision, run: ShadowRun, caller: str | None = None) -> bool:
        """Queue a learning run for the background, as ``explore_later`` does: the MoI run of
        a request served on the cold path (its MoI was estimated too slow for the caller to
        wait on). ``False``: a background run is already held (the next request queues one)."""
        if not self.background_free:
            return False
        return self._queue("learning", decision, run, caller)

    def _queue(
        self, kind: ShadowKind, decision: Decision, run: ShadowRun, caller: str | None
    ) -> bool:
        if not self.background_free:
            self._outcomes(kind)["dropped"] += 1
            return False
        assert self._shadow_wake is not None
        self._shadow = _Pending(kind, decision, run, caller, time.monotonic())
        self._shadow_wake.set()
        return True

    def _outcomes(self, kind: ShadowKind) -> dict[ShadowOutcome, int]:
        return self.counters.shadow_runs if kind == "explore" else self.counters.learning_runs

    def prior(self, model: str, template: str, n_passages: int) -> StoredProfile | None:
        """The best profile to place by while ``n_passages``' own is learned: a trusted
        learned profile of the same model and template for the nearest other slot count
        (``solver.place_ranking`` resamples it), else ``None``. In memory: no disk read."""
        slots = learning_slots(n_passages)
        best: tuple[int, StoredProfile] | None = None
        for st in self._status.values():
            k = st.key
            if k.model != model or k.template != template or k.slots == slots or not st.trusted:
                continue
            assert st.stored is not None
            gap = abs(k.slots - (slots or 0))
            if best is None or gap < best[0]:
                best = (gap, st.stored)
        return None if best is None else best[1]

    async def run_shadows(self) -> None:
        """Run queued background runs in the shadow of served answers until cancelled: each
        waits until the engine is idle (at most ``SHADOW_MAX_WAIT_S``), runs within
        ``request_timeout_s``, and is cancelled (``preempted``) as soon as a request starts
        using the engine, so it never delays one by more than a forward. Never raises."""
        self._shadow_wake = anyio.Event()
        while True:
            await self._shadow_wake.wait()
            self._shadow_wake = anyio.Event()
            pending = self._shadow
            if pending is None:
                continue
            try:
                await self._run_shadow(pending)
            except Exception:  # a failed background run must not end the loop
                log.exception("auto: a background %s run failed", pending.kind)
                self._outcomes(pending.kind)["failed"] += 1
            finally:
                self._shadow = None

    async def _run_shadow(self, pending: _Pending) -> None:
        decision, run, caller = pending.decision, pending.run, pending.caller
        outcomes = self._outcomes(pending.kind)
        while not self.idle():
            if time.monotonic() - pending.queued_at > SHADOW_MAX_WAIT_S:
                outcomes["expired"] += 1
                return
            await anyio.sleep(_IDLE_POLL_S)
        result: list[tuple[np.ndarray, np.ndarray]] = []
        failed: list[Exception] = []
        preempted = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal preempted
                while self.idle():
                    await anyio.sleep(_IDLE_POLL_S)
                preempted = True
                tg.cancel_scope.cancel()

            async def work() -> None:
                try:
                    # Its forwards yield to callers' and stay short (``background_work``).
                    with background_work(), anyio.fail_after(self.settings.request_timeout_s):
                        result.append(await run())
                except TimeoutError as exc:
                    log.warning(
                        "auto: a %s run did not finish within request_timeout_s = %g s",
                        pending.kind, self.settings.request_timeout_s,
                    )  # fmt: skip
                    failed.append(exc)
                except Exception as exc:  # a failed check must not end the loop
                    log.warning("auto: a %s run failed: %s", pending.kind, exc)
                    failed.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(work)
        if not result:
            outcomes["failed" if failed else "preempted"] += 1
            return
        kept = self.record(decision, *result[0], caller=caller)
        outcomes["recorded" if kept else "failed"] += 1

    def status(self) -> list[KeyStatus]:
        """Every key this replica has seen, sorted (for ``/info`` and the metrics)."""
        return [self._status[k] for k in sorted(self._status, key=_order)]

    # --- the background task --------------------------------------------------------

    async def run_forever(self) -> None:
        """Assess, store and watch every key's profile until cancelled; never raises
        (a failed cycle is logged and counted, and the next one tries again)."""
        self._wake = anyio.Event()
        interval = self.settings.auto_recalibrate_s
        while True:
            with anyio.move_on_after(interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            for key in list(self._status):
                try:
                    await self.cycle(key)
                except StateUnavailable as exc:
                    # The runs cannot be read now; the state store's own metric and log line
                    # say so, and the next cycle tries again.
                    log.debug("auto: %s not assessed: %s", key, exc)
                except Exception:
                    log.exception("auto: the profile of %s could not be assessed", key)
                    self.counters.recalibrations["failed"] += 1

    async def cycle(self, key: LearnKey) -> None:
        """One background step for ``key``: reload the stored profile; if runs arrived since
        the last assessment (and ``auto_recalibrate_s`` passed), test drift and reassess under
        the lock, storing what changed."""
        st = self._status.setdefault(key, KeyStatus(key))
        changed, stored = await anyio.to_thread.run_sync(self._read, st)
        if changed:
            if stored is not None and stored.trust is not None and stored.trust.trusted:
                await self.ready_ranker()  # before any request is placed by it
            st.stored = stored
        if time.monotonic() - st.assessed_at < self.settings.auto_recalibrate_s:
            return
        # Every run recorded until now is in the pool once the writer is flushed.
        recorded = self._recorded.get(key, 0)
        await anyio.to_thread.run_sync(lambda: self._writer.submit(lambda: None).result())
        # Gated on the pool's watermark, not its length: at auto_max_runs each new run pushes
        # the oldest out and the length stays put, and a key gated on it was never tested for
        # drift again (nor an undecided one reassessed). The watermark moves on every append.
        mark = await anyio.to_thread.run_sync(self.runs.watermark, key.sample())
        if mark == st.watermark:
            self._recorded[key] = self._recorded.get(key, 0) - recorded
            return
        since = st.stored.trust.learning_since if st.stored and st.stored.trust else None
        runs = await anyio.to_thread.run_sync(lambda: self.runs.runs(key.sample(), since=since))
        self._recorded[key] = self._recorded.get(key, 0) - recorded
        # Taken and given back in a worker thread: with Redis each is a network call.
        name, ttl = lock_name(key.model, key.template, key.slots), self.settings.auto_lock_ttl_s
        token = await anyio.to_thread.run_sync(self.locks.acquire, name, ttl)
        if token is None:
            return  # another replica assesses; its result is read on the next reload
        failed: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_lock, name, token, tg.cancel_scope)
                try:
                    await self._assess(st, runs)
                    # Only once assessed and stored: a failed store is tried again next cycle.
                    st.watermark = mark
                except Exception as exc:  # raised below as itself, not in an ExceptionGroup
                    failed = exc
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.locks.release, name, token)
        if failed is not None:
            raise failed

    async def _keep_lock(self, name: str, token: str, assessment: anyio.CancelScope) -> None:
        """Refresh the held lock every third of its expiry while an assessment runs, so a
        slow fit is not taken for a dead holder; if it was lost anyway, cancel the
        assessment before it stores (another replica may be assessing)."""
        ttl = self.settings.auto_lock_ttl_s
        while True:
            await anyio.sleep(ttl / 3)
            if not await anyio.to_thread.run_sync(self.locks.refresh, name, ttl, token):
                log.warning("auto: lost the assessment lock %s; this assessment stops", name)
                assessment.cancel()
                return

    async def _assess(self, st: KeyStatus, runs: list[Run]) -> None:
        """Reassess ``st``'s key from its pooled ``runs``.

        A trusted profile is held fixed while explore runs accumulate; once there are
        ``drift_min_runs`` of them (explore runs after its fit: none of them is in it, so
        the test compares independent fits), it is tested for drift. Without drift they are
        folded in: the profile is refitted on every pooled run and the next window starts.
        """
        key = st.key
        slots = 2 * key.slots  # the passages a placement by it orders (L = ceil(N / 2))
        # N = 2L - 1 shares the key (ceil(N / 2) = L): its placement must be as stable.
        odd = (slots - 1,) if slots - 1 >= MIN_PASSAGES else ()
        st.assessed_at = time.monotonic()
        st.pooled_runs = len(runs)
        prof = st.stored
        held = prof.trust if prof is not None and prof.trust is not None else None
        if prof is not None and held is not None and held.trusted:
            explore = await anyio.to_thread.run_sync(
                lambda: self.explore.runs(key.sample(), since=held.assessed_at)
            )
            st.explore_runs = len(explore)
            if len(explore) < self.rules.drift_min_runs:
                return
            result = await self._off_loop(
                trust_rules.drift,
                prof.coefficients,
                np.asarray(held.covariance),
                held.verdict,
                explore,
                placement_slots=slots,
                rules=self.rules,
            )
            if result.drifted:
                await self._drifted(st, result)
                return
        if not runs:
            return
        try:
            found = await self._off_loop(
                trust_rules.assess, runs, placement_slots=slots, rules=self.rules, also_slots=odd
            )
        except solver.SolverError as exc:
            log.warning("auto: %d run(s) of %s cannot be fitted: %s", len(runs), key, exc)
            self.counters.recalibrations["failed"] += 1
            return
        was_trusted = held is not None and held.trusted
        since = held.learning_since if held is not None else None
        trusted_since = held.trusted_since if was_trusted and held is not None else None
        st.last = trust = to_profile_trust(
            found, "traffic", since, trusted_since=trusted_since or time.time()
        )
        st.explore_runs = 0
        # Stores in a worker thread: a file write and fsync (a network volume can take long).
        store = partial(self._store, key, found, trust, len(runs))
        if found.trusted:
            self.counters.recalibrations["trusted"] += 1
            await self.ready_ranker()  # requests keep running MoI until the ranker is loaded
            st.stored = await anyio.to_thread.run_sync(store)
            if not was_trusted:
                log.info(
                    "auto: profile %s trusted after %d run(s): %s (%s)",
                    st.stored.id, len(runs), found.verdict, found.reason,
                )  # fmt: skip
        else:
            self.counters.recalibrations["undecided"] += 1
            if was_trusted:
                # More runs made it undecided: stop placing by it, on every replica.
                st.stored = await anyio.to_thread.run_sync(store)
                log.warning("auto: profile %s no longer trusted: %s", st.stored.id, found.reason)
        st.stamp = await anyio.to_thread.run_sync(
            self.profiles.stamp, key.model, key.template, key.slots
        )

    async def _drifted(self, st: KeyStatus, result: trust_rules.Drift) -> None:
        prof = st.stored
        assert prof is not None and prof.trust is not None
        now = time.time()
        self.counters.drift_events += 1
        log.warning(
            "auto: drift of profile %s (%s) from %d explore run(s); back to MoI until a new "
            "profile is trusted", prof.id, result.reason, result.runs,
        )  # fmt: skip
        reset = ProfileTrust(
            verdict="undecided",
            reason=f"drift: {result.reason}; learning again from new runs",
            runs=0,
            flat_p=prof.trust.flat_p,
            spread=prof.trust.spread,
            spread_upper=prof.trust.spread_upper,
            stability=prof.trust.stability,
            top_slots=prof.trust.top_slots,
            placement_slots=prof.trust.placement_slots,
            resamples=prof.trust.resamples,
            covariance=prof.trust.covariance,
            assessed_at=now,
            source="traffic",
            learning_since=now,
            trusted_since=None,
        )
        put = partial(
            self.profiles.put,
            model=prof.model,
            template=prof.template,
            coefficients=prof.coefficients,
            identification=prof.identification,
            runs=prof.runs,
            prompts=prof.prompts,
            r2=prof.r2,
            source=prof.source,
            oriented_by=prof.oriented_by,
            trust=reset,
        )
        st.stored = await anyio.to_thread.run_sync(put)  # a file write: off the event loop
        st.stamp = await anyio.to_thread.run_sync(
            self.profiles.stamp, prof.model, prof.template, prof.slots
        )
        st.last = reset
        st.pooled_runs = 0
        st.explore_runs = 0

    def _store(
        self, key: LearnKey, found: trust_rules.Trust, trust: ProfileTrust, runs: int
    ) -> StoredProfile:
        if not found.trusted:
            trust = replace(trust, trusted_since=None)
        return self.profiles.put(
            model=key.model,
            template=key.template,
            coefficients=[float(c) for c in found.coefficients],
            identification="full",
            runs=runs,
            prompts=runs * 2 * (2 * key.slots),  # approximate: M = 2N prompts per run
            r2=found.r2,
            source=f"learned by auto from {runs} live MoI run(s)",
            oriented_by="data",
            trust=trust,
        )

    def _reload(self, st: KeyStatus) -> None:
        """Read the stored profile again if its file changed (another replica stored it)."""
        changed, stored = self._read(st)
        if changed:
            st.stored = stored

    def _read(self, st: KeyStatus) -> tuple[bool, StoredProfile | None]:
        """Whether the stored profile changed since ``st`` read it, and what it holds now
        (``st.stamp`` is updated; ``st.stored`` is the caller's to set)."""
        stamp = self.profiles.stamp(st.key.model, st.key.template, st.key.slots)
        if stamp == st.stamp:
            return False, st.stored
        st.stamp = stamp
        try:
            return True, self.profiles.get(st.key.model, st.key.template, st.key.slots)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            pid = profile_id(st.key.model, st.key.template, st.key.slots)
            log.warning("auto: cannot read the stored profile %s: %s", pid, exc)
            return True, None

    async def ready_ranker(self) -> None:
        """Run ``prepare`` (load the cheap path's ranker) once, in a worker thread. A failure
        is logged; the cheap path then loads it on first use."""
        if self._prepare is None or self._prepared:
            return
        self._prepared = True
        try:
            await anyio.to_thread.run_sync(self._prepare, abandon_on_cancel=True)
        except Exception:
            log.exception("auto: the ranker could not be loaded; its first use will retry")

    async def ready_if_trusted(self) -> None:
        """At start: load the ranker if a trusted profile is already stored (a restart), so
        the first request placed by it does not wait for the load."""
        stored = await anyio.to_thread.run_sync(self.profiles.list)
        if any(p.trust is not None and p.trust.trusted for p in stored):
            await self.ready_ranker()

    def _lock(self, key: LearnKey) -> contextlib.AbstractContextManager[bool]:
        """Hold ``key``'s assessment lock for a block (blocks: tests and worker threads; the
        folder's is a file taken over once older than ``auto_lock_ttl_s``)."""
        name = lock_name(key.model, key.template, key.slots)
        return held(self.locks, name, self.settings.auto_lock_ttl_s)

    async def _off_loop(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` in the process's background worker (its own process at a
        lower priority: ``service.runtime.background`` says why not a thread) and await it.

        A worker that died under the call (killed, out of memory) is started again and the
        call tried once more, unless this learner closed: ``close`` ends its calls in flight
        instead of waiting seconds for a bootstrap nobody will read, and so does a cancelled
        call.
        """
        self._in_flight += 1
        try:
            try:
                return await self._background.run(fn, *args, **kwargs)
            except BrokenProcessPool:
                if self._closed:
                    raise
                log.warning("auto: the background worker ended under an assessment: again")
                return await self._background.run(fn, *args, **kwargs)
        except anyio.get_cancelled_exc_class():
            # Nobody will read it (a shutdown, a lost lock): end it rather than let it hold
            # the one worker the next assessment needs. On the event loop: no waiting.
            self._background.abandon(wait=False)
            raise
        finally:
            self._in_flight -= 1

    def _append(self, spool: RunSpool, key: LearnKey, run: Run, at: float) -> None:
        try:
            spool.append(key.sample(), run, at)
        except OSError as exc:  # a full or read-only volume must not fail requests
            log.warning("auto: could not keep a run in %s: %s", spool.where, exc)

    def close(self) -> None:
        """Finish pending appends (blocks); later runs are not kept; an assessment in flight
        is ended with the background worker (the next learner's call starts a new one)."""
        self._closed = True
        if self._in_flight:
            self._background.abandon()
        self._writer.shutdown(wait=True)


@dataclass(frozen=True)
class _Pending:
    """A background run waiting for, or holding, the engine's idle time."""

    kind: ShadowKind
    decision: Decision
    run: ShadowRun
    caller: str | None
    queued_at: float


def allowed_to_learn(settings: Settings) -> bool:
    """Whether ``auto`` may place by a profile learned from the scoring model: it is the
    generator (``generator_model`` unset or the same), or the operator allowed it."""
    gen = settings.generator_model
    return gen is None or gen == settings.model or settings.auto_learn_from_scorer


def rules_of(settings: Settings) -> trust_rules.TrustRules:
    """The trust thresholds the operator set (``auto_*``): what ``auto`` and every
    calibration judge a profile by, so both call the same profile trusted."""
    return trust_rules.TrustRules(
        alpha=settings.auto_alpha,
        min_stability=settings.auto_min_stability,
        flat_effect=settings.auto_flat_effect,
        min_runs=settings.auto_min_runs,
    )


def generator_rules_of(settings: Settings) -> trust_rules.TrustRules:
    """``rules_of`` for the generator's label-free profile: its top slots and the stability a
    trusted one keeps its own settings (``generator_top_slots``, ``generator_keep_stability``)."""
    return dataclasses.replace(
        rules_of(settings),
        top_slots=settings.generator_top_slots,
        keep_stability=settings.generator_keep_stability,
    )


def to_profile_trust(
    found: trust_rules.Trust,
    source: str,
    learning_since: float | None = None,
    *,
    trusted_since: float | None = None,
) -> ProfileTrust:
    """``solver.trust``'s figures as stored with a profile."""
    return ProfileTrust(
        verdict=found.verdict,
        reason=found.reason,
        runs=found.runs,
        flat_p=found.flat_p,
        spread=found.spread,
        spread_upper=found.spread_upper,
        stability=found.stability,
        top_slots=found.top_slots,
        placement_slots=found.placement_slots,
        resamples=found.resamples,
        covariance=tuple(tuple(float(v) for v in row) for row in found.covariance),
        assessed_at=time.time(),
        source=source,
        learning_since=learning_since,
        trusted_since=trusted_since if found.trusted else None,
    )


def _order(key: LearnKey) -> tuple[str, str, int]:
    return (key.model, key.template, key.slots)
