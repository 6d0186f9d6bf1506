"""The serving process's one typed context (on the app's ``state.ctx``) and the lifecycle the
probes report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
from starlette.types import Scope

from service.backends.base import LogprobBackend
from service.backends.engines.engine_socket import SocketBackend
from service.backends.engines.score_mode_check import ScoreModeCheck
from service.backends.transport.engine_load import EngineLoad
from service.config.settings import Settings
from service.errors import EngineUnavailable
from service.learning.learner import ProfileLearner
from service.runtime.cpus import CpuBudget
from service.state.profile_store import ProfileStore
from service.state.state_store import FolderState, StateStore
from service.state.traffic import TrafficSampler
from serving.admission.control import Admission
from serving.admission.errors import Draining, NotReady, Unhealthy
from serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)

Phase = Literal["loading", "engine_unavailable", "warming", "ready", "draining", "unhealthy"]


class Lifecycle:
    """Liveness and readiness facts: written by the lifespan tasks and the server, read by the
    probes and by admission. Event-loop thread only."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics
        self.loaded = False
        self.warmed = False
        self.draining = False
        self.fatal: str | None = None
        """Why the process must be restarted (engine dead, load or warm-up failed)."""
        self.canary_failures = 0
        """Consecutive failed canaries (reset by any success)."""
        self.last_success: float | None = None
        """Monotonic time of the last successful scoring (request, canary or warm-up)."""
        self.progress_at: float | None = None
        """Monotonic time the engine last finished a forward (engines that report them)."""
        self.on_fatal: Callable[[str], None] | None = None
        """Set by the server: stop the process (non-zero exit) once the engine is dead."""
        self.wake: anyio.Event | None = None
        """Set by the lifespan (an event needs a running loop): wakes the canary early."""
        self.engine_down: str | None = None
        """Why a remote engine cannot be used right now (``None``: it can, or the engine is
        in-process). Readiness fails while it is set; liveness does not: the process is fine,
        and it serves again as soon as the engine answers."""

    @property
    def alive(self) -> bool:
        return self.fatal is None

    @property
    def phase(self) -> Phase:
        if self.fatal is not None:
            return "unhealthy"
        if self.draining:
            return "draining"
        if not self.loaded:
            return "loading"
        if self.engine_down is not None:
            return "engine_unavailable"
        if not self.warmed:
            return "warming"
        return "ready"

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def succeeded(self) -> None:
        self.canary_failures = 0
        self.last_success = time.monotonic()

    def progressed(self) -> None:
        """The engine finished a forward: it is alive, whatever a queued canary sees."""
        self.progress_at = time.monotonic()

    def progress_since(self, t: float) -> bool:
        """Whether a forward finished after monotonic time ``t``."""
        return self.progress_at is not None and self.progress_at > t

    def suspect(self) -> None:
        """A request saw the engine fail: run the canary now instead of at its next tick."""
        if self.wake is not None:
            self.wake.set()

    def check_serving(self) -> None:
        """Raise unless new requests may be admitted.

        Raises:
            Unhealthy: the engine failed (the process is about to exit).
            Draining: SIGTERM received.
            NotReady: loading or warming up.
        """
        phase = self.phase
        if phase == "unhealthy":
            raise Unhealthy(f"the scoring engine failed ({self.fatal}); the server is restarting")
        if phase == "draining":
            raise Draining("the server is shutting down; retry on another replica")
        if phase == "loading":
            raise NotReady("the model is still loading")
        if phase == "engine_unavailable":
            raise EngineUnavailable(f"the engine cannot be used now: {self.engine_down}")
        if phase == "warming":
            raise NotReady("the model is warming up")

    def mark(self, **changes: bool) -> None:
        for name, value in changes.items():
            setattr(self, name, value)
        self._metrics.ready.set(1 if self.ready else 0)

    def engine(self, down: str | None) -> None:
        """Record whether the engine (remote, or the shared engine process) can be used
        (``down``: why not)."""
        if down != self.engine_down:
            if down is None:
                log.info("engine usable again")
            else:
                log.warning("engine unusable: %s", down)
        self.engine_down = down
        self._metrics.ready.set(1 if self.ready else 0)

    def fail(self, reason: str) -> None:
        """The engine cannot serve any more: liveness fails and the server exits non-zero."""
        if self.fatal is not None:
            return
        log.error("fatal: %s", reason)
        self.fatal = reason
        self._metrics.ready.set(0)
        if self.on_fatal is not None:
            self.on_fatal(reason)


class Engine:
    """The scoring backend once the lifespan has loaded it, the bias-profile store, the
    sample of live MoI runs kept for calibration from traffic, what ``auto`` learns, and the
    state store that keeps them (the folder, or Redis)."""

    def __init__(
        self,
        profiles: ProfileStore,
        traffic: TrafficSampler,
        learner: ProfileLearner,
        state: StateStore | None = None,
    ) -> None:
        self.backend: LogprobBackend | None = None
        self.score_mode_check: ScoreModeCheck | None = None
        """vLLM's start-up comparison of its two score modes (``None``: other engines)."""
        self.engine_load: EngineLoad | None = None
        """A remote engine's queue, read for ``auto``'s background runs (``None``: others)."""
        self.profiles = profiles
        self.traffic = traffic
        self.learner = learner
        self.state: StateStore = state or FolderState(profiles.root)

    def require(self) -> LogprobBackend:
        if self.backend is None:
            raise NotReady("the model is still loading")
        return self.backend


# A connect to the engine process on this host answers at once unless it is stuck.
_LOCAL_ENGINE_CONNECT_S = 1.0


@dataclass(frozen=True)
class AppContext:
    settings: Settings
    version: str
    lifecycle: Lifecycle
    engine: Engine
    admission: Admission
    metrics: ServiceMetrics
    cpus: CpuBudget
    """The CPUs the process may use and what is sized from them (``service.runtime.cpus``)."""

    async def check_serving(self) -> None:
        """``Lifecycle.check_serving``; an engine process on this host marked down is tried
        once first (``reach_engine_process``).

        Raises:
            as ``Lifecycle.check_serving``.
        """
        if self.lifecycle.phase == "engine_unavailable":
            await self.reach_engine_process()
        self.lifecycle.check_serving()

    async def reach_engine_process(self) -> bool:
        """Whether the shared engine process (``entrypoints.workers``) answers now; recorded.

        A worker learns that a restarted engine process is back only by reaching it. Refusing
        on its last failed attempt would turn callers away for as long as its watchdog waits,
        while the other workers already serve; a connect over the Unix socket costs
        microseconds when the engine is still gone. ``False`` for any other backend.
        """
        backend = self.engine.backend
        if not isinstance(backend, SocketBackend):
            return False
        try:
            with anyio.fail_after(_LOCAL_ENGINE_CONNECT_S):
                await backend.connect()
        except EngineUnavailable as exc:
            self.lifecycle.engine(exc.message)
            return False
        except TimeoutError:
            return False
        self.lifecycle.engine(None)
        return True


def context_of(scope: Scope) -> AppContext | None:
    """The context of the app serving ``scope`` (``None`` outside a rag-reorder app)."""
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    return ctx if isinstance(ctx, AppContext) else None


def request_id_of(scope: Scope) -> str | None:
    state = scope.get("state")
    rid = state.get("request_id") if isinstance(state, dict) else None
    return rid if isinstance(rid, str) else None
