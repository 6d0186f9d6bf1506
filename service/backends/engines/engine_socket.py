"""One engine process shared by several worker processes, over a local Unix socket.

With ``workers`` > 1 (``entrypoints.workers``) the scoring engine runs in a process of its own and
every HTTP worker reaches it through ``SocketBackend``, a ``LogprobBackend`` whose calls are
answered by ``serve_engine`` in the engine process: the backend's own ``score`` and
``generate``, so the cross-request scheduler there packs the prompts of every worker into
the same forwards (vLLM's ``--api-server-count`` has the same shape: API processes in front
of one engine core, each with its own client). Prompts are built in the workers with the
model's tokenizer, loaded there; the engine process gets token ids.

The wire: frames of a 4-byte big-endian length and a pickle. Pickle because the frames are
the backends' own frozen dataclasses (a 20-prompt call is about 15,000 token ids; pickle
moves them without building JSON), and safe here because the socket lives in a folder only
this user may enter (the supervisor makes it with ``tempfile.mkdtemp``, mode 0700): whoever
can connect can already run code as this user. A request is ``(id, op, payload)``, an
answer ``(id, ok, payload)``; calls of one connection are answered as they finish, in any
order. ``cancel`` drops a call the worker gave up on (deadline, disconnected client), so its
prompts not yet in a forward leave the scheduler, as they do in one process. A ``score`` or
``generate`` payload is ``(requests, background, metered)``: ``background``, whether the
worker made the call as the service's own work (``background_work``), which the engine's
scheduler serves after callers; ``metered``, below.

Admission's rate (``ThroughputMeter``) is the engine's: a worker timing its own calls would
count the engine's time on the other workers' prompts as its own, and read a rate N times
too low (its estimates too long, a ``deadline_unreachable`` refusal possible for work that
fits). So the engine process meters the calls of every worker, as one process's admission
meters its calls, and sends its meter to every worker after each call ends (at most every
``_METER_PUSH_S``); a worker's ``EngineMeter`` reads that copy and leaves the timing to it.
``metered`` is false for the liveness probes (the warm-up, the canary), made under
``unmetered()``: they are not timed, as one process does not time them (issue 90: with every
worker's canary timed, an idle server's rate decayed to the canary's, 86,302 to 1,938
tokens/s, and stayed "fresh", so admission refused work that fits with 422). The warm-up's
rate reaches the engine as one process's does, as a ``seed`` (a request without an answer),
counted only until a real call completes.

The engine process's memory stays bounded whatever a worker does (issue 90: a worker that
stopped reading grew it 180 MB in 10 s, each of 50 meter copies a second holding the times
of every call of the last 300 s: 540 KiB at 200 calls a second). The meter sent is its
``snapshot``, about 4.2 KiB at most (300 one-second buckets of call counts); each worker has
at most one snapshot waiting (latest wins), written only once what was written before has
gone (asyncio's write-buffer high-water mark, 64 KiB); answers wait for the worker to read
them the same way. A connection whose writes do not drain for ``write_timeout_s``
(``worker_hang_timeout_s``) is closed: its calls are cancelled, and the worker, if it ever
reads again, reconnects. So per worker connection the engine process holds at most 64 KiB
plus one frame in its write buffer.

An error raised by the engine's backend comes back as the same domain error
(``service.errors``: a request the engine refuses is the same 422 in any worker). A lost
connection (the engine process died or restarts) fails the calls in flight with
``EngineUnavailable``, so the worker's ``/ready`` turns 503 and its watchdog probes until the
engine is back (``serving.supervisor``); the next call reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from service import errors as service_errors
from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    LogprobBackend,
    PromptTokenizer,
    ScoreResult,
    SpanRequest,
    background_work,
    generation_tokens,
    in_background,
    prompt_tokens,
)
from service.backends.engines.score_mode_check import ScoreModeCheck
from service.errors import BackendUnavailable, EngineUnavailable, ReorderError, ServerError
from service.runtime.throughput import ThroughputMeter

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
# A frame larger than this is a bug or not our peer: 64 MiB is thousands of 8k-token prompts.
_MAX_FRAME = 64 << 20
_OPS = ("info", "score", "generate", "cancel", "seed")
# The engine's meter goes to the workers at most this often: a rate a few milliseconds old
# prices admission as well, and a busy engine ends hundreds of calls a second.
_METER_PUSH_S = 0.02
# An answer frame's id for the engine's meter (calls are numbered from 1).
_METER_ID = 0
_METERED: ContextVar[bool] = ContextVar("rag_reorder_engine_metered", default=True)


@contextlib.contextmanager
def unmetered() -> Iterator[None]:
    """The engine process times no call made within into its meter: the liveness probes
    (warm-up, canary), which one process does not meter either (module docstring)."""
    token = _METERED.set(False)
    try:
        yield
    finally:
        _METERED.reset(token)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes, over the {_MAX_FRAME} limit")
    return pickle.loads(await reader.readexactly(size))


def _frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _encode_error(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    """A domain error as (class name, message, attributes); anything else as a server
    error naming its type only (no traceback or paths cross the socket)."""
    if isinstance(exc, ReorderError):
        return type(exc).__name__, exc.message, dict(vars(exc))
    return "ServerError", f"the engine process failed ({type(exc).__name__})", {}


def _decode_error(name: str, message: str, attrs: dict[str, Any]) -> ReorderError:
    cls = getattr(service_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ReorderError)):
        cls = ServerError
    # Rebuilt without its __init__ (LimitExceeded's takes param, limit and value): the same
    # class with the same message and attributes as the engine raised.
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(attrs)
    exc.message = message
    exc.param = attrs.get("param")
    return exc


# --- the engine process's side ---------------------------------------------------------------


class EngineMeter(ThroughputMeter):
    """A worker's copy of the engine process's meter (module docstring): the engine times
    every metered call; ``begin`` and ``end`` here are the worker's admission's, and do
    nothing; ``seed`` (the warm-up's rate) goes to the engine process."""

    def __init__(self, send_seed: Callable[[int, float], None] | None = None) -> None:
        """Args:
        send_seed: hands a seed's tokens and seconds to the engine process.
        """
        super().__init__()
        self._send_seed = send_seed

    def begin(self, now: float) -> None:
        del now

    def end(self, now: float, tokens: int | None, new_tokens: int = 0) -> None:
        del now, tokens, new_tokens

    def seed(self, tokens: int, seconds: float, now: float | None = None) -> None:
        del now  # the engine process dates it on receipt (the same monotonic clock)
        if self._send_seed is not None:
            self._send_seed(tokens, seconds)

    def update(self, state: dict[str, Any]) -> None:
        """Take the engine's meter as it is now (its ``snapshot``)."""
        self.__dict__.update(state)


class _Peer:
    """One worker's connection as the engine process writes to it (module docstring): every
    write waits for the worker to read (``drain``) at most ``write_timeout_s`` (0: no limit),
    and of the meter's snapshots only the newest waits its turn."""

    def __init__(self, writer: asyncio.StreamWriter, write_timeout_s: float) -> None:
        self.writer = writer
        self._timeout_s = write_timeout_s
        self._lock = asyncio.Lock()
        self._meter: bytes | None = None
        self._meter_task: asyncio.Task[None] | None = None

    async def send(self, frame: bytes) -> None:
        """Write ``frame`` once the frames before it have drained.

        Raises:
            ConnectionError: the connection is closed, or was closed because the worker
                read nothing for ``write_timeout_s``.
        """
        async with self._lock:
            if self.writer.is_closing():
                raise ConnectionResetError("the worker's connection is closed")
            self.writer.write(frame)
            await self._drain()

    async def _drain(self) -> None:
        if self._timeout_s <= 0:
            await self.writer.drain()
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self.writer.drain()
        except TimeoutError:
            waiting = self.writer.transport.get_write_buffer_size()
            log.warning(
                "a worker read nothing for %g s with %d bytes waiting for it: its connection "
                "is closed (worker_hang_timeout_s)", self._timeout_s, waiting,
            )  # fmt: skip
            self.writer.transport.abort()
            raise ConnectionResetError("the worker stopped reading") from None

    def push_meter(self, frame: bytes) -> None:
        """Send the meter's newest snapshot; one not yet written is replaced (latest wins)."""
        self._meter = frame
        if self._meter_task is None:
            self._meter_task = asyncio.create_task(self._send_meter())

    async def _send_meter(self) -> None:
        try:
            while self._meter is not None:
                frame, self._meter = self._meter, None
                await self.send(frame)
        except ConnectionError:
            pass  # the connection's reader ends it
        finally:
            self._meter_task = None

    def close(self) -> None:
        if self._meter_task is not None:
            self._meter_task.cancel()
        self.writer.close()


async def serve_engine(
    backend: LogprobBackend, path: Path, stop: asyncio.Event, *, write_timeout_s: float = 60.0
) -> bool:
    """Answer workers' calls on ``backend`` at the Unix socket ``path`` until ``stop`` is set,
    or until the backend is dead.

    Every call runs as a task of its own, so the backend's scheduler sees the calls of all
    connections at once and batches them together; each metered one is timed into one meter,
    sent to every worker (module docstring). A connection whose writes do not drain for
    ``write_timeout_s`` (0: no limit) is closed.

    A backend that raises ``BackendUnavailable`` is dead (a vLLM engine core that died cannot
    be recovered; one process would exit): the call is not answered, serving stops and every
    connection closes, so each worker's calls in flight fail with ``EngineUnavailable`` and
    its ``/ready`` is 503 until the supervisor's restart of this process is reached.

    Returns:
        Whether serving stopped because the backend is dead.
    """
    dead = False
    connections: set[asyncio.Task[None]] = set()
    peers: set[_Peer] = set()
    meter = ThroughputMeter()
    push: list[asyncio.TimerHandle] = []

    def pushed() -> None:
        push.clear()
        frame = _frame((_METER_ID, True, meter.snapshot()))
        for peer in peers:
            peer.push_meter(frame)

    def changed() -> None:
        if not push:
            push.append(asyncio.get_running_loop().call_later(_METER_PUSH_S, pushed))

    def ended(now: float, tokens: int | None, new_tokens: int) -> None:
        meter.end(now, tokens, new_tokens)
        changed()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.add(task)
        calls: dict[int, asyncio.Task[None]] = {}
        peer = _Peer(writer, write_timeout_s)
        peers.add(peer)

        async def answer(call_id: int, ok: bool, payload: object) -> None:
            await peer.send(_frame((call_id, ok, payload)))

        async def run(call_id: int, op: str, payload: Any) -> None:
            nonlocal dead
            # A payload of (requests, background, metered); a liveness probe is not timed.
            timed = op in ("score", "generate") and bool(payload[2])
            done: tuple[int, int] | None = None
            if timed:
                meter.begin(time.monotonic())
            try:
                if op == "info":
                    result: object = {
                        "model_id": backend.model_id,
                        "max_model_len": backend.max_model_len,
                        # vLLM's start-up check of its score mode, run in this process.
                        "score_mode_check": getattr(backend, "score_mode_check", None),
                    }
                else:
                    requests, background, _ = payload
                    with background_work() if background else contextlib.nullcontext():
                        if op == "score":
                            result = await backend.score(requests)
                        else:
                            result = await backend.generate(requests)
                    done = (
                        (prompt_tokens(requests), 0)
                        if op == "score"
                        else generation_tokens(requests)
                    )
            except asyncio.CancelledError:
                raise
            except BackendUnavailable as exc:
                if not dead:
                    log.error("the engine's backend is dead (%s): the engine process stops", exc)
                dead = True
                stop.set()
            except Exception as exc:
                if not isinstance(exc, ReorderError):
                    log.exception("engine call %s failed", op)
                with contextlib.suppress(ConnectionError):
                    await answer(call_id, False, _encode_error(exc))
            else:
                with contextlib.suppress(ConnectionError):
                    await answer(call_id, True, result)
            finally:
                calls.pop(call_id, None)
                if timed:
                    # A failed or cancelled call adds no tokens (``ThroughputMeter.end``).
                    ended(time.monotonic(), *(done if done is not None else (None, 0)))

        try:
            while True:
                call_id, op, payload = await _read_frame(reader)
                if op == "cancel":
                    call = calls.get(payload)
                    if call is not None:
                        call.cancel()
                    continue
                if op == "seed":
                    # The warm-up's rate, as one process's admission seeds it (module docstring).
                    tokens, seconds = payload
                    meter.seed(int(tokens), float(seconds), time.monotonic())
                    changed()
                    continue
                if op not in _OPS:
                    raise ConnectionError(f"unknown op {op!r}")
                calls[call_id] = asyncio.create_task(run(call_id, op, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away: what it asked for is of no use to anyone
        finally:
            for call in calls.values():
                call.cancel()
            peers.discard(peer)
            peer.close()
            connections.discard(task)

    server = await asyncio.start_unix_server(handle, path=str(path))
    log.info("engine process serving %s on %s", backend.model_id, path)
    try:
        await stop.wait()
    finally:
        server.close()
        for timer in push:
            timer.cancel()
        for conn in list(connections):
            conn.cancel()
        await server.wait_closed()
    return dead


# --- a worker's side -------------------------------------------------------------------------


class SocketBackend:
    """``LogprobBackend`` on the engine process at a Unix socket (module docstring)."""

    def __init__(self, path: Path, tokenizer: PromptTokenizer, *, model_id: str) -> None:
        """Args:
        path: the engine process's socket.
        tokenizer: the model's tokenizer, loaded in this process (prompts are built here).
        model_id: the configured model, until ``connect`` reads the engine's own id.
        """
        self._path = path
        self._tokenizer = tokenizer
        self._model_id = model_id
        self._max_model_len = 0
        self._score_mode_check: ScoreModeCheck | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._closed = False
        self.meter = EngineMeter(self._send_seed)
        """The engine's meter, as it last sent it: admission's rates in this worker."""
        self.on_lost: Callable[[], None] | None = None
        """Called when an open connection is lost (the app's watchdog probes at once)."""

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        """The engine's context length; 0 before the first ``connect``."""
        return self._max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def connect(self) -> None:
        """Reach the engine process and read its model and context length.

        Raises:
            EngineUnavailable: the engine process is not up (yet, or any more).
        """
        info = await self._call("info", None)
        self._model_id = str(info["model_id"])
        self._max_model_len = int(info["max_model_len"])
        self._score_mode_check = info.get("score_mode_check")

    async def check_score_mode(self) -> ScoreModeCheck | None:
        """The outcome of vLLM's score-mode check, which the engine process ran before it
        served (``service.backends.engines.score_mode_check``); ``None`` for an engine without one.
        Read at ``connect``."""
        return self._score_mode_check

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """The engine process's ``score`` of ``requests``.

        Raises:
            EngineUnavailable: the engine process cannot be reached or went away.
            InvalidRequest, LimitExceeded, BackendUnavailable: as the engine's backend.
        """
        result: list[ScoreResult] = await self._call(
            "score", (list(requests), in_background(), _METERED.get())
        )
        return result

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """The engine process's ``generate`` of ``requests``.

        Raises:
            EngineUnavailable, InvalidRequest, LimitExceeded, BackendUnavailable: as ``score``.
        """
        result: list[GenerateResult] = await self._call(
            "generate", (list(requests), in_background(), _METERED.get())
        )
        return result

    async def aclose(self) -> None:
        self._closed = True
        self._drop("this worker is shutting down")

    def _send_seed(self, tokens: int, seconds: float) -> None:
        """The warm-up's rate to the engine process (no answer); dropped while no
        connection is open (the warm-up has just connected, so there is one)."""
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(_frame((0, "seed", (tokens, seconds))))

    async def _call(self, op: str, payload: object) -> Any:
        if self._closed:
            raise EngineUnavailable("the engine connection is closed")
        writer = await self._ensure()
        call_id = next(self._ids)
        future: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            writer.write(_frame((call_id, op, payload)))
            await writer.drain()
            ok, answer = await future
        except asyncio.CancelledError:
            # The caller gave up: the engine drops the call's prompts not yet forwarded.
            if not writer.is_closing():
                with contextlib.suppress(Exception):
                    writer.write(_frame((0, "cancel", call_id)))
            raise
        except ConnectionError as exc:
            self._drop(f"the engine process connection failed ({type(exc).__name__})")
            raise EngineUnavailable("the engine process went away") from None
        finally:
            self._pending.pop(call_id, None)
        if not ok:
            raise _decode_error(*answer)
        return answer

    async def _ensure(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            try:
                reader, writer = await asyncio.open_unix_connection(str(self._path))
            except OSError as exc:
                raise EngineUnavailable(
                    f"the engine process is not reachable ({type(exc).__name__})"
                ) from None
            self._writer = writer
            self._reader_task = asyncio.create_task(self._read(reader, writer))
            return writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                call_id, ok, payload = await _read_frame(reader)
                if call_id == _METER_ID:
                    self.meter.update(payload)
                    continue
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result((ok, payload))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if self._writer is writer:
                self._drop("the engine process went away")

    def _drop(self, why: str) -> None:
        """Forget the connection; every call waiting on it fails with ``EngineUnavailable``."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            if not self._closed and self.on_lost is not None:
                self.on_lost()
        pending = list(self._pending.values())
        self._pending.clear()
        for future in pending:
            if not future.done():
                future.set_exception(EngineUnavailable(why))
