"""One engine process for several workers: ``SocketBackend`` against ``serve_engine``, in
process over a real Unix socket (app.workers runs them in separate processes)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from service.backends.base import ScoreResult, SpanLogprobs, SpanRequest
from service.backends.byte_tokenizer import ByteTokenizer
from service.backends.engine_socket import SocketBackend, serve_engine
from service.backends.paced import PacedBackend, PacedProfile
from service.backends.scheduler import ForwardStats
from service.config.settings import Settings
from service.errors import BackendUnavailable, EngineUnavailable, LimitExceeded
from service.runtime import shared_counts
from service.runtime.shared_counts import SharedCounts

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
