"""Does placing help this generator? ``auto``'s randomized holdout, the outcomes callers report,
the uplift with an always-valid interval, and ``outcome_policy`` (docs/outcomes.md).

- **The arms.** ``auto``'s requests on a placed path (``profile``, ``flat``, ``explore``) of
  each key (scoring model, template, passage count) are served the control order with
  probability ``holdout_rate`` (``holdout_order``: the retriever's order, or a shuffle the
  server draws), the placement otherwise. The draw is ``SystemRandom``: nothing a caller
  sends (an ``X-Request-Id``, a seed, the passages) seeds it, so no caller picks its arm, nor
  another's. A caller may exempt a request (``holdout: false``): it is placed and not in the
  experiment. Only with ``feedback_max_requests`` > 0: without kept records no outcome can
  come back, and a holdout would then cost answers for nothing.
- **The outcomes.** ``POST /v1/feedback`` with ``outcome`` in [0, 1] on a served request's
  ``feedback_id``: its record (``ServedRequest``: the arm, its probabilities and the key, no
  passages for this) is taken from the state store, and one line of numbers (arm, reward,
  probabilities) is appended to the key's ``auto/outcomes`` spool, which every worker and
  replica reads.
- **The uplift.** Per key, the placed arm's mean outcome minus the control's, each outcome
  weighted by its arm's inverse probability (one bounded stream), with the betting confidence
  sequence of ``solver.confseq``: valid whenever it is read, after every outcome. The verdict
  (``Uplift.verdict``): ``hurts`` (upper bound below 0), ``no_difference`` (inside
  ``+-outcome_margin``), ``helps`` (lower bound above 0), else ``not_enough`` with the
  outcomes still needed at the current rate. Read again from the spool whenever it grew, at
  most every ``state_refresh_s``; a changed verdict is logged.
- **The policy.** ``outcome_policy`` ``act``: a key whose verdict is ``hurts`` or
  ``no_difference`` is served the retriever's order (``pass_through``, no ranking cost) but
  for a placed share ``outcome_placed_share`` (and the holdout, if its order is a shuffle),
  so that a later change is seen; the verdict moving back switches it back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Literal

import anyio.to_thread
import numpy as np

from service.config.settings import Settings
from service.errors import StateUnavailable
from service.state.traffic import RunSpool, SampleKey
from solver.confseq import confidence_sequence, ipw_stream

log = logging.getLogger(__name__)

Arm = Literal["placed", "holdout", "pass_through"]
ARMS: tuple[Arm, ...] = ("placed", "holdout", "pass_through")
Verdict = Literal["helps", "hurts", "no_difference", "not_enough"]
VERDICTS: tuple[Verdict, ...] = ("helps", "hurts", "no_difference", "not_enough")
PLACED_PATHS = frozenset({"profile", "flat", "explore"})
"""``auto``'s paths that place by a trusted profile: the ones the holdout measures."""
_ARM_CODE: dict[Arm, int] = {"placed": 0, "holdout": 1, "pass_through": 2}
CHEAP_OUTCOMES = 1000
"""Up to this many outcomes a key's uplift is recomputed after every one; beyond, at most
once per ``state_refresh_s`` per worker. The sequence is recomputed over the whole kept stream
(401 candidate values each): 0.04 / 0.16 / 0.29 s of a core at 1,000 / 10,000 / 20,000
outcomes on the 2-core development machine under load, in a thread off the event loop."""


@dataclass(frozen=True)
class OutcomeKey:
    """What an uplift is measured for: one scoring model, template and passage count."""

    model: str
    template: str
    passages: int

    @property
    def label(self) -> str:
        return f"{self.model}|{self.template}|{self.passages}"

    def sample(self) -> SampleKey:
        # The spool's key type; its design group is unused here (always "random").
        return SampleKey(self.model, self.template, "random", self.passages)


@dataclass(frozen=True)
class ArmDraw:
    """Which arm served one request, with the probabilities it was drawn with."""

    arm: Arm
    control: Literal["retriever", "shuffle"]
    """The order a ``holdout`` arm serves (``pass_through`` serves the retriever's)."""
    p_placed: float
    p_control: float
    """The probability of the arm the uplift compares with (the holdout's order)."""
    key: OutcomeKey
    reason: str
    passing: bool = False
    """Drawn while ``outcome_policy`` ``act`` passes the key through."""


