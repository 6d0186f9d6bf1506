"""The generator's position profile learned online, from its own answers to sampled live
requests, for ``auto`` (docs/generator-profile.md, "Online, from live traffic").

The label-free method of ``profile-generator --no-labels`` (``solver.blind_profile``), run on
live traffic: with ``generator_url`` and ``generator_model`` set, ``auto`` offers each request
it served (``GeneratorSampler.offer``, on the event loop: a random draw and a bounded append);
a share ``generator_sample_rate`` of them is queued, at most ``QUEUE_SIZE`` waiting (a full
queue drops the sample, counted). In the background (``run_forever``, never awaited by a
request) each queued sample's passages are placed in a random order seeded by the request id,
the generator is asked once through the same budgeted client as the offline tool (every HTTP
attempt, retries included, counted against ``generator_max_calls_per_hour`` in a rolling hour:
a hard bound), and its answer is attributed to the passages that hold it
(``solver.blind_profile.attribute``). Only numbers are kept: the order shown and the answer's
weight per slot, in the state store's ``auto/generator`` spool (the profile folder, or Redis),
per passage count, so a restart and every replica pool them. The answer's text is dropped at
once. The caller's own order is never randomised: only the service's background call is.

After each answer the passage count's estimate is refitted (``fit_blind_profile``, auto's
trust thresholds, on a low-priority thread). Trusted (``shaped``, or shown ``flat``), it is
stored under the generator's name (identification ``answers-online``, trust source
``generator_online``) and ``auto`` places that passage count by it (``placing``). A stored
profile this sampler did not write (an operator's ``profile-generator`` run) is never
overwritten; one it wrote that refits to ``undecided`` is stored as such, so every replica
stops placing by it.

Why here and not in ``offline`` with the offline tool: the server never imports ``offline``
(an import-linter contract), so the generator's client lives in ``service.backends.
generator_client``, which both use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.to_thread
import httpx
import numpy as np

from service.backends.generator_client import (
    BudgetedClient,
    BudgetSpent,
    CallBudget,
    GeneratorEndpoint,
    api_key,
    parse_answer,
    public_url,
)
from service.config.settings import Settings
from service.errors import EngineTimeout, EngineUnavailable, InvalidRequest, StateUnavailable
from service.passage import Passage
from service.prompting.prompts import api_prompt
from service.prompting.templates import get_template
from service.state.profile_store import ProfileStore, ProfileTrust, StoredProfile
from service.state.traffic import RunSpool, SampleKey
from solver.blind_profile import (
    DEFAULT_THRESHOLD,
    AttributionKind,
    BlindProfile,
    attribute,
    fit_blind_profile,
    slot_weights,
)
from solver.trust import TrustRules

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


@dataclass(frozen=True)
class _Sample:
    request_id: str
    query: str
    passages: tuple[Passage, ...]
    order: tuple[int, ...]
    """``order[k]``: the passage shown in slot ``k``."""


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

    @property
    def placing(self) -> StoredProfile | None:
        """The stored profile ``auto`` places by: one with trusted figures."""
        s = self.stored
        return s if s is not None and s.trust is not None and s.trust.trusted else None


@dataclass
class GeneratorCounters:
    """Totals the metrics export (event-loop thread only)."""

    samples: dict[str, int] = field(
        default_factory=lambda: {"taken": 0, "dropped": 0, "over_budget": 0}
    )
    """Requests drawn for the generator: queued (``taken``), not queued because the queue was
    full (``dropped``) or the hour's calls were spent (``over_budget``)."""
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURES, 0))
    """Samples the generator did not answer, by why."""
    answers: dict[AttributionKind, int] = field(
        default_factory=lambda: {"contained": 0, "overlap": 0, "none": 0}
    )
    """Answers by attribution: to the passages containing it, by token overlap, or none."""
    stored: int = 0
    """Profiles stored (trusted, or a trusted one of ours withdrawn)."""


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

    Raises:
        ValueError: ``generator_url`` or ``generator_model`` unset.
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
    ) -> None:
        url, model = settings.generator_url, settings.generator_model
        if url is None or model is None:
            raise ValueError("the generator sampler needs generator_url and generator_model")
        self.settings = settings
        self.profiles = profiles
        self.spool = spool
        self.rules = rules
        self.model = model
        self.template = get_template(settings.generator_template)
        self.threshold = DEFAULT_THRESHOLD
        named = settings.generator_api_key_env
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
        self.budget = CallBudget(per_hour=settings.generator_max_calls_per_hour, clock=clock)
        self._client = BudgetedClient(self.endpoint, None, transport, budget=self.budget)
        self.rate = settings.generator_sample_rate
        self.counters = GeneratorCounters()
        self._rng = random.Random(settings.seed)
        self._queue: deque[_Sample] = deque()
        self._wake: anyio.Event | None = None
        self._status: dict[int, OnlineStatus] = {}
        # Spool reads and writes, fits and stores: one thread, in order, at the lowest CPU
        # priority, so neither the event loop nor a request's CPU work waits for them.
        self._worker = ThreadPoolExecutor(1, "generator-online", initializer=_lowest_priority)
        self._closed = False
        self.busy = False
        """Whether a sample is being asked or fitted now."""

    @property
    def where(self) -> str:
        """The generator's URL without credentials, for ``/info`` and logs."""
        return public_url(self.endpoint.base_url)

    @property
    def calls(self) -> int:
        """HTTP attempts sent to the generator, retries included."""
        return self.budget.attempts

    @property
    def queued(self) -> int:
        return len(self._queue)

    # --- the request path (event-loop thread) ---------------------------------------

    def offer(self, request_id: str | None, query: str, passages: Sequence[Passage]) -> bool:
        """Draw whether a served request is also sent to the generator; queue it if so.
        Cheap (a random draw, an append); never raises. Returns whether it was queued."""
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
        rid = request_id or f"sample-{time.monotonic_ns():x}"
        order = list(range(len(passages)))
        random.Random(zlib.crc32(f"generator:{self.settings.seed}:{rid}".encode())).shuffle(order)
        self._queue.append(_Sample(rid, query, tuple(passages), tuple(order)))
        self.counters.samples["taken"] += 1
        if self._wake is not None:
            self._wake.set()
        return True

    def placing(self, n_passages: int) -> StoredProfile | None:
        """The generator's trusted profile for ``n_passages`` passages, or ``None``. The
        store is read at most once per ``state_refresh_s`` per passage count (the server's
        store answers from memory), so another replica's store is seen as soon."""
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
        texts = [f"{p.title or ''} {p.text}" for p in sample.passages]
        found = await self._off_loop(
            lambda: attribute(text, texts, question=sample.query, threshold=self.threshold)
        )
        # The answer's text goes no further: the order and the attributed slots are all the
        # estimate needs.
        self.counters.answers[found.kind] += 1
        n = len(sample.order)
        weights = slot_weights([sample.order], [found.passages])[0]
        run = (np.asarray([sample.order], dtype=np.int64), weights)
        await self._off_loop(lambda: self.spool.append(self._key(n), run, time.time()))
        await self._refit(n)

    def _key(self, n: int) -> SampleKey:
        # Full-length random placements of n passages: the design group "random".
        return SampleKey(self.model, self.template.name, "random", n)

    async def _refit(self, n: int) -> None:
        self.placing(n)  # the stored profile, as fresh as requests see it
        st = self._status[n]
        try:
            runs = await self._off_loop(lambda: self.spool.runs(self._key(n)))
        except StateUnavailable as exc:
            log.debug("generator answers of %d passages not read: %s", n, exc)
            return
        rows = [r[1] for r in runs if r[1].shape == (n,)]
        if not rows:
            return
        fit = await self._off_loop(
            lambda: fit_blind_profile(
                np.stack(rows), placement_slots=n, rules=self.rules, seed=self.settings.seed
            )
        )
        st.fit = fit
        ours = st.stored is None or st.stored.identification == IDENTIFICATION
        withdraw = st.placing is not None and not fit.trusted
        if not ours or not (fit.trusted or withdraw):
            return
        held = st.stored.trust if st.stored is not None else None
        since = held.trusted_since if held is not None and held.trusted else None
        trust = _trust(fit, trusted_since=(since or time.time()) if fit.trusted else None)
        st.stored = await self._off_loop(lambda: self._store(fit, trust, len(rows)))
        self.counters.stored += 1
        if withdraw:
            log.warning("generator profile %s no longer trusted: %s", st.stored.id, fit.reason)
        elif since is None:
            log.info(
                "generator profile %s trusted after %d answer(s): %s (%s)",
                st.stored.id, fit.questions, fit.verdict, fit.reason,
            )  # fmt: skip

    def _store(self, fit: BlindProfile, trust: ProfileTrust, answers: int) -> StoredProfile:
        return self.profiles.put(
            model=self.model,
            template=self.template.name,
            coefficients=fit.coefficients,
            identification=IDENTIFICATION,
            runs=fit.questions,
            prompts=answers,
            r2=float("nan"),
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
        await self._client.aclose()


def _trust(fit: BlindProfile, *, trusted_since: float | None) -> ProfileTrust:
    return ProfileTrust(
        verdict=fit.verdict,
        reason=fit.reason,
        runs=round(fit.attributed),
        flat_p=fit.flat_p,
        spread=fit.spread,
        spread_upper=fit.spread_upper,
        stability=fit.stability,
        top_slots=fit.top_slots,
        placement_slots=fit.placement_slots,
        resamples=fit.resamples,
        covariance=fit.covariance,
        assessed_at=time.time(),
        source=TRUST_SOURCE,
        trusted_since=trusted_since,
    )


def _lowest_priority() -> None:
    # Linux schedules threads individually: this one yields the CPU to request work.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
