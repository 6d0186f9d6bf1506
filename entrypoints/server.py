"""``serve``: uvicorn with a graceful drain on SIGTERM and a non-zero exit when the engine dies.

SIGTERM (or the first Ctrl-C):

1. ``/ready`` turns 503 (``draining``) and new requests get 503 + Retry-After;
2. in-flight requests finish, for at most ``drain_timeout_s``, and the server waits until no
   request has arrived for ``_DRAIN_QUIET_S`` (callers still sending get their 503 first);
3. uvicorn stops: closes the listener, waits briefly for connections, runs the lifespan's
   shutdown, which closes the engine;
4. the process exits 0.

A second signal forces the exit. When the watchdog declares the engine dead
(``Lifecycle.fail``), the server stops at once and ``serve`` exits with status 1, so
Kubernetes (or any supervisor) restarts the process.
"""

from __future__ import annotations

import logging
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.main import create_app
from service.config.settings import Settings
from serving.context import AppContext, context_of

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 1
# After the drain, uvicorn waits this long for connections still open before cancelling them.
_CLOSE_GRACE_S = 2.0
# A drained server closes only after this long without a new request. Closing a listening
# socket resets the connections the kernel queued for it but nobody accepted, and closing an
# accepted connection whose request is still unread resets it too; a caller sees a reset
# instead of the 503 that tells it to go elsewhere. With several workers on one socket, the
# first idle worker would otherwise leave at once, taking connections it had just accepted.
_DRAIN_QUIET_S = 0.5


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, ctx: AppContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_deadline: float | None = None
        self.drain_signal: int | None = None
        self._requests_seen = 0
        self._quiet_since = 0.0
        ctx.lifecycle.on_fatal = self._on_fatal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is not None:
            # Second signal: uvicorn's own handling (force exit, signal re-raised afterwards).
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after a clean
        # shutdown and the process would die by the signal instead of exiting 0. Only plain
        # attributes here: a signal handler that took a lock (metrics, logging) the interrupted
        # code holds would deadlock. The next tick logs and updates the gauges.
        self.drain_deadline = time.monotonic() + self.ctx.settings.drain_timeout_s
        self.drain_signal = sig
        self.ctx.lifecycle.draining = True

    async def on_tick(self, counter: int) -> bool:
        # Called every 0.1 s by uvicorn's main loop.
        if self.drain_signal is not None:
            log.info(
                "signal %d: draining %d request(s), at most %.0f s",
                self.drain_signal,
                self.ctx.admission.in_flight,
                self.ctx.settings.drain_timeout_s,
            )
            self.drain_signal = None
            self.ctx.lifecycle.mark()
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.server_state.total_requests != self._requests_seen:
                self._requests_seen = self.server_state.total_requests
                self._quiet_since = now
            idle = self.ctx.admission.in_flight == 0 and now - self._quiet_since >= _DRAIN_QUIET_S
            if idle or now >= self.drain_deadline:
                if not idle:
                    log.warning(
                        "drain budget spent with %d request(s) in flight",
                        self.ctx.admission.in_flight,
                    )
                self.should_exit = True
        return await super().on_tick(counter)

    def _on_fatal(self, reason: str) -> None:
        log.error("stopping: %s", reason)
        self.should_exit = True


def serve(settings: Settings, host: str, port: int) -> None:
    """Serve the app on ``host:port`` until SIGTERM/SIGINT (blocking).

    Raises:
        SystemExit: status 1 when the engine failed (load, warm-up or watchdog).
    """
    serve_app(create_app(settings), settings, host, port)


def serve_app(
    app: FastAPI,
    settings: Settings,
    host: str,
    port: int,
    sockets: list[socket.socket] | None = None,
) -> None:
    """``serve`` for an app already built (tests serve one with a fake backend).

    Args:
        sockets: listening sockets to serve on instead of binding ``host:port`` (a worker
            of ``entrypoints.workers`` serves on the socket its supervisor bound for all of them).
    """
    ctx = app.state.ctx
    assert isinstance(ctx, AppContext) and context_of({"app": app}) is ctx
    level = settings.log_level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_config=None,  # our basicConfig; uvicorn's loggers propagate to it
        log_level=settings.log_level,
        access_log=settings.access_log,
        server_header=False,
        timeout_graceful_shutdown=int(_CLOSE_GRACE_S),
        # Whose X-Forwarded-For is believed: behind an ingress the client (auto's caller) is
        # the one it names, not the ingress's own address.
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )
    server = DrainingServer(config, ctx)
    server.run(sockets=sockets)
    if ctx.lifecycle.fatal is not None:
        raise SystemExit(EXIT_ENGINE_FAILED)