@dataclass
class Uplift:
    """One key's uplift, as ``/info`` and the metrics show it."""

    key: OutcomeKey
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ARMS, 0))
    estimate: float = 0.0
    lower: float = -1.0
    upper: float = 1.0
    verdict: Verdict = "not_enough"
    needed: int | None = None
    """Outcomes more the interval needs to reach a verdict at its current width's pace
    (``None``: decided, or no outcome yet)."""
    eta_s: float | None = None
    """Seconds those take at the rate outcomes arrived so far (``None``: unknown)."""
    pass_through: bool = False
    """``outcome_policy`` ``act`` serves this key the retriever's order (bar the placed share)."""
    watermark: object = None

    @property
    def reason(self) -> str:
        n = sum(self.outcomes.values())
        return (
            f"uplift {self.estimate:+.3f} in [{self.lower:+.3f}, {self.upper:+.3f}] after {n} "
            f"outcome(s) ({self.outcomes['placed']} placed, {self.outcomes['holdout']} holdout): "
            f"{self.verdict}"
        )


def verdict_of(lower: float, upper: float, margin: float) -> Verdict:
    """The verdict of an interval (module docstring)."""
    if upper < 0:
        return "hurts"
    if lower > -margin and upper < margin:
        return "no_difference"
    if lower > 0:
        return "helps"
    return "not_enough"


def needed_outcomes(n: int, estimate: float, lower: float, upper: float, margin: float) -> int:
    """Outcomes more until the interval could decide, at its current width's pace (a width
    shrinking as 1/sqrt(n)): half-width below |estimate| (helps/hurts) or below margin -
    |estimate| (no difference), whichever comes first."""
    half = max((upper - lower) / 2, 1e-9)
    target = max(abs(estimate), margin - abs(estimate), 1e-3)
    if half <= target:
        return 1
    return max(1, math.ceil(n * (half / target) ** 2) - n)


