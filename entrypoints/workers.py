"""``serve`` with ``workers`` > 1: several HTTP worker processes on one port, one engine process.

One Python process spends tens of milliseconds of CPU per MoI request (parsing, tokenising,
the design, the fit, the response) on one event loop; at GPU speed that, not the engine,
bounds throughput. Here the supervisor (the ``serve`` process) binds the listening socket
once and starts:

- one **engine process** (``python -m entrypoints.workers engine``): the configured backend
  (paced or transformers with its cross-request scheduler, or vLLM's ``AsyncLLM``, whose own
  scheduler batches), answering every worker's calls on a Unix socket
  (``service.backends.engines.engine_socket``), so prompts of all workers share forwards;
- ``workers`` **worker processes** (``python -m entrypoints.workers worker``): the full app on the
  inherited socket (the kernel spreads connections over them), each scoring through a
  ``SocketBackend``. Admission's in-flight counts are summed over the workers
  (``service.runtime.shared_counts``) and its rates are the engine process's, which meters
  every worker's calls; metrics are written per process and summed at scrape
  (``PROMETHEUS_MULTIPROC_DIR``); ``auto``'s learning and the state store treat each worker
  as a replica sharing one store (files per process, one assessor at a time under the
  store's lock), as replicas of a deployment already do.

The supervisor restarts a worker that exits (a crash loses only the requests it held), one
that hangs without exiting (below), and the engine process if it dies once it has served (the
workers' ``/ready`` is 503 meanwhile, and turns 200 again once their watchdog reaches the new
engine); each child leads a process group of its own, and what a dead one leaves running in it
(vLLM's engine core) is killed before the restart. An engine that fails before it first serves
(a model that does not load) stops the server with status 1, as one process would. SIGTERM
(or Ctrl-C) drains: every worker gets SIGTERM and drains as one process does
(``entrypoints.server``), then the engine process is stopped, and the supervisor exits 0.

A hung worker (stopped, deadlocked, its event loop blocked: alive to ``poll`` but serving
nobody) is found by its heartbeat: from its lifespan's start, each worker's event loop adds
one to a counter of its own in a file of the run folder (``heartbeats``, 8 bytes a slot)
every second (``_beat_period``). The supervisor reads the counters every ``_POLL_S`` and,
when a worker's has not changed for ``worker_hang_timeout_s`` (0: no check) by the
supervisor's own clock, SIGKILLs its process group and restarts it as one that crashed. A
worker is checked from its first beat, so loading its tokenizer is not a hang. The engine
process meanwhile closes a connection that has not read for the same time
(``service.backends.engines.engine_socket``), so a hung worker does not grow its memory. A counter,
not a time: no clock is shared, and a torn read only looks like a beat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from service.backends.factory import resolve_backend
from service.config.settings import Settings
from service.runtime import shared_counts

log = logging.getLogger(__name__)

_ENGINE_SOCKET = "engine.sock"
_ENGINE_READY = "engine.ready"
_COUNTS = "admission.counts"
_METRICS = "metrics"
_HEARTBEATS = "heartbeats"
_BEAT = struct.Struct("<Q")
# Longest wait before restarting a process that keeps exiting.
_RESTART_MAX_S = 5.0
# The engine's own close after the workers have drained (a model's release).
_ENGINE_STOP_S = 30.0
_POLL_S = 0.1
EXIT_ENGINE_FAILED = 1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class _Child:
    """One supervised process and when it may be started again."""

    name: str
    argv: list[str]
    pass_fds: tuple[int, ...] = ()
    slot: int | None = None
    """A worker's slot in admission's shared counts."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    not_before: float = 0.0
    started_at: float = field(default=0.0)
    beat: int = 0
    """A worker's heartbeat counter as last read (0: none since its start)."""
    beat_seen_at: float = 0.0
    """When ``beat`` last changed (the supervisor's monotonic clock)."""


