"""``EngineLoad``: a shared remote engine's queue, read from its ``/metrics`` (vLLM's Prometheus
text) over a scripted transport, on a clock the tests move."""

from __future__ import annotations

import anyio
import httpx
import pytest

from service.backends.transport.engine_client import EngineClient
from service.backends.transport.engine_load import EngineLoad, EngineQueue, parse_queue

# As vLLM writes it: HELP/TYPE lines, labelled series, one per engine (data parallel).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="Qwen/Qwen3-8B"}} {run0}
vllm:num_requests_running{{engine="1",model_name="Qwen/Qwen3-8B"}} {run1}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="Qwen/Qwen3-8B"}} {wait}
vllm:num_requests_waiting{{engine="1",model_name="Qwen/Qwen3-8B"}} 0.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="Qwen/Qwen3-8B"}} {prompt}
vllm:prompt_tokens_created{{engine="0",model_name="Qwen/Qwen3-8B"}} 1.7e+09
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="Qwen/Qwen3-8B"}} 12.0
process_open_fds 45.0
"""


def vllm_text(running: float = 0, waiting: float = 0, prompt_tokens: float = 100) -> str:
    return VLLM_METRICS.format(run0=running, run1=0.0, wait=waiting, prompt=prompt_tokens)


class Engine:
    """``/metrics`` of an engine whose queue the test sets; each read while others' requests
    run advances its token counter (they make progress)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.tokens = 100.0
        self.status = 200
        self.text: str | None = None
        self.reads = 0
        self.progress = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.reads += 1
        if self.status != 200:
            return httpx.Response(self.status, text="no such route")
        if self.progress and self.running:
            self.tokens += 50
        if self.text is not None:
            return httpx.Response(200, text=self.text)
        return httpx.Response(200, text=vllm_text(self.running, self.waiting, self.tokens))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load_on(engine: Engine, own: list[int], clock: Clock, **kwargs: float) -> EngineLoad:
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(engine), retries=0)
    return EngineLoad(client, lambda: own[0], clock=clock, **kwargs)


def test_the_queue_is_summed_over_engines_and_read_with_its_counters() -> None:
    queue = parse_queue(vllm_text(running=3, waiting=2, prompt_tokens=400))
    assert queue == EngineQueue(running=3.0, waiting=2.0, tokens=412.0)
    # No counters: the queue alone; no queue gauges: not vLLM's metrics.
    gauges = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    assert parse_queue(gauges) == EngineQueue(1.0, 0.0, None)
    assert parse_queue("process_open_fds 45.0\nvllm:num_requests_running 1\n") is None
    assert parse_queue("<html>login</html>") is None


async def test_other_clients_work_is_busy_and_this_replicas_own_is_not() -> None:
    engine, own, clock = Engine(), [0], Clock()
    load = load_on(engine, own, clock)
    assert load.busy()  # asked before any read: not known yet
    await load.read_once()
    assert not load.busy()  # an empty queue
    engine.running = 2  # another replica's two prompts
    await load.read_once()
    assert load.busy() and load.others == 2
    # Only our own background run's prompts in the queue: idle as far as others go.
    engine.running, own[0] = 8, 8
    await load.read_once()
    assert not load.busy()
    # Ours and one waiting request of another client's.
    engine.waiting = 1
    await load.read_once()
    assert load.busy() and load.others == 1


async def test_a_queue_that_does_not_move_is_stale_not_busy() -> None:
    # vLLM leaves its gauges at their last values when every request was aborted (as a
    # cancelled background run's are): no tokens moved, so no one is being served.
    engine, own, clock = Engine(), [0], Clock()
    load = load_on(engine, own, clock)
    engine.running = 8
    await load.read_once()
    assert load.busy()  # the first read cannot tell a stale queue from a working one
    engine.progress = False
    await load.read_once()
    assert not load.busy()
    engine.progress = True
    await load.read_once()
    assert load.busy()


async def test_an_old_reading_tells_nothing() -> None:
    engine, own, clock = Engine(), [0], Clock()
    load = load_on(engine, own, clock, poll_s=1.0)
    await load.read_once()
    assert not load.busy()
    clock.now += 60  # no read since (the poller paused): the next one is awaited
    assert load.busy()
    await load.read_once()
    assert not load.busy()


@pytest.mark.parametrize("broken", ["missing", "not_vllm", "unreachable"])
async def test_an_unreadable_queue_is_busy_for_the_grace_then_the_local_rule_decides(
    broken: str,
) -> None:
    engine, own, clock = Engine(), [0], Clock()
    if broken == "unreachable":

        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("connection refused", request=request)

        client = EngineClient("http://engine:8000", transport=httpx.MockTransport(refuse))
        load = EngineLoad(client, lambda: own[0], clock=clock, grace_s=30.0)
    else:
        engine.status = 404 if broken == "missing" else 200
        engine.text = "# a gateway's own metrics\nrequests_total 5\n"
        load = load_on(engine, own, clock, grace_s=30.0)
    await load.read_once()
    assert load.failure is not None and not load.read
    assert load.busy()
    clock.now += 29
    await load.read_once()
    assert load.busy()
    clock.now += 2  # 31 s since the first failure
    await load.read_once()
    assert not load.busy()
    if broken != "unreachable":
        # Readable again: the queue decides again, and a later failure has its grace anew.
        engine.status, engine.text, engine.running = 200, None, 1
        await load.read_once()
        assert load.failure is None and load.busy()
        engine.status = 503
        clock.now += 10
        await load.read_once()
        assert load.busy()


async def test_reads_run_only_while_asked() -> None:
    engine, own = Engine(), [0]
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(engine))
    load = EngineLoad(client, lambda: own[0], poll_s=0.01)
    async with anyio.create_task_group() as tg:
        tg.start_soon(load.run)
        await anyio.sleep(0.1)
        assert engine.reads == 0  # no background run asked: the engine is not polled
        load.busy()
        with anyio.fail_after(5):
            while engine.reads < 3:
                await anyio.sleep(0.01)
        assert not load.busy()
        tg.cancel_scope.cancel()
