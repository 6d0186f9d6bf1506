"""The generator's position profile learned online, from its own answers to sampled live
requests, for ``auto`` (docs/generator-profile.md, "Online, from live traffic").

The label-free method of ``profile-generator --no-labels`` (``solver.blind_profile``), run on
live traffic: with ``generator_url`` and ``generator_model`` set, ``auto`` offers each request
it served (``GeneratorSampler.offer``, on the event loop: a random draw and a bounded append);
a share ``generator_sample_rate`` of them is queued, at most ``QUEUE_SIZE`` waiting (a full
queue drops the sample, counted), each caller within its share (``CallerShares``). In the
background (``run_forever``, never awaited by a request) each queued sample's passages are
placed in a random order the server drew (``SystemRandom``: nothing the caller sends seeds
it), the generator is asked once through the same budgeted client as the offline tool (every HTTP
attempt, retries included, counted against ``generator_max_calls_per_hour`` in a rolling hour:
a hard bound), and its answer is attributed to the passages that hold it
(``solver.blind_profile.attribute``). Only numbers are kept: the order shown and the answer's
weight per slot, in the state store's ``auto/generator`` spool (the profile folder, or Redis),
per passage count, so a restart and every replica pool them. The answer's text is dropped at
once. The caller's own order is never randomised: only the service's background call is.

As answers arrive the passage count's estimate is refitted (``fit_blind_profile``, auto's
trust thresholds, in the background worker process: ``service.runtime.background``; after
every answer up to 50, then once ``generator_refit_growth`` of the pool is new). A trusted
profile's newest ``generator_drift_window`` answers are tested against the older ones after
every answer (``solver.blind_profile.drift``); a drift withdraws it and the answers pooled
before are dropped (``_drifted``). Trusted
(``shaped``, or shown ``flat``), it is stored under the generator's name (identification
``answers-online``, trust source ``generator_online``) and ``auto`` places that passage
count by it (``placing``). A stored profile this sampler did not write (an operator's
``profile-generator`` run) is never overwritten; one it wrote that refits to ``undecided``
is stored as such, so every replica stops placing by it.

Answers also come by feedback (``POST /v1/feedback``, ``feedback``): with
``feedback_max_requests`` > 0 the served ``/v1/reorder`` requests are kept in the state store
(``ServedRequests``: any worker or replica that receives the feedback finds them) for a bounded
count, size and time, and the generator's answer to one is learned from the same way, but only
where the served order was a uniformly random placement (``shuffle``): an order chosen from
the passages' scores confounds a slot's pull with the passage's usefulness, so any other
strategy keeps its name only, to say so. Without ``generator_url`` nothing is sampled and
feedback is the only source.

Why here and not in ``offline`` with the offline tool: the server never imports ``offline``
(an import-linter contract), so the generator's client lives in ``service.backends.
generator_client``, which both use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.to_thread
import httpx
import numpy as np

from service.backends.transport.generator_client import (
    BudgetedClient,
    BudgetSpent,
    CallBudget,
    GeneratorEndpoint,
    api_key,
    parse_answer,
    public_url,
)
from service.config.settings import Settings
from service.errors import (
    AlreadyReported,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    StateUnavailable,
)
from service.learning.answer_likelihood import Likelihood, resolve_tie
from service.learning.outcomes import Arm, ArmDraw, OutcomeKey, OutcomeMonitor, Uplift
from service.passage import Passage
from service.prompting.prompts import api_prompt
from service.prompting.templates import get_template
from service.runtime.background import shared_worker
from service.state.expiring import ExpiringRecords, MemoryRecords, Scope
from service.state.profile_store import ProfileStore, ProfileTrust, StoredProfile
from service.state.traffic import RunSpool, SampleKey
from solver.blind_profile import (
    DEFAULT_THRESHOLD,
    Attribution,
    AttributionKind,
    BlindProfile,
    attribute,
    drift,
    fit_blind_profile,
    slot_weights,
)
from solver.trust import Drift, TrustRules, holds

log = logging.getLogger(__name__)

_T = TypeVar("_T")

QUEUE_SIZE = 8
"""Samples waiting for the generator; a sample drawn while this many wait is dropped."""
MAX_TOKENS = 32
"""Answer tokens asked for (``profile-generator``'s default): an answer, not an essay."""
RETRIES = 2
"""Retries of a call the generator refused before doing work (429, 503, no connection)."""
IDENTIFICATION = "answers-online"
TRUST_SOURCE = "generator_online"
_CHARS_PER_TOKEN = 4
FAILURES = ("unavailable", "timeout", "refused", "bad_answer", "budget", "error")
TOKEN_BYTES = 18
"""Random bytes of a served request's ``feedback_id`` (144 bits: never guessed)."""


RANDOM_PLACEMENTS = frozenset({"shuffle"})
"""Strategies whose served order is a uniformly random placement (seeded by the service):
feedback on them identifies the slots' pull, as the sampled calls' random orders do."""
_UNIDENTIFIED = (
    "the served order came from strategy {strategy!r}, not a random placement: a passage sits "
    "where it is because of how it was judged, so the slot an answer came from cannot be told "
    "from the passage's own usefulness; only 'shuffle' placements are used"
)


@dataclass(frozen=True)
class OutcomeTaken:
    """What ``POST /v1/feedback`` did with an outcome."""

    counted: bool
    arm: Arm | None
    reason: str
    uplift: Uplift | None = None
    """The key's uplift after it (``None``: not counted)."""


@dataclass(frozen=True)
class Feedback:
    """What ``POST /v1/feedback`` did with an answer and an outcome."""

    used: bool
    reason: str
    attribution: AttributionKind | None
    """How the answer was attributed (``None`` when not used)."""
    slots: tuple[int, ...]
    """The slots (0-based, as served) of the passages it was attributed to."""
    outcome: OutcomeTaken | None = None
    """``None``: no outcome was sent."""


def _learnable(served: ServedRequest) -> bool:
    return served.strategy in RANDOM_PLACEMENTS and served.slots >= 2


def _why_not(served: ServedRequest) -> str:
    if served.strategy not in RANDOM_PLACEMENTS:
        return _UNIDENTIFIED.format(strategy=served.strategy)
    return "one passage was shown: no slot to compare"


async def _count_outcome(
    served: ServedRequest, reward: float, outcomes: OutcomeMonitor | None
) -> OutcomeTaken:
    if served.arm is None or served.key is None:
        return OutcomeTaken(
            False,
            None,
            "not in auto's randomized holdout (another strategy or path, exempt, or the "
            "holdout off): nothing to compare it with",
        )
    if outcomes is None:
        return OutcomeTaken(False, served.arm, "the holdout is off on this server")
    up = await outcomes.report(served.key, served.arm, served.p_placed, served.p_control, reward)
    return OutcomeTaken(True, served.arm, f"counted in {served.key.label}", up)


@dataclass(frozen=True)
class ServedRequest:
    """A served request as ``POST /v1/feedback`` needs it: for a random placement, the query
    and the passages shown; for any other strategy, its name alone (no answer to it is
    learned from, so nothing else is kept)."""

    strategy: str
    slots: int
    """Passages shown (``top_n`` applied)."""
    query: str = ""
    shown: tuple[Passage, ...] = ()
    """The passages shown, in served order: ``shown[k]`` was in slot ``k`` (empty: not a
    random placement, not kept)."""
    arm: Arm | None = None
    """``auto``'s randomized holdout arm (``service.learning.outcomes``; ``None``: not in
    it), with the probabilities it was drawn with and its key: what an outcome needs."""
    p_placed: float = 0.0
    p_control: float = 0.0
    key: OutcomeKey | None = None
    reported: bool = False
    """A report was taken on it: what is left is this mark, so a second is a 409."""

    def dump(self) -> str:
        """The record kept (JSON text): the passages' titles and texts, all the prompt used,
        and the holdout's arm (numbers and the key's names: no passage for the outcome)."""
        d: dict[str, object] = {
            "strategy": self.strategy,
            "slots": self.slots,
            "query": self.query,
            "shown": [[p.title, p.text] for p in self.shown],
        }
        if self.arm is not None and self.key is not None:
            d["arm"] = [self.arm, self.p_placed, self.p_control]
            d["key"] = [self.key.model, self.key.template, self.key.passages]
        if self.reported:
            d = {"reported": True}
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def load(cls, record: str) -> ServedRequest:
        d = json.loads(record)
        if d.get("reported"):
            return cls("", 0, reported=True)
        shown = tuple(Passage(text=str(t), title=h) for h, t in d["shown"])
        arm, key = d.get("arm"), d.get("key")
        return cls(
            str(d["strategy"]),
            int(d["slots"]),
            str(d["query"]),
            shown,
            arm=arm[0] if arm else None,
            p_placed=float(arm[1]) if arm else 0.0,
            p_control=float(arm[2]) if arm else 0.0,
            key=OutcomeKey(str(key[0]), str(key[1]), int(key[2])) if key else None,
        )


class ServedRequests:
    """Served requests kept for ``POST /v1/feedback`` by response id, in ``records`` (the
    state store's ``served`` records: shared by every worker, and with Redis every replica;
    ``MemoryRecords``: this process only), bounded in count, bytes and time there. A random
    placement keeps its query and shown passages, any other strategy its name only.
    ``None``: feedback is off, nothing kept.

    Every call but a ``MemoryRecords``' runs in a thread: the folder's and Redis's block."""

    def __init__(self, records: ExpiringRecords | None, *, keep_passages: bool = True) -> None:
        self.records = records
        self.keep_passages = keep_passages
        """Whether a random placement keeps its query and passages: only where an answer to
        it can be learned from (the generator is another model than the scorer)."""

    @property
    def max_requests(self) -> int:
        return self.records.max_records if self.records is not None else 0

    @property
    def max_bytes(self) -> int:
        return self.records.max_bytes if self.records is not None else 0

    @property
    def ttl_s(self) -> float:
        return self.records.ttl_s if self.records is not None else 0.0

    @property
    def scope(self) -> Scope:
        return self.records.scope if self.records is not None else "process"

    async def keep(
        self, response_id: str, query: str, passages: Sequence[Passage], shown: Sequence[int],
        strategy: str, caller: str | None = None, arm: ArmDraw | None = None,
    ) -> str | None:  # fmt: skip
        """Keep one served request (``shown``: the passages' indices in served order) under
        its caller's name and a token the server makes (``record_key``); the oldest go first
        beyond the bounds. A holdout's shuffle is kept as a shuffle (a random placement).
        Returns the token (the response's ``feedback_id``), ``None`` if it is not kept;
        never raises."""
        if self.records is None:
            return None
        if arm is not None and arm.arm == "holdout" and arm.control == "shuffle":
            strategy = "shuffle"  # what served it: a uniformly random placement
        random_placement = self.keep_passages and strategy in RANDOM_PLACEMENTS and len(shown) >= 2
        served = ServedRequest(
            strategy,
            len(shown),
            query if random_placement else "",
            tuple(passages[i] for i in shown) if random_placement else (),
            arm=arm.arm if arm is not None else None,
            p_placed=arm.p_placed if arm is not None else 0.0,
            p_control=arm.p_control if arm is not None else 0.0,
            key=arm.key if arm is not None else None,
        )
        record = served.dump()
        # The token, not the response id (the caller's X-Request-Id when it sends one): an
        # id the caller chose or could guess would let it name records it was not given.
        token = secrets.token_urlsafe(TOKEN_BYTES)
        key = record_key(caller, token)
        kept = await self._call(lambda r: r.put(key, record))
        if not kept:
            log.warning(
                "served request %s not kept for feedback (%d bytes; the bound is %d bytes, "
                "or the state store is down)",
                response_id, len(record.encode()), self.max_bytes,
            )  # fmt: skip
        return token if kept else None

    async def claim(self, token: str, caller: str | None) -> ServedRequest:
        """Take the served request ``token`` for a report, leaving a mark that it was
        reported (bounded as every record): of reports racing on one token, in any worker,
        one gets it, and any later one is told it was reported.

        Raises:
            NotFound: unknown, another caller's, expired or evicted.
            AlreadyReported: reported on before.
            StateUnavailable: the state store cannot be reached.
        """
        key = record_key(caller, token)
        served = _parsed(await self._call(lambda r: r.take(key)))
        if served is None:
            raise NotFound("", param="id")
        mark = ServedRequest("", 0, reported=True).dump()
        await self._call(lambda r: r.put(key, mark))
        if served.reported:
            raise AlreadyReported(
                f"served request {token!r} was already reported on: one report per served "
                "request (send its outcome and the generator's answer together)",
                param="id",
            )
        return served

    async def get(self, response_id: str, caller: str | None = None) -> ServedRequest | None:
        """The request of that id kept for ``caller`` (``None``: unknown, another caller's,
        expired or evicted).

        Raises:
            StateUnavailable: the state store cannot be reached.
        """
        key = record_key(caller, response_id)
        record = await self._call(lambda r: r.get(key))
        return _parsed(record)

    async def take(self, response_id: str, caller: str | None = None) -> ServedRequest | None:
        """``get`` and forget it: of feedbacks racing on one id, in any worker, one gets it.

        Raises:
            StateUnavailable: the state store cannot be reached.
        """
        key = record_key(caller, response_id)
        record = await self._call(lambda r: r.take(key))
        return _parsed(record)

    async def held(self) -> tuple[int, int] | None:
        """``(requests, bytes)`` kept now (``None``: the state store cannot be reached)."""
        if self.records is None:
            return 0, 0
        try:
            return await self._call(lambda r: r.held())
        except StateUnavailable:
            return None

    async def _call(self, fn: Callable[[ExpiringRecords], _T]) -> _T | None:
        records = self.records
        if records is None:
            return None
        if isinstance(records, MemoryRecords):
            return fn(records)
        return await anyio.to_thread.run_sync(lambda: fn(records))


def record_key(caller: str | None, response_id: str) -> str:
    """The key a served request is kept under: its response id within its caller's names.

    The id is the caller's ``X-Request-Id`` when it sent one, so any caller can name any id:
    keyed by the id alone, a caller that knew or guessed another's id replaced that record
    with its own passages, or sent an answer on it, and so chose what was learned from the
    other's request. Scoped by the caller (``app.conversions.caller_of``: the gateway's
    header, else the client's address), another caller's id is simply unknown (404). The
    caller goes in as a fixed-length digest: no separator it could forge, no name stored.
    ``None`` (in-process callers) is a scope of its own."""
    if caller is None:
        return f"-:{response_id}"
    digest = hashlib.sha256(caller.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{digest}:{response_id}"


def _parsed(record: str | None) -> ServedRequest | None:
    if record is None:
        return None
    try:
        return ServedRequest.load(record)
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # not ours, or torn
        log.warning("unreadable served request record skipped: %s", exc)
        return None


@dataclass(frozen=True)
class _Sample:
    request_id: str
    query: str
    passages: tuple[Passage, ...]
    order: tuple[int, ...]
    """``order[k]``: the passage shown in slot ``k``."""


_HOUR_S = 3600.0


class CallerShares:
    """Per-caller bounds on the requests sampled for the generator (in memory, per process).

    - **The pooled answers**: per passage count, a caller may hold at most
      ``auto_max_caller_share`` of the latest ``window`` samples, each counting for
      ``auto_caller_window_s``, while another caller's sample is among them (alone too with
      ``auto_bound_lone_caller``): the rule ``auto``'s learner applies to its runs
      (``ProfileLearner._within_share``), so no caller shapes the profile every caller is
      placed by, nor resets it by forcing a drift.
    - **The hourly calls**: a caller may take at most ``generator_max_caller_calls_share`` of
      ``generator_max_calls_per_hour`` in any rolling hour (at least one), alone or not.

    A request without a caller (``None``: in-process) is not bounded."""

    def __init__(self, settings: Settings, window: int, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.window = window
        self._clock = clock
        self._recent: dict[int, deque[tuple[float, str]]] = {}
        self._hour: deque[tuple[float, str]] = deque()
        self._in_hour: Counter[str] = Counter()
        self.per_hour = max(
            1,
            math.floor(
                settings.generator_max_caller_calls_share * settings.generator_max_calls_per_hour
            ),
        )
        """Most samples of one caller in any rolling hour."""

    def admit(self, caller: str | None, slots: int) -> str | None:
        """``None`` and the sample counted if ``caller`` is within both bounds, else why not."""
        if caller is None:
            return None
        now = self._clock()
        while self._hour and now - self._hour[0][0] >= _HOUR_S:
            _, old = self._hour.popleft()
            self._in_hour[old] -= 1
            if self._in_hour[old] <= 0:
                del self._in_hour[old]
        capped = self.settings.generator_max_caller_calls_share < 1.0
        if capped and self._in_hour[caller] >= self.per_hour:
            return (
                f"caller over its {self.per_hour} sampled request(s) an hour "
                "(RAG_REORDER_GENERATOR_MAX_CALLER_CALLS_SHARE)"
            )
        recent = self._recent.get(slots)
        if recent is None:
            recent = self._recent[slots] = deque(maxlen=self.window)
        while recent and now - recent[0][0] > self.settings.auto_caller_window_s:
            recent.popleft()
        share = self.settings.auto_max_caller_share
        mine = sum(1 for _, c in recent if c == caller)
        alone = mine == len(recent)
        # Half a sample of slack, as the learner's: two callers at 0.5 take turns.
        if (not alone or self.settings.auto_bound_lone_caller) and (
            mine + 1 > share * (len(recent) + 1) + 0.5
        ):
            return "caller over its share of the recent samples (RAG_REORDER_AUTO_MAX_CALLER_SHARE)"
        recent.append((now, caller))
        self._hour.append((now, caller))
        self._in_hour[caller] += 1
        return None


@dataclass
class OnlineStatus:
    """What this replica knows of one passage count's online profile."""

    slots: int
    fit: BlindProfile | None = None
    """The last estimate (``None`` before the first answer this process saw or loaded)."""
    stored: StoredProfile | None = None
    """The stored profile of the generator for this passage count, if any."""
    read_at: float | None = None
    """Monotonic time ``stored`` was last read from the store."""
    kept: str | None = None
    """Why the trusted profile is still placed by though the last refit is undecided
    (``solver.trust.holds``); ``None`` when it is not so kept."""
    unfitted: int = 0
    """Answers this process pooled since its last refit (``generator_refit_growth``)."""
    drift: Drift | None = None
    """The last drift test of the trusted profile (``None``: none run since it was trusted)."""

    @property
    def placing(self) -> StoredProfile | None:
        """The stored profile ``auto`` places by: one with trusted figures."""
        s = self.stored
        return s if s is not None and s.trust is not None and s.trust.trusted else None


@dataclass
class GeneratorCounters:
    """Totals the metrics export (event-loop thread only)."""

    samples: dict[str, int] = field(
        default_factory=lambda: {"taken": 0, "dropped": 0, "over_budget": 0, "caller_capped": 0}
    )
    """Requests drawn for the generator: queued (``taken``), not queued because the queue was
    full (``dropped``), the hour's calls were spent (``over_budget``) or the caller held its
    share (``caller_capped``: ``CallerShares``)."""
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURES, 0))
    """Samples the generator did not answer, by why."""
    answers: dict[AttributionKind, int] = field(
        default_factory=lambda: {"contained": 0, "overlap": 0, "none": 0}
    )
    """Answers (sampled and fed back) by attribution: to the passages containing it, by
    token overlap, or none."""
    feedback: dict[str, int] = field(default_factory=lambda: {"used": 0, "unused": 0})
    """``POST /v1/feedback`` answers pooled (``used``), or not (``unused``: the served order
    was not a random placement)."""
    stored: int = 0
    """Profiles stored (trusted, or a trusted one of ours withdrawn)."""
    drift_events: int = 0
    """Trusted profiles withdrawn because their newest answers disagreed (``_drifted``)."""
    ties: dict[str, int] = field(default_factory=lambda: {"broken": 0, "split": 0})
    """Answers held by several passages: the tie broken by the scoring model's likelihood
    (``broken``), or the weight split among them (``split``: no scorer, or it failed)."""


class GeneratorSampler:
    """Samples ``auto``'s requests, asks the generator in the background and learns its
    profile (module docstring).

    Args:
        settings: ``generator_*`` and the trust thresholds' settings.
        profiles: where the learned profile is stored and read.
        spool: where the attributed answers are kept (the state store's ``auto/generator``).
        rules: the trust thresholds (``learner.rules_of(settings)``: auto's).
        transport: for tests; default: the network.
        environ: where the key variable is read (default ``os.environ``).
        clock: the budget's clock (tests move it).
        served: where served requests are kept for feedback (``StateStore.records``);
            default, with ``feedback_max_requests`` > 0: this process's memory.

    Raises:
        ValueError: ``generator_url`` set without ``generator_model``.
        InvalidRequest: ``generator_template`` is not a registered template.
    """

    def __init__(
        self,
        settings: Settings,
        profiles: ProfileStore,
        spool: RunSpool,
        rules: TrustRules,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        likelihood: Likelihood | None = None,
        served: ExpiringRecords | None = None,
    ) -> None:
        url, named = settings.generator_url, settings.generator_model
        if url is not None and named is None:
            raise ValueError("the generator's profile needs generator_model")
        self.learns_answers = named is not None and named != settings.model
        """Whether answers are learned from: only for a generator other than the scoring
        model. When they are one model (``generator_model`` unset or the same), ``auto``
        learns its profile from the log-probs it scores, and the sampler only keeps served
        requests for their outcomes (docs/outcomes.md)."""
        model = named if named is not None else settings.model
        self.settings = settings
        self.profiles = profiles
        self.spool = spool
        self.rules = rules
        self.model = model
        self.template = get_template(settings.generator_template)
        self.threshold = DEFAULT_THRESHOLD
        self.likelihood = likelihood
        """The tie-break's scorer (``service.learning.answer_likelihood``); ``None``: split."""
        named = settings.generator_api_key_env
        self.budget = CallBudget(per_hour=settings.generator_max_calls_per_hour, clock=clock)
        self.endpoint: GeneratorEndpoint | None = None
        """``None`` without ``generator_url``: no call, answers come by feedback only."""
        self._client: BudgetedClient | None = None
        if url is not None:
            self.endpoint = GeneratorEndpoint(
                base_url=url,
                model=model,
                api=settings.generator_api,
                api_key=api_key(url, named, os.environ if environ is None else environ),
                max_tokens=MAX_TOKENS,
                logprobs=False,
                timeout_s=settings.generator_timeout_s,
                retries=RETRIES,
                concurrency=1,
                key_hint=(
                    f"the variable {named}"
                    if named
                    else "OPENAI_API_KEY (https only), or name "
                    "another in RAG_REORDER_GENERATOR_API_KEY_ENV"
                ),
            )
            self._client = BudgetedClient(self.endpoint, None, transport, budget=self.budget)
        self.rate = settings.generator_sample_rate if url is not None else 0.0
        if served is None and settings.feedback_max_requests > 0:
            served = MemoryRecords(
                settings.feedback_max_requests, settings.feedback_max_bytes, settings.feedback_ttl_s
            )
        self.served = ServedRequests(served, keep_passages=self.learns_answers)
        """Served requests kept for ``POST /v1/feedback`` (none while it is off)."""
        self.counters = GeneratorCounters()
        # The draws and the orders shown come from the OS, never from anything a caller sends
        # (a request id, a seed): a caller that chose its ids picked the slot its passage was
        # shown in, and so the "profile" every caller is placed by (issue 90).
        self._rng = random.SystemRandom()
        self.callers = CallerShares(settings, settings.generator_drift_window, clock)
        self._queue: deque[_Sample] = deque()
        self._wake: anyio.Event | None = None
        self._status: dict[int, OnlineStatus] = {}
        # Spool reads and writes, attribution and stores: one thread, in order, at the
        # background worker's CPU priority (not 19: busy neighbours would starve it), so a
        # request's CPU work goes first. The fits run in the background worker itself.
        self._worker = ThreadPoolExecutor(
            1, "generator-online", initializer=_lower_priority, initargs=(settings.auto_fit_nice,)
        )
        self._background = shared_worker(settings.auto_fit_nice)
        self._closed = False
        self.busy = False
        """Whether a sample is being asked or fitted now."""

    @property
    def where(self) -> str | None:
        """The generator's URL without credentials, for ``/info`` and logs (``None``: no
        URL, feedback only)."""
        return public_url(self.endpoint.base_url) if self.endpoint is not None else None

    @property
    def calls(self) -> int:
        """HTTP attempts sent to the generator, retries included."""
        return self.budget.attempts

    @property
    def queued(self) -> int:
        return len(self._queue)

    # --- the request path (event-loop thread) ---------------------------------------

    def offer(
        self,
        request_id: str | None,
        query: str,
        passages: Sequence[Passage],
        caller: str | None = None,
    ) -> bool:
        """Draw whether a served request is also sent to the generator; queue it if so,
        within ``caller``'s share (``CallerShares``: ``auto``'s caller, the request's
        ``caller``). Cheap (a random draw, an append); never raises. Returns whether it was
        queued. The order shown is drawn by the server (``SystemRandom``), not seeded by
        ``request_id``: that only names the generator's call in its logs."""
        if self._closed or self.rate <= 0 or len(passages) < 2:
            return False
        if self._rng.random() >= self.rate:
            return False
        if self.budget.refused() is not None:
            self.counters.samples["over_budget"] += 1
            return False
        if len(self._queue) >= QUEUE_SIZE:
            self.counters.samples["dropped"] += 1
            return False
        if self.callers.admit(caller, len(passages)) is not None:
            self.counters.samples["caller_capped"] += 1
            return False
        rid = request_id or f"sample-{time.monotonic_ns():x}"
        order = list(range(len(passages)))
        self._rng.shuffle(order)
        self._queue.append(_Sample(rid, query, tuple(passages), tuple(order)))
        self.counters.samples["taken"] += 1
        if self._wake is not None:
            self._wake.set()
        return True

    def placing(self, n_passages: int) -> StoredProfile | None:
        """The generator's trusted profile for ``n_passages`` passages, or ``None``. The
        store is read at most once per ``state_refresh_s`` per passage count (the server's
        store answers from memory), so another replica's store is seen as soon. Always
        ``None`` when the scorer is the generator: its profile is the one ``auto`` learns."""
        if not self.learns_answers:
            return None
        st = self._status.get(n_passages)
        if st is None:
            st = self._status[n_passages] = OnlineStatus(n_passages)
        now = time.monotonic()
        if st.read_at is None or now - st.read_at >= self.settings.state_refresh_s:
            st.read_at = now
            try:
                st.stored = self.profiles.get(self.model, self.template.name, n_passages)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("generator profile for %d passages unreadable: %s", n_passages, exc)
        return st.placing

    def status(self) -> list[OnlineStatus]:
        """Every passage count seen, by count (``/info``)."""
        return [self._status[n] for n in sorted(self._status)]

    # --- the background -------------------------------------------------------------

    async def run_forever(self) -> None:
        """Ask, attribute and refit queued samples until cancelled; never raises. First the
        answers already pooled (a restart, other replicas) are fitted, so ``/info`` and
        ``auto`` know them before the first new sample."""
        self._wake = anyio.Event()
        if not self.learns_answers:
            # Outcomes only: no answer is pooled, no call is made (no URL), nothing to fit.
            await anyio.sleep_forever()
        try:
            await self._load()
        except Exception as exc:  # the pooled answers are read again at the next sample
            log.warning("generator answers pooled before start not read: %s", exc)
        while True:
            # Samples offered before this task started are asked first.
            while self._queue:
                sample = self._queue.popleft()
                self.busy = True
                try:
                    await self._ask(sample)
                except Exception:  # one bad sample must not end the loop
                    log.exception("generator sample %s failed", sample.request_id)
                    self.counters.failures["error"] += 1
                finally:
                    self.busy = False
            await self._wake.wait()
            self._wake = anyio.Event()

    async def _load(self) -> None:
        counts = await self._off_loop(self.spool.counts)
        for c in counts:
            k = c.key
            if k.model == self.model and k.template == self.template.name and k.design == "random":
                await self._refit(k.slots)

    async def _ask(self, sample: _Sample) -> None:
        assert self._client is not None  # offer queues nothing without a URL
        prompt = api_prompt(self.template, sample.query, sample.passages, sample.order)
        chars = len(prompt.text or "") + sum(len(m.content) for m in prompt.messages or ())
        failure: str | None = None
        try:
            data = await self._client.answer(
                prompt,
                tokens=chars // _CHARS_PER_TOKEN,
                request_id=f"{sample.request_id}-generator",
            )
            text = parse_answer(data)[0]
        except BudgetSpent:
            failure = "budget"
        except EngineTimeout:
            failure = "timeout"
        except EngineUnavailable as exc:
            failure = "unavailable"
            log.warning("generator sample: %s", exc.message)
        except InvalidRequest as exc:
            # A refusal (key, model, route) or an answer that is no completion: logged, since
            # retrying the next sample will not change it (the operator must).
            failure = "bad_answer" if "not an OpenAI completion" in exc.message else "refused"
            log.warning("generator sample: %s", exc.message)
        if failure is not None:
            self.counters.failures[failure] += 1
            return
        await self._learn(sample.query, sample.passages, sample.order, text)

    async def _learn(
        self, query: str, passages: Sequence[Passage], order: Sequence[int], answer: str
    ) -> Attribution:
        """Attribute ``answer`` to the passages shown in ``order`` (``order[k]``: the passage
        in slot ``k``), pool it and refit that slot count's estimate."""
        texts = [f"{passages[i].title or ''} {passages[i].text}" for i in order]
        found = await self._off_loop(
            lambda: attribute(answer, texts, question=query, threshold=self.threshold)
        )
        if len(found.passages) > 1:
            found = await resolve_tie(
                self.likelihood, found, query, texts, answer, where="generator answer"
            )
            self.counters.ties["broken" if found.tied else "split"] += 1
        # The answer's text goes no further: the order and the attributed slots are all the
        # estimate needs. ``found`` indexes the shown passages, slot by slot.
        self.counters.answers[found.kind] += 1
        n = len(order)
        weights = slot_weights([list(range(n))], [found.passages])[0]
        run = (np.asarray([order], dtype=np.int64), weights)
        await self._off_loop(lambda: self.spool.append(self._key(n), run, time.time()))
        self.placing(n)
        self._status[n].unfitted += 1
        await self._refit(n, force=False)
        return found

    async def feedback(
        self,
        response_id: str,
        answer: str | None,
        caller: str | None = None,
        *,
        outcome: float | None = None,
        outcomes: OutcomeMonitor | None = None,
    ) -> Feedback:
        """Count the ``outcome`` of a served request in its key's uplift (when it was in
        ``auto``'s randomized holdout, docs/outcomes.md), and learn from the generator's
        ``answer`` to it where its placement identifies the profile: only a uniformly random
        one (``shuffle``, or a holdout's shuffle), docs/generator-profile.md, "Feedback".
        One report per served request, but an answer alone on an order it cannot be learned
        from takes nothing.

        Raises:
            NotFound: feedback is off, or no served request of that id is kept for ``caller``
                (never served, served to another caller, already answered, or past
                ``feedback_ttl_s``, the latest ``feedback_max_requests`` or
                ``feedback_max_bytes``).
            StateUnavailable: the state store cannot be reached.
        """
        served = await self.served.get(response_id, caller)
        if served is None:
            raise NotFound(self._not_kept(response_id), param="id")
        if served.reported:
            raise AlreadyReported(
                f"served request {response_id!r} was already reported on: one report per "
                "served request (send its outcome and the generator's answer together)",
                param="id",
            )
        if outcome is None and answer is not None and not self._learnable(served):
            # An answer alone on an order it cannot be learned from: nothing is taken, so
            # the request's outcome can still be reported.
            self.counters.feedback["unused"] += 1
            return Feedback(False, self._why_not(served), None, ())
        # One report per served request: taken, so a report sent to two workers at once is
        # counted once, and a second is refused.
        try:
            served = await self.served.claim(response_id, caller)
        except NotFound:
            raise NotFound(self._not_kept(response_id), param="id") from None
        counted: OutcomeTaken | None = None
        if outcome is not None:
            counted = await _count_outcome(served, outcome, outcomes)
        if answer is None or not self._learnable(served):
            if answer is not None:
                self.counters.feedback["unused"] += 1
            return Feedback(False, self._why_not(served) if answer else "", None, (), counted)
        n = len(served.shown)
        found = await self._learn(served.query, served.shown, tuple(range(n)), answer)
        self.counters.feedback["used"] += 1
        return Feedback(
            True,
            f"placed uniformly at random ({served.strategy!r}): pooled with the sampled "
            "answers of this passage count",
            found.kind,
            tuple(sorted(found.passages)),
            counted,
        )

    def _learnable(self, served: ServedRequest) -> bool:
        return self.learns_answers and _learnable(served)

    def _why_not(self, served: ServedRequest) -> str:
        if not self.learns_answers:
            return (
                "the scoring model is the generator (RAG_REORDER_GENERATOR_MODEL unset or the "
                "same): auto learns its profile from the log-probs it scores, not from answers"
            )
        return _why_not(served)

    def _not_kept(self, response_id: str) -> str:
        s = self.served
        if s.max_requests == 0:
            return (
                f"no served request {response_id!r} is kept for feedback: feedback is off "
                "(RAG_REORDER_FEEDBACK_MAX_REQUESTS = 0)"
            )
        where = (
            " (kept by the worker that served it only: no state store)"
            if s.scope == "process"
            else ""
        )
        return (
            f"no served request {response_id!r} is kept for feedback{where}: unknown, served "
            "to another caller, already answered, or older than "
            f"RAG_REORDER_FEEDBACK_TTL_S = {s.ttl_s:g} s or the latest "
            f"RAG_REORDER_FEEDBACK_MAX_REQUESTS = {s.max_requests} or "
            f"RAG_REORDER_FEEDBACK_MAX_BYTES = {s.max_bytes} bytes"
        )

    def _key(self, n: int) -> SampleKey:
        # Full-length random placements of n passages: the design group "random".
        return SampleKey(self.model, self.template.name, "random", n)

    async def _refit(self, n: int, *, force: bool = True) -> None:
        """Test the trusted profile of ``n`` passages for drift on the newest answers, then
        refit the pool and store what changed; without ``force``, the refit only once
        ``generator_refit_growth`` of the pool arrived since the last one."""
        self.placing(n)  # the stored profile, as fresh as requests see it
        st = self._status[n]
        ours = st.stored is None or st.stored.identification == IDENTIFICATION
        # After a drift only the answers pooled since are this generator's now.
        since = (
            st.stored.trust.learning_since
            if ours and st.stored is not None and st.stored.trust is not None
            else None
        )
        try:
            runs = await self._off_loop(lambda: self.spool.runs(self._key(n), since=since))
        except StateUnavailable as exc:
            log.debug("generator answers of %d passages not read: %s", n, exc)
            return
        rows = [r[1] for r in runs if r[1].shape == (n,)]
        if not rows:
            return
        placing = st.placing
        window = self.settings.generator_drift_window
        if ours and placing is not None and placing.trust is not None and len(rows) >= 2 * window:
            held = placing.trust
            # The newest answers against the ones before them (independent sets), as auto's
            # explore runs are tested against its profile: refitted on the whole pool, a
            # reversed generator kept its old profile trusted for about 500 answers.
            st.drift = await self._background.run(
                drift,
                np.stack(rows[:-window]),
                np.stack(rows[-window:]),
                held=held.verdict,
                held_top=held.top_slots,
                placement_slots=n,
                rules=self.rules,
                seed=self.settings.seed,
            )
            if st.drift.drifted:
                await self._drifted(st, placing, st.drift)
                return
        due = max(1, math.ceil(self.settings.generator_refit_growth * len(rows)))
        if not force and st.unfitted < due:
            return
        st.unfitted = 0
        # The bootstrap in the background worker, a process: on this thread it would hold
        # the interpreter lock the event loop needs (service.runtime.background).
        fit = await self._background.run(
            fit_blind_profile,
            np.stack(rows),
            placement_slots=n,
            rules=self.rules,
            seed=self.settings.seed,
        )
        st.fit = fit
        kept, why = False, ""
        if ours and placing is not None and placing.trust is not None and not fit.trusted:
            # A hysteresis: refitted after every answer, a profile near the trust bar would
            # be withdrawn and trusted again answer after answer (solver.trust.holds).
            kept, why = holds(
                placing.trust.verdict, placing.trust.top_slots, flat_p=fit.flat_p,
                stability=fit.stability, top=fit.top_slots, rules=self.rules,
            )  # fmt: skip
        if kept and st.kept is None and placing is not None:
            log.info("generator profile %s %s (the refit: %s)", placing.id, why, fit.reason)
        st.kept = why if kept else None
        withdraw = placing is not None and not fit.trusted and not kept
        if not ours or not (fit.trusted or withdraw):
            return
        held_trust = st.stored.trust if st.stored is not None else None
        trusted = (
            held_trust.trusted_since if held_trust is not None and held_trust.trusted else None
        )
        if trusted is None or not fit.trusted:
            st.drift = None  # a new trusted profile is tested from its own answers on
        trust = dataclasses.replace(
            ProfileTrust.of_blind(
                fit,
                source=TRUST_SOURCE,
                trusted_since=(trusted or time.time()) if fit.trusted else None,
            ),
            learning_since=since,
        )
        st.stored = await self._off_loop(lambda: self._store(fit, trust, len(rows)))
        self.counters.stored += 1
        if withdraw:
            log.warning(
                "generator profile %s no longer trusted: %s; %s", st.stored.id, why, fit.reason
            )
        elif trusted is None:
            log.info(
                "generator profile %s trusted after %d answer(s): %s (%s)",
                st.stored.id, fit.questions, fit.verdict, fit.reason,
            )  # fmt: skip

    async def _drifted(self, st: OnlineStatus, placing: StoredProfile, found: Drift) -> None:
        """Withdraw ``placing`` (stored ``undecided``, on every replica) and pool only the
        answers from now on (``learning_since``), as ``auto``'s learner resets on drift."""
        assert placing.trust is not None
        now = time.time()
        self.counters.drift_events += 1
        log.warning(
            "generator profile %s drifted: its newest %d answer(s) %s; withdrawn, learned "
            "again from new answers only", placing.id, self.settings.generator_drift_window,
            found.reason,
        )  # fmt: skip
        reset = dataclasses.replace(
            placing.trust,
            verdict="undecided",
            reason=f"drift: the newest answers {found.reason}; learning again from new answers",
            runs=0,
            assessed_at=now,
            learning_since=now,
            trusted_since=None,
        )
        st.stored = await self._off_loop(
            lambda: self.profiles.put(
                model=placing.model,
                template=placing.template,
                coefficients=placing.coefficients,
                identification=IDENTIFICATION,
                runs=placing.runs,
                prompts=placing.prompts,
                r2=None,
                source=placing.source,
                oriented_by=placing.oriented_by,
                trust=reset,
            )
        )
        self.counters.stored += 1
        st.fit, st.kept, st.unfitted = None, None, 0

    def _store(self, fit: BlindProfile, trust: ProfileTrust, answers: int) -> StoredProfile:
        return self.profiles.put(
            model=self.model,
            template=self.template.name,
            coefficients=fit.coefficients,
            identification=IDENTIFICATION,
            runs=fit.questions,
            prompts=answers,
            r2=None,  # no prompt-scoring fit: answers, not log-probabilities
            source=(
                f"learned online from the generator's answers: {fit.questions} sampled "
                f"request(s) x {fit.slots} passages in random order, {fit.attributed:.1f} "
                f"attributed, {fit.verdict}"
            ),
            oriented_by="data",
            trust=trust,
        )

    async def _off_loop(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.wrap_future(self._worker.submit(fn))

    async def aclose(self) -> None:
        """Stop taking samples, finish the worker's writes, close the client."""
        self._closed = True
        self._queue.clear()
        await anyio.to_thread.run_sync(lambda: self._worker.shutdown(wait=True))
        if self._client is not None:
            await self._client.aclose()


def _lower_priority(nice: int) -> None:
    # Linux schedules threads individually: this one yields the CPU to request work.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