def serve_workers(settings: Settings, host: str, port: int) -> None:
    """Serve on ``host:port`` with ``settings.workers`` worker processes and one engine
    process, until SIGTERM/SIGINT (blocking; module docstring).

    Raises:
        SystemExit: status 2 for a backend several workers cannot share; status 1 when the
            engine process fails before it first serves.
    """
    kind = resolve_backend(settings)
    if kind not in ("paced", "transformers", "vllm"):
        raise SystemExit(
            f"RAG_REORDER_WORKERS={settings.workers} runs the paced, transformers and vllm "
            f"backends; the backend here resolves to {kind!r} (set RAG_REORDER_WORKERS=1)"
        )
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # Resolved once here: a first start converts the packaged model, which two processes
    # must not do side by side.
    from service.model_assets import resolve_model

    resolve_model(settings)
    run_dir = Path(tempfile.mkdtemp(prefix="rag-reorder-"))  # mode 0700: only this user
    try:
        _supervise(settings, host, port, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(settings: Settings, host: str, port: int, run_dir: Path) -> None:
    listener = socket.create_server((host, port), backlog=2048)
    listener.set_inheritable(True)
    (run_dir / _METRICS).mkdir()
    shared_counts.create(run_dir / _COUNTS, settings.workers)
    beats = os.open(run_dir / _HEARTBEATS, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(beats, _BEAT.size * settings.workers)
    # Every process writes its metrics to the folder; a worker's /metrics sums them.
    env = {
        **os.environ,
        **_settings_env(settings),
        "PROMETHEUS_MULTIPROC_DIR": str(run_dir / _METRICS),
    }
    python = sys.executable
    engine = _Child(
        "engine", [python, "-m", "entrypoints.workers", "engine", "--run-dir", str(run_dir)]
    )
    fd = listener.fileno()
    role = [
        python,
        "-m",
        "entrypoints.workers",
        "worker",
        "--run-dir",
        str(run_dir),
        "--fd",
        str(fd),
    ]
    workers = [
        _Child(f"worker {i}", [*role, "--slot", str(i)], pass_fds=(fd,), slot=i)
        for i in range(settings.workers)
    ]
    stopping: list[int] = []

    def on_signal(sig: int, _frame: FrameType | None) -> None:
        stopping.append(sig)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info(
        "serving on %s:%d with %d workers and one %s engine process", host, port,
        settings.workers, resolve_backend(settings),
    )  # fmt: skip
    failed = False
    try:
        _start(engine, env)
        for w in workers:
            _start_worker(w, env, beats)
        while not stopping:
            time.sleep(_POLL_S)
            if not _keep_engine(engine, env, run_dir):
                failed = True
                break
            for w in workers:
                _kill_if_hung(w, beats, settings.worker_hang_timeout_s)
                _keep_worker(w, env, run_dir, beats)
    finally:
        listener.close()
        os.close(beats)
        _stop(workers, engine, settings)
        for s, handler in old.items():
            signal.signal(s, handler)
    if failed:
        raise SystemExit(EXIT_ENGINE_FAILED)


def _settings_env(settings: Settings) -> dict[str, str]:
    """The settings given on the command line (not in the environment) as the children's
    environment variables, so every process runs with the same settings."""
    out: dict[str, str] = {}
    for name in settings.model_fields_set:
        key = f"RAG_REORDER_{name.upper()}"
        value = getattr(settings, name)
        if key in os.environ or value is None:
            continue
        if isinstance(value, (str, int, float, Path)):
            out[key] = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            raise SystemExit(f"{name}: set it as {key} to run several workers")
    return out


def _die_with_parent(supervisor: int) -> None:
    """In the child before it runs: SIGTERM when the supervisor dies (Linux), so a killed
    supervisor leaves no workers serving on the port without anyone to restart them.

    A supervisor killed between the fork and the ``prctl`` would leave the child without the
    signal (it is armed for the parent the child has then, already init): so the child
    compares its parent with ``supervisor``, the pid the supervisor passed before forking,
    and ends itself if they differ."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: the children outlive a killed supervisor
    if os.getppid() != supervisor:
        os._exit(1)


def _start(child: _Child, env: dict[str, str]) -> None:
    # The supervisor runs no threads of its own, so preexec_fn cannot deadlock here. Each
    # child leads a process group of its own (a session), so what it starts (vLLM's engine
    # core, the solver pool) can be found and ended with it (_reap).
    child.proc = subprocess.Popen(
        child.argv,
        env=env,
        pass_fds=child.pass_fds,
        start_new_session=True,
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),  # noqa: PLW1509
    )
    child.started_at = time.monotonic()
    log.info("%s started (pid %d)", child.name, child.proc.pid)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL whatever is left of an exited child's process group.

    A child that dies without its own shutdown (SIGKILL, a crash) leaves its children
    running: vLLM's engine core (with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, its default on a
    GPU) would keep the model and its KV cache in GPU memory, and the restarted engine process
    could not load beside it, failing again at every restart.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _backoff(child: _Child) -> None:
    # A process that ran a while restarts at once; one that keeps dying, less and less often.
    ran_s = time.monotonic() - child.started_at
    child.restarts = 0 if ran_s > 60 else child.restarts + 1
    child.not_before = time.monotonic() + min(_RESTART_MAX_S, 0.1 * 2**child.restarts)


def _keep_engine(engine: _Child, env: dict[str, str], run_dir: Path) -> bool:
    """Restart the engine process if it died after serving; ``False`` if it failed first."""
    proc = engine.proc
    if proc is None:
        if time.monotonic() >= engine.not_before:
            _start(engine, env)
        return True
    code = proc.poll()
    if code is None:
        return True
    _reap(proc)
    if not (run_dir / _ENGINE_READY).exists():
        log.error("the engine process exited with %d before it served", code)
        return False
    log.error("the engine process exited with %d; restarting it", code)
    (run_dir / _ENGINE_SOCKET).unlink(missing_ok=True)
    engine.proc = None
    _backoff(engine)
    return True


def _start_worker(worker: _Child, env: dict[str, str], beats: int) -> None:
    # Its heartbeat counts from 0 again: the previous worker of the slot is gone.
    assert worker.slot is not None
    os.pwrite(beats, _BEAT.pack(0), worker.slot * _BEAT.size)
    worker.beat, worker.beat_seen_at = 0, time.monotonic()
    _start(worker, env)


def _kill_if_hung(worker: _Child, beats: int, timeout_s: float) -> None:
    """SIGKILL a worker whose heartbeat has not changed for ``timeout_s`` (0: never) since
    its first beat; ``_keep_worker`` then restarts it (module docstring)."""
    proc = worker.proc
    if timeout_s <= 0 or proc is None or worker.slot is None or proc.poll() is not None:
        return
    (beat,) = _BEAT.unpack(os.pread(beats, _BEAT.size, worker.slot * _BEAT.size))
    now = time.monotonic()
    if beat != worker.beat:
        worker.beat, worker.beat_seen_at = beat, now
        return
    if beat == 0 or now - worker.beat_seen_at <= timeout_s:
        return
    log.error(
        "%s (pid %d) unresponsive: no heartbeat for %.1f s (worker_hang_timeout_s %g); "
        "killing it", worker.name, proc.pid, now - worker.beat_seen_at, timeout_s,
    )  # fmt: skip
    _reap(proc)
    proc.wait()


def _keep_worker(worker: _Child, env: dict[str, str], run_dir: Path, beats: int) -> None:
    proc = worker.proc
    if proc is None:
        if time.monotonic() >= worker.not_before:
            _start_worker(worker, env, beats)
        return
    code = proc.poll()
    if code is None:
        return
    _reap(proc)
    log.error("%s (pid %d) exited with %d; restarting it", worker.name, proc.pid, code)
    _forget_gauges(run_dir / _METRICS, proc.pid)
    if worker.slot is not None:
        # What it held left with it: the other workers' admission stops counting it now,
        # not when its successor is up.
        shared_counts.SharedCounts(run_dir / _COUNTS, worker.slot)
    worker.proc = None
    _backoff(worker)


def _forget_gauges(folder: Path, pid: int) -> None:
    """A dead worker's gauges leave the scrape; its counters stay in the sums (a counter
    never goes back)."""
    for path in folder.glob(f"gauge_*_{pid}.db"):
        path.unlink(missing_ok=True)


def _stop(workers: Sequence[_Child], engine: _Child, settings: Settings) -> None:
    """Drain the workers (each as one process drains on SIGTERM), then stop the engine."""
    alive = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
    for proc in alive:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + settings.drain_timeout_s + 10.0
    for proc in alive:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("worker pid %d still running after the drain: killed", proc.pid)
            proc.kill()
            proc.wait()
        _reap(proc)
    if engine.proc is not None and engine.proc.poll() is None:
        engine.proc.send_signal(signal.SIGTERM)
        try:
            engine.proc.wait(_ENGINE_STOP_S)
        except subprocess.TimeoutExpired:
            engine.proc.kill()
            engine.proc.wait()
    if engine.proc is not None:
        _reap(engine.proc)
    log.info("all processes stopped")


# --- the children --------------------------------------------------------------------------


def _engine_main(run_dir: Path) -> None:
    """The engine process: load the backend, answer the workers until SIGTERM."""
    from service.backends.engines.engine_socket import serve_engine
    from service.backends.factory import create_backend, size_threads
    from service.backends.scheduling.scheduler import ForwardScheduler
    from service.runtime.cpus import process_budget
    from serving.metrics import ServiceMetrics

    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s",
        force=True,
    )
    size_threads(settings, process_budget(settings.cpus))
    backend = create_backend(settings)
    scheduler = getattr(backend, "scheduler", None)
    if isinstance(scheduler, ForwardScheduler):
        # The forwards' histograms (batch fill, callers per forward, waits) in the workers'
        # scrape: this process writes them to the shared metrics folder too.
        ServiceMetrics(include_default_registry=False).track_scheduler(scheduler)

    async def main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        check_score_mode = getattr(backend, "check_score_mode", None)
        if check_score_mode is not None:
            # vLLM's fast score path earns its place here, once for every worker, before the
            # engine serves (the workers read the outcome with the engine's info). A forced
            # mode that disagrees raises BackendUnavailable: the start fails, as in one process.
            await check_score_mode()
        path = run_dir / _ENGINE_SOCKET
        path.unlink(missing_ok=True)
        serving = asyncio.create_task(
            serve_engine(backend, path, stop, write_timeout_s=settings.worker_hang_timeout_s)
        )
        while not path.exists() and not serving.done():
            await asyncio.sleep(0.01)
        (run_dir / _ENGINE_READY).touch()
        try:
            return await serving
        finally:
            await backend.aclose()

    if asyncio.run(main()):
        # The backend died (a vLLM engine core does not come back): exit non-zero, so the
        # supervisor starts a new engine process.
        raise SystemExit(EXIT_ENGINE_FAILED)


def _worker_main(run_dir: Path, slot: int, fd: int) -> None:
    """A worker process: the whole app on the inherited socket, scoring on the engine."""
    from app.main import create_app
    from entrypoints.server import serve_app
    from service.backends.engines.engine_socket import SocketBackend
    from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
    from service.model_assets import resolve_model
    from service.runtime.shared_counts import SharedCounts

    settings = Settings()
    tokenizer = load_prompt_tokenizer(resolve_model(settings), name=settings.model)
    backend = SocketBackend(run_dir / _ENGINE_SOCKET, tokenizer, model_id=settings.model)
    counts = SharedCounts(run_dir / _COUNTS, slot)
    app = create_app(settings, backend, shared=counts, meter=backend.meter)
    if settings.worker_hang_timeout_s > 0:
        app.router.lifespan_context = _beating(
            app.router.lifespan_context,
            run_dir / _HEARTBEATS,
            slot,
            _beat_period(settings.worker_hang_timeout_s),
        )
    listener = socket.socket(fileno=fd)
    serve_app(app, settings, "", 0, sockets=[listener])


def _beat_period(timeout_s: float) -> float:
    """A second, or a quarter of a shorter hang timeout: several beats fit in it."""
    return min(1.0, timeout_s / 4)


_Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]


def _beating(lifespan: _Lifespan, path: Path, slot: int, period_s: float) -> _Lifespan:
    """``lifespan`` with the worker's heartbeat beside it (module docstring): from the event
    loop, so a loop that stops turning stops beating."""

    @asynccontextmanager
    async def beating(app: Any) -> AsyncIterator[Any]:
        fd = os.open(path, os.O_RDWR)
        beats = 0
        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []

        def beat() -> None:
            nonlocal beats
            beats += 1
            os.pwrite(fd, _BEAT.pack(beats), slot * _BEAT.size)
            timer[:] = [loop.call_later(period_s, beat)]

        beat()
        try:
            async with lifespan(app) as state:
                yield state
        finally:
            for t in timer:
                t.cancel()
            os.close(fd)

    return beating


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m entrypoints.workers", description=__doc__)
    sub = p.add_subparsers(dest="role", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--run-dir", type=Path, required=True)
    w = sub.add_parser("worker")
    w.add_argument("--run-dir", type=Path, required=True)
    w.add_argument("--slot", type=int, required=True)
    w.add_argument("--fd", type=int, required=True)
    args = p.parse_args(argv)
    if args.role == "engine":
        _engine_main(args.run_dir)
    else:
        _worker_main(args.run_dir, args.slot, args.fd)


if __name__ == "__main__":
    main()
