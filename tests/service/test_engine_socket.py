"""One engine process for several workers: ``SocketBackend`` against ``serve_engine``, in
process over a real Unix socket (entrypoints.workers runs them in separate processes)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from service.backends.base import ScoreResult, SpanLogprobs, SpanRequest
from service.backends.engines.engine_socket import SocketBackend, serve_engine, unmetered
from service.backends.fakes.paced import PacedBackend, PacedProfile
from service.backends.scheduling.scheduler import ForwardStats
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.config.settings import Settings
from service.errors import BackendUnavailable, EngineUnavailable, LimitExceeded
from service.runtime import shared_counts
from service.runtime.shared_counts import SharedCounts
from serving.admission.deadline import Deadline

SLOW = PacedProfile("t", tokens_per_s=20_000.0, overhead_s=0.02, padded=True, decode_step_s=0.0,
                    source="test")  # fmt: skip


def engine() -> PacedBackend:
    return PacedBackend(
        ByteTokenizer(), SLOW, model="m", max_model_len=512, vocab_size=259,
        batch_token_budget=8192,
    )  # fmt: skip


def req(i: int, n: int = 100) -> SpanRequest:
    return SpanRequest(f"r{i}", tuple((i * 7 + k) % 200 + 3 for k in range(n)), n - 5, n)


def socket_path() -> Path:
    # AF_UNIX paths are limited to about 100 bytes: pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="es-")) / "engine.sock"


async def started(backend: PacedBackend, path: Path) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve_engine(backend, path, stop))
    while not path.exists():
        await asyncio.sleep(0.005)
    return stop, task


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``check`` (a state that crosses the socket), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        await asyncio.sleep(0.01)


def test_two_workers_share_the_engines_forwards_and_get_its_answers() -> None:
    async def main() -> None:
        path = socket_path()
        inner = engine()
        callers: list[int] = []

        def seen(stats: ForwardStats) -> None:
            callers.append(stats.callers)

        inner.scheduler.add_observer(seen)
        stop, task = await started(inner, path)
        a, b = (SocketBackend(path, ByteTokenizer(), model_id="m") for _ in range(2))
        await a.connect()
        assert (a.model_id, a.max_model_len) == (inner.model_id, 512)
        reqs_a, reqs_b = [req(i) for i in range(6)], [req(i) for i in range(6, 12)]
        # While a first call holds the engine, both workers' calls queue for the next forward.
        first = asyncio.create_task(a.score([req(50)]))
        await asyncio.sleep(0.01)
        got_a, got_b = await asyncio.gather(a.score(reqs_a), b.score(reqs_b))
        await first
        direct = await engine().score(reqs_a + reqs_b)
        assert got_a + got_b == direct
        assert all(isinstance(r, SpanLogprobs) for r in direct)
        # The prompts of both workers went through the engine's forwards together.
        assert max(callers) == 2
        # One meter, the engine's, timed every worker's calls; both workers read it.
        await asyncio.sleep(0.1)
        assert a.meter.completed == b.meter.completed == 3
        rate = a.meter.tokens_per_s
        assert rate is not None and rate == b.meter.tokens_per_s
        a.meter.begin(0.0)  # a worker's admission does not time calls itself
        a.meter.end(1.0, 10_000)
        assert (a.meter.completed, a.meter.tokens_per_s) == (3, rate)
        # The engine's refusal is the same error in the worker, with its figures.
        with pytest.raises(LimitExceeded) as info:
            await a.score([req(99, n=600)])
        assert (info.value.param, info.value.limit, info.value.value) == ("token_ids", 512, 600)
        await a.aclose()
        await b.aclose()
        stop.set()
        await task

    asyncio.run(main())


def test_a_lost_engine_fails_calls_as_unavailable_and_a_new_one_is_reached() -> None:
    async def main() -> None:
        path = socket_path()
        stop, task = await started(engine(), path)
        lost: list[bool] = []
        client = SocketBackend(path, ByteTokenizer(), model_id="m")
        client.on_lost = lambda: lost.append(True)
        await client.connect()
        stop.set()
        await task
        path.unlink(missing_ok=True)
        with pytest.raises(EngineUnavailable):
            await client.score([req(1)])
        assert lost == [True]
        stop, task = await started(engine(), path)
        assert isinstance((await client.score([req(1)]))[0], SpanLogprobs)
        await client.aclose()
        stop.set()
        await task

    asyncio.run(main())


def test_a_workers_background_work_is_background_work_in_the_engine_process() -> None:
    # auto's learning runs in a worker; the engine's scheduler must see it as the service's
    # own work (served after callers, in short forwards), so the mark crosses the socket.
    from service.backends.base import background_work, in_background

    seen: list[tuple[str, bool]] = []

    class Marking(PacedBackend):
        async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
            seen.append((requests[0].request_id, in_background()))
            return await super().score(requests)

    async def main() -> None:
        path = socket_path()
        stop, task = await started(
            Marking(ByteTokenizer(), SLOW, model="m", max_model_len=512, vocab_size=259,
                    batch_token_budget=8192),
            path,
        )  # fmt: skip
        client = SocketBackend(path, ByteTokenizer(), model_id="m")
        await client.score([req(1)])
        with background_work():
            await client.score([req(2)])
        await client.aclose()
        stop.set()
        await task

    asyncio.run(main())
    assert seen == [("r1", False), ("r2", True)]


def test_admission_counts_are_summed_over_the_workers(tmp_path: Path) -> None:
    shared_counts.create(tmp_path / "counts", 2)
    zero, one = SharedCounts(tmp_path / "counts", 0), SharedCounts(tmp_path / "counts", 1)
    zero.set(1, 500, 20)
    one.set(2, 700, 0)
    assert zero.totals() == one.totals() == (3, 1200, 20)
    # A restarted worker's slot starts empty: what its predecessor held left with it.
    SharedCounts(tmp_path / "counts", 1)
    assert zero.totals() == (1, 500, 20)
    with pytest.raises(ValueError, match="slot 2 outside the 2 slots"):
        SharedCounts(tmp_path / "counts", 2)


def test_several_workers_are_refused_for_a_remote_engine_only() -> None:
    with pytest.raises(
        ValueError, match=r"WORKERS=2 runs the paced, transformers and vllm.*remote"
    ):
        Settings(backend="remote", workers=2, engine_url="http://e:8000")
    for backend in ("paced", "transformers", "vllm"):
        assert Settings(backend=backend, workers=2).workers == 2
    assert Settings().workers == 1


class _DyingEngine(PacedBackend):
    """A backend whose engine dies on its second call (as a vLLM engine core can)."""

    calls = 0

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.calls += 1
        if self.calls > 1:
            raise BackendUnavailable("engine core died")
        return await super().score(requests)


def test_a_dead_backend_stops_the_engine_process_and_its_workers_see_it_unavailable() -> None:
    async def main() -> None:
        path = socket_path()
        inner = _DyingEngine(
            ByteTokenizer(), SLOW, model="m", max_model_len=512, vocab_size=259,
            batch_token_budget=8192,
        )  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(serve_engine(inner, path, stop))
        while not path.exists():
            await asyncio.sleep(0.005)
        client = SocketBackend(path, ByteTokenizer(), model_id="m")
        await client.connect()
        assert await client.check_score_mode() is None  # no vLLM check in this engine
        assert isinstance((await client.score([req(1)]))[0], SpanLogprobs)
        # Not the engine's BackendUnavailable (a worker would take itself for dead): the
        # connection drops, as when the engine process exits, and the supervisor restarts it.
        with pytest.raises(EngineUnavailable):
            await client.score([req(2)])
        assert await asyncio.wait_for(task, 5) is True
        assert stop.is_set()
        await client.aclose()

    asyncio.run(main())


def test_a_workers_liveness_probes_are_not_timed_into_the_engines_meter() -> None:
    # Issue 90: the engine process timed every worker's canary (two tiny prompts, its fixed
    # cost dominating) as a measurement, so an idle server's rate decayed to the canary's and
    # stayed fresh, and admission refused with 422 work that fits. Made under unmetered(),
    # as serving.canaries' probes are, they leave the meter as real work left it.
    from service.strategies.request import Estimate
    from serving.admission.control import Admission
    from serving.metrics import ServiceMetrics

    async def main() -> None:
        path = socket_path()
        stop, task = await started(engine(), path)
        worker = SocketBackend(path, ByteTokenizer(), model_id="m")
        await worker.connect()
        for i in range(5):  # real work: 600 prompt tokens a call, about 0.05 s each
            await worker.score([req(6 * i + k) for k in range(6)])
        await asyncio.sleep(0.1)
        meter = worker.meter
        rate, measured_at = meter.tokens_per_s, meter.updated_at
        assert rate is not None and meter.completed == 5 and meter.calls(time.monotonic()) == 5
        with unmetered():
            for i in range(40):  # canaries: 30 tokens, the 0.02 s overhead each
                await worker.score([req(100 + i, n=15), req(200 + i, n=15)])
        await asyncio.sleep(0.1)
        now = time.monotonic()
        assert meter.tokens_per_s == rate and meter.completed == 5 and meter.calls(now) == 5
        # The newest measurement is still the real work's: the rate's age grows, so the rate
        # canary's stale trigger can fire.
        assert measured_at is not None and meter.updated_at == measured_at
        assert meter.age_s(now) == pytest.approx(now - measured_at) and now - measured_at > 0.8
        # Work that takes 5 s at the real rate fits a 10 s deadline (7.5 s allowed): admitted.
        # (With the canaries timed, the rate fell to about a third and this was a 422.)
        admission = Admission(Settings(), ServiceMetrics(include_default_registry=False),
                              meter=meter)  # fmt: skip
        big = Estimate(prompts=100, prompt_tokens=int(5 * rate), new_tokens=0, param="passages")
        admission.release(admission.reserve(big, Deadline(now + 10.0, 10.0, "request_timeout_s")))
        await worker.aclose()
        stop.set()
        await task

    asyncio.run(main())


def test_the_warm_ups_seed_reaches_the_engines_meter_until_a_call_completes() -> None:
    # One process seeds admission's meter with the warm-up's rate; with the warm-up unmetered,
    # a worker's seed goes to the engine process's meter instead.
    async def main() -> None:
        path = socket_path()
        stop, task = await started(engine(), path)
        worker = SocketBackend(path, ByteTokenizer(), model_id="m")
        await worker.connect()
        worker.meter.seed(300, 0.1)
        # Polled, not slept: the seed crosses the socket and the engine's meter comes back,
        # which took longer than a fixed 0.1 s on a busy host.
        await until(lambda: worker.meter.tokens_per_s is not None)
        assert worker.meter.tokens_per_s == pytest.approx(3000.0)
        assert worker.meter.completed == 0
        await worker.score([req(1)])
        await until(lambda: worker.meter.completed == 1)
        worker.meter.seed(10, 10.0)  # ignored once a real call completed
        await asyncio.sleep(0.2)  # time for a seed that was not ignored to come back
        assert worker.meter.completed == 1 and (worker.meter.tokens_per_s or 0.0) > 3000.0
        await worker.aclose()
        stop.set()
        await task

    asyncio.run(main())


class _Accepted:
    """The engine's side of every worker connection, as ``serve_engine`` accepts them (the
    test's window on its write buffers); the kernel's send buffer of each is made small, so
    what a worker does not read piles up in the engine process at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        real = asyncio.start_unix_server

        async def capturing(handle: Any, *args: Any, **kwargs: Any) -> asyncio.Server:
            async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                self.writers.append(writer)
                await handle(reader, writer)

            return await real(accepted, *args, **kwargs)

        # The one the engine side calls (service.backends.engines.engine_socket uses asyncio's).
        monkeypatch.setattr(asyncio, "start_unix_server", capturing)