class OutcomeMonitor:
    """The holdout's draws, the outcomes' spool and each key's uplift (module docstring).

    Args:
        settings: ``holdout_*``, ``outcome_*`` and ``state_refresh_s``.
        spool: the state store's ``auto/outcomes`` spool (every worker and replica's).
    """

    def __init__(self, settings: Settings, spool: RunSpool) -> None:
        self.settings = settings
        self.spool = spool
        # The OS's randomness: never seeded by the request, so no caller chooses its arm.
        self._rng = random.SystemRandom()
        self._uplift: dict[OutcomeKey, Uplift] = {}
        self._read_at: dict[OutcomeKey, float] = {}
        self._computed_at: dict[OutcomeKey, float] = {}
        self._first_seen: dict[OutcomeKey, tuple[float, int]] = {}
        self.switches = 0
        """Times ``act`` switched a key to pass-through or back (this process)."""
        self.drawn: dict[str, int] = dict.fromkeys(ARMS, 0)
        self.drawn["exempt"] = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.settings.holdout_rate > 0 and self.settings.feedback_max_requests > 0

    # --- the request path (event loop) ----------------------------------------------

    def draw(self, key: OutcomeKey, *, exempt: bool) -> ArmDraw | None:
        """The arm of one ``auto`` request on a placed path (``None``: not in the experiment:
        the holdout off, or ``exempt``). Cheap; never blocks (the verdict is the last read)."""
        if not self.enabled:
            return None
        if exempt:
            self.drawn["exempt"] += 1
            return None
        s = self.settings
        up = self._uplift.get(key)
        self._refresh_later(key)
        h = s.holdout_rate
        u = self._rng.random()
        if up is not None and up.pass_through:
            keep = s.outcome_placed_share
            # The holdout's shuffle stays measured beside the kept placed share; a
            # retriever-order holdout is the pass-through itself.
            shuffle = s.holdout_order == "shuffle"
            p_control = h if shuffle else 1.0 - keep
            why = f"outcome_policy act: {up.reason}"
            if u < keep:
                arm: Arm = "placed"
                reason = f"{why}; drawn into the placed share kept to watch it ({keep:g})"
            elif shuffle and u < keep + h:
                arm, reason = "holdout", f"{why}; randomized holdout ({h:g}): a shuffle"
            else:
                arm = "pass_through" if shuffle else "holdout"
                reason = f"{why}: served the retriever's order, no ranking"
            draw = ArmDraw(arm, s.holdout_order, keep, p_control, key, reason, passing=True)
        elif u < h:
            draw = ArmDraw(
                "holdout", s.holdout_order, 1.0 - h, h, key,
                f"randomized holdout (RAG_REORDER_HOLDOUT_RATE = {h:g}): served "
                + ("the retriever's order" if s.holdout_order == "retriever" else "a shuffle")
                + " instead of the placement, to measure the placement's uplift",
            )  # fmt: skip
        else:
            draw = ArmDraw("placed", s.holdout_order, 1.0 - h, h, key, "")
        self.drawn[draw.arm] += 1
        return draw

    # --- outcomes --------------------------------------------------------------------

    async def report(
        self, key: OutcomeKey, arm: Arm, p_placed: float, p_control: float, reward: float
    ) -> Uplift:
        """Append one outcome to the key's spool and return the key's uplift read after it.

        Raises:
            StateUnavailable: the spool cannot be written or read.
        """
        code = _ARM_CODE[arm]
        run = (
            np.asarray([[code]], dtype=np.int64),
            np.asarray([reward, p_placed, p_control], dtype=np.float64),
        )
        await anyio.to_thread.run_sync(lambda: self.spool.append(key.sample(), run, time.time()))
        return await self.refresh(key)

    async def refresh(self, key: OutcomeKey) -> Uplift:
        """Read the key's outcomes again if any worker appended one, and recompute; past
        ``CHEAP_OUTCOMES`` outcomes at most once per ``state_refresh_s`` (the last
        computed uplift is returned between)."""
        now = time.monotonic()
        self._read_at[key] = now
        held = self._uplift.get(key)
        if (
            held is not None
            and sum(held.outcomes.values()) >= CHEAP_OUTCOMES
            and now - self._computed_at.get(key, -math.inf) < self.settings.state_refresh_s
        ):
            return held
        self._computed_at[key] = now
        return await anyio.to_thread.run_sync(lambda: self._recompute(key))

    def _recompute(self, key: OutcomeKey) -> Uplift:
        held = self._uplift.get(key)
        mark = self.spool.watermark(key.sample())
        if held is not None and held.watermark == mark:
            return held
        runs = self.spool.runs(key.sample())
        rows = [(int(p[0, 0]), s) for p, s in runs if p.shape == (1, 1) and s.shape == (3,)]
        up = Uplift(key, watermark=mark)
        if rows:
            arm = np.asarray([r[0] for r in rows])
            vals = np.stack([r[1] for r in rows])
            for name, code in _ARM_CODE.items():
                up.outcomes[name] = int((arm == code).sum())
            z, lo, hi = ipw_stream(vals[:, 0], arm, vals[:, 1], vals[:, 2])
            cs = confidence_sequence(z, lo, hi, self.settings.outcome_alpha)
            margin = self.settings.outcome_margin
            up.estimate, up.lower, up.upper = cs.estimate, cs.lower, cs.upper
            up.verdict = verdict_of(cs.lower, cs.upper, margin)
            if up.verdict == "not_enough":
                up.needed = needed_outcomes(cs.n, cs.estimate, cs.lower, cs.upper, margin)
                first = self._first_seen.setdefault(key, (time.monotonic(), cs.n))
                span, grown = time.monotonic() - first[0], cs.n - first[1]
                if grown > 0 and span > 0:
                    up.eta_s = up.needed * span / grown
        before = held.verdict if held is not None else "not_enough"
        was = held.pass_through if held is not None else False
        up.pass_through = self.settings.outcome_policy == "act" and up.verdict in (
            "hurts",
            "no_difference",
        )
        if up.verdict != before:
            log.warning("auto outcomes of %s: verdict %s -> %s (%s)", key.label, before,
                        up.verdict, up.reason)  # fmt: skip
        if up.pass_through != was:
            self.switches += 1
            log.warning(
                "auto outcomes of %s: outcome_policy act %s (%s)", key.label,
                "serves the retriever's order" if up.pass_through else "places again",
                up.reason,
            )  # fmt: skip
        self._uplift[key] = up
        return up

    def _refresh_later(self, key: OutcomeKey) -> None:
        """Another worker's outcomes reach this one's verdict within ``state_refresh_s``."""
        now = time.monotonic()
        at = self._read_at.get(key)
        if at is not None and now - at < self.settings.state_refresh_s:
            return
        self._read_at[key] = now
        if key not in self._uplift:
            self._uplift[key] = Uplift(key)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._quiet_refresh(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quiet_refresh(self, key: OutcomeKey) -> None:
        try:
            await self.refresh(key)
        except StateUnavailable as exc:
            log.debug("auto outcomes of %s not read: %s", key.label, exc)

    def status(self) -> list[Uplift]:
        """Every key seen by this process, by label (``/info``, metrics)."""
        return [self._uplift[k] for k in sorted(self._uplift, key=lambda k: k.label)]

    async def load(self) -> None:
        """Read every key's outcomes in the spool (at start: a restart, other replicas)."""
        counts = await anyio.to_thread.run_sync(self.spool.counts)
        for c in counts:
            k = c.key
            await self.refresh(OutcomeKey(k.model, k.template, k.slots))

    async def run_forever(self) -> None:
        """Read every key's outcomes at start, then each known key's again every
        ``state_refresh_s`` (the other workers' and replicas' outcomes; ``act``'s switch)
        until cancelled; never raises."""
        try:
            await self.load()
        except Exception as exc:  # read again at the next round
            log.warning("auto outcomes pooled before start not read: %s", exc)
        while True:
            await anyio.sleep(self.settings.state_refresh_s)
            for key in list(self._uplift):
                try:
                    await self.refresh(key)
                except StateUnavailable as exc:
                    log.debug("auto outcomes of %s not read: %s", key.label, exc)