async def _silent_peer(path: Path) -> socket.socket:
    """A connection that never reads (a worker stopped or hung)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, str(path))
    return sock


async def _busy(worker: SocketBackend, seconds: float, until: Callable[[], bool]) -> None:
    """Calls back to back, 20 at a time, each ending one push of the meter."""
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline and not until():
        await asyncio.gather(*(worker.score([req(i + k, n=20)]) for k in range(20)))
        i += 20


# asyncio's write-buffer high-water mark, and the largest meter snapshot (301 buckets).
_BOUND = 64 * 1024 + 8 * 1024


def test_a_worker_that_stops_reading_does_not_grow_the_engines_write_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 90: the engine wrote its whole meter to every worker up to 50 times a second
    # without waiting, so one that stopped reading grew the engine's memory 180 MB in 10 s.
    accepted = _Accepted(monkeypatch)

    async def main() -> int:
        path = socket_path()
        stop, task = await started(engine(), path)
        silent = await _silent_peer(path)
        worker = SocketBackend(path, ByteTokenizer(), model_id="m")
        await worker.connect()
        while len(accepted.writers) < 2:
            await asyncio.sleep(0.005)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, accepted.writers[0].transport.get_write_buffer_size())
                await asyncio.sleep(0.01)

        watching = asyncio.create_task(watch())
        await _busy(worker, 3.0, lambda: False)
        watching.cancel()
        await worker.aclose()
        silent.close()
        stop.set()
        await task
        return peak

    peak = asyncio.run(main())
    assert peak <= _BOUND, f"{peak} bytes waiting for a worker that reads nothing"


def test_a_worker_connection_that_does_not_drain_in_time_is_closed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    accepted = _Accepted(monkeypatch)

    async def main() -> None:
        path = socket_path()
        stop = asyncio.Event()
        task = asyncio.create_task(serve_engine(engine(), path, stop, write_timeout_s=0.5))
        while not path.exists():
            await asyncio.sleep(0.005)
        silent = await _silent_peer(path)
        worker = SocketBackend(path, ByteTokenizer(), model_id="m")
        await worker.connect()
        while len(accepted.writers) < 2:
            await asyncio.sleep(0.005)
        gone = accepted.writers[0]
        await _busy(worker, 20.0, gone.is_closing)
        assert gone.is_closing() and gone.transport.get_write_buffer_size() == 0
        # The worker that reads is served on.
        assert isinstance((await worker.score([req(1)]))[0], SpanLogprobs)
        assert worker.connected
        await worker.aclose()
        silent.close()
        stop.set()
        await task

    asyncio.run(main())
    assert "a worker read nothing for 0.5 s" in caplog.text
