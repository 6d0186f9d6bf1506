"""ForwardScheduler on a fake forward: sharing, arrival order, cancellation, failures, packing.

The forward here is a coroutine that records each batch and sleeps, so the tests see exactly
which prompts shared a forward without a model (the model-backed equality check is in
test_transformers_backend.py).
"""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from service.backends.base import PromptFailure, ScoreResult, SpanLogprobs, SpanRequest
from service.backends.scheduling.batching import plan_batches
from service.backends.scheduling.scheduler import ForwardScheduler, ForwardStats
from service.errors import BackendUnavailable


def prompts(tag: str, count: int, length: int = 10) -> list[SpanRequest]:
    return [SpanRequest(f"{tag}{i}", tuple(range(length + i % 3)), 1, 3) for i in range(count)]


class FakeForward:
    """Scores a prompt as -len(prompt); records batches; fails prompts named in ``fail``."""

    def __init__(self, delay: float = 0.01, fail: frozenset[str] = frozenset()) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay
        self.fail = fail
        self.gate: asyncio.Event | None = None

    async def __call__(self, batch: list[SpanRequest]) -> list[ScoreResult]:
        self.batches.append([r.request_id for r in batch])
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.delay)
        return [
            PromptFailure(r.request_id, "boom")
            if r.request_id in self.fail
            else SpanLogprobs(r.request_id, (-float(len(r.token_ids)),))
            for r in batch
        ]


def scheduler(forward: FakeForward, token_budget: int = 60) -> ForwardScheduler:
    return ForwardScheduler(forward, token_budget=token_budget, row_budget=10**6, head_mode="mask")


def test_concurrent_callers_share_forwards_and_get_their_own_results_in_order() -> None:
    forward = FakeForward()
    sched = scheduler(forward)
    stats: list[ForwardStats] = []
    sched.add_observer(stats.append)
    work = {tag: prompts(tag, 6) for tag in "abcd"}
    got: dict[str, list[ScoreResult]] = {}

    async def main() -> None:
        async def one(tag: str) -> None:
            got[tag] = await sched.score(work[tag])

        async with anyio.create_task_group() as tg:
            for tag in work:
                tg.start_soon(one, tag)

    anyio.run(main)
    for tag, reqs in work.items():
        assert [r.request_id for r in got[tag]] == [r.request_id for r in reqs]
        assert all(isinstance(r, SpanLogprobs) for r in got[tag])
    # 24 prompts of 10-12 tokens under 60 padded tokens: 6 rows per forward at most.
    assert sum(len(b) for b in forward.batches) == 24
    assert all(len(b) <= 6 for b in forward.batches)
    shared = [b for b in forward.batches if len({rid[0] for rid in b}) > 1]
    assert len(shared) >= len(forward.batches) - 2
    assert len(forward.batches) < 4 * len(plan_batches(work["a"], token_budget=60, row_budget=99))
    assert [s.prompts for s in stats] == [len(b) for b in forward.batches]
    assert all(s.padded_tokens <= 60 and s.token_budget == 60 for s in stats)
    assert max(s.callers for s in stats) == 4
    assert sched.queue_depth == 0


def test_alone_a_call_batches_exactly_as_plan_batches() -> None:
    forward = FakeForward(delay=0)
    reqs = [SpanRequest(str(i), tuple(range(n)), 1, 2) for i, n in enumerate([5, 30, 12, 12, 7])]
    anyio.run(lambda: scheduler(forward, token_budget=40).score(reqs))
    planned = plan_batches(reqs, token_budget=40, row_budget=10**6)
    assert forward.batches == [[reqs[i].request_id for i in b] for b in planned]


def test_calls_complete_in_arrival_order_the_oldest_filling_each_forward_first() -> None:
    # Four equal calls arriving together: round-robin turns made them all finish at the end
    # (issue 44); oldest first, each finishes after its own work plus the queue ahead.
    forward = FakeForward()
    sched = scheduler(forward)
    finished: list[str] = []

    async def main() -> None:
        async def one(tag: str, count: int) -> None:
            await sched.score(prompts(tag, count))
            finished.append(tag)

        async with anyio.create_task_group() as tg:
            for tag in "abcd":
                tg.start_soon(one, tag, 15)
                await anyio.sleep(0.001)

    anyio.run(main)
    assert finished == list("abcd")
    ends = {
        t: 1 + max(i for i, b in enumerate(forward.batches) if t in b[0] + b[-1]) for t in "abcd"
    }
    # 15 prompts of 10-12 tokens are 3 forwards of 5 on their own: a done after its 3rd,
    # b after the 6th, and so on (a forward's spare room goes to the next oldest).
    assert ends["a"] <= 3 and ends["b"] <= 6 and ends["c"] <= 9
    # The oldest caller's prompts always come first in a forward.
    for batch in forward.batches:
        tags = [rid[0] for rid in batch]
        assert tags == sorted(tags), batch


def test_a_forward_is_packed_only_once_the_engine_is_free() -> None:
    # A generation batch holds the engine: a caller that leaves meanwhile never reaches a
    # forward, and the forward packed afterwards holds only the callers still there.
    lock = anyio.Lock()
    forward = FakeForward(delay=0)
    sched = ForwardScheduler(
        forward, token_budget=60, row_budget=10**6, head_mode="mask", engine_lock=lock
    )

    async def main() -> None:
        # The lock stands for a generation batch holding the engine.
        async with anyio.create_task_group() as tg, lock:
            tg.start_soon(sched.score, prompts("keep", 2))
            with anyio.move_on_after(0.05):
                await sched.score(prompts("gone", 4))
            assert forward.batches == []

    anyio.run(main)
    assert forward.batches == [["keep1", "keep0"]]  # longest first


def test_a_cancelled_caller_drops_its_pending_prompts() -> None:
    forward = FakeForward()
    sched = scheduler(forward)
    depths: list[int] = []

    async def main() -> None:
        forward.gate = asyncio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.score, prompts("keep", 3))
            with anyio.move_on_after(0.05):
                async with anyio.create_task_group() as inner:
                    inner.start_soon(sched.score, prompts("gone", 40))
                    await anyio.sleep(0.02)
                    depths.append(sched.queue_depth)
            depths.append(sched.queue_depth)
            forward.gate.set()

    anyio.run(main)
    # Afterwards only what is left of the other caller's 3 prompts waits.
    assert depths[0] > 30 and depths[1] < 3
    scored = [rid for b in forward.batches for rid in b]
    # Only what was already in the first (gated) forward ran of the cancelled call.
    assert sum(rid.startswith("gone") for rid in scored) <= 5
    assert sum(rid.startswith("keep") for rid in scored) == 3


def test_failures_stay_per_prompt_and_a_broken_forward_fails_only_its_callers() -> None:
    forward = FakeForward(fail=frozenset({"a1"}))
    sched = scheduler(forward)
    results = anyio.run(lambda: sched.score(prompts("a", 4)))
    assert [type(r).__name__ for r in results] == [
        "SpanLogprobs",
        "PromptFailure",
        "SpanLogprobs",
        "SpanLogprobs",
    ]

    async def broken(batch: list[SpanRequest]) -> list[ScoreResult]:
        raise BackendUnavailable("closed")

    dead = ForwardScheduler(broken, token_budget=60, row_budget=99, head_mode="mask")
    with pytest.raises(BackendUnavailable):
        anyio.run(lambda: dead.score(prompts("x", 3)))
    assert dead.queue_depth == 0
    assert anyio.run(lambda: dead.score([])) == []


def test_a_failing_observer_does_not_stop_the_engine() -> None:
    sched = scheduler(FakeForward(delay=0))

    def bad(stats: ForwardStats) -> None:
        raise ValueError("metrics bug")

    sched.add_observer(bad)
    assert len(anyio.run(lambda: sched.score(prompts("a", 8)))) == 8


def test_the_fill_takes_the_offers_that_pad_least() -> None:
    # a's 30-token prompt is the oldest call's and anchors the forward (budget 60: two rows of
    # 30). Taken in arrival order, b's 12 would fill it (18 tokens of padding); c's 29 pads 1,
    # so it goes in instead, and b's prompts make the next forward.
    forward = FakeForward(delay=0)
    sched = scheduler(forward, token_budget=60)

    def reqs(tag: str, lengths: list[int]) -> list[SpanRequest]:
        return [SpanRequest(f"{tag}{n}", tuple(range(n)), 1, 2) for n in lengths]

    async def main() -> None:
        await asyncio.gather(
            sched.score(reqs("a", [30])),
            sched.score(reqs("b", [12, 11])),
            sched.score(reqs("c", [29])),
        )

    anyio.run(main)
    assert forward.batches == [["a30", "c29"], ["b12", "b11"]]


def test_one_call_that_makes_the_engine_raise_fails_alone() -> None:
    # Its prompt makes the shared forward raise (not a per-prompt PromptFailure): the forward
    # is retried call by call, the neighbours get their scores, the culprit the exception.
    class Raising(FakeForward):
        async def __call__(self, batch: list[SpanRequest]) -> list[ScoreResult]:
            if any(r.request_id.startswith("bad") for r in batch):
                self.batches.append([r.request_id for r in batch])
                raise ValueError("the engine chokes on this prompt")
            return await super().__call__(batch)

    forward = Raising(delay=0)
    sched = scheduler(forward, token_budget=200)
    outcome: dict[str, object] = {}

    async def main() -> None:
        async def one(tag: str) -> None:
            try:
                outcome[tag] = await sched.score(prompts(tag, 3))
            except ValueError as exc:
                outcome[tag] = exc

        async with anyio.create_task_group() as tg:
            for tag in ("a", "bad", "c"):
                tg.start_soon(one, tag)

    anyio.run(main)
    assert isinstance(outcome["bad"], ValueError)
    for tag in "ac":
        got = outcome[tag]
        assert isinstance(got, list) and all(isinstance(r, SpanLogprobs) for r in got)
    assert sched.queue_depth == 0
    # A later call is served as usual.
    assert len(anyio.run(lambda: sched.score(prompts("later", 2)))) == 2


@pytest.mark.parametrize("how", ["cancel", "packing_fails", "base_exception"])
def test_no_caller_waits_forever_when_the_worker_stops(how: str) -> None:
    # Callers queued behind a running forward, then the worker ends: cancelled, a bug in the
    # packing step, or a BaseException from the forward. Every caller gets BackendUnavailable
    # (none hangs: each await is bounded), and the next call starts a new worker.
    class Stop(BaseException):
        pass

    forward = FakeForward(delay=0)
    sched = scheduler(forward)
    errors: list[BaseException] = []

    async def main() -> None:
        forward.gate = asyncio.Event()

        async def one(tag: str) -> None:
            try:
                with anyio.fail_after(2):
                    await sched.score(prompts(tag, 10))
            except BackendUnavailable as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for tag in "abc":
                tg.start_soon(one, tag)
            await anyio.sleep(0.02)  # a's first forward is running (gated), the rest queued
            worker = sched.worker
            assert worker is not None and not worker.done()
            if how == "cancel":
                worker.cancel()
            elif how == "packing_fails":

                def broken() -> None:
                    raise KeyError("packing bug")

                sched._take = broken  # type: ignore[method-assign,assignment]
                forward.gate.set()
            else:

                async def stop(batch: list[SpanRequest]) -> list[ScoreResult]:
                    raise Stop

                sched._run_batch = stop
                forward.gate.set()
        assert worker.done()

    anyio.run(main)
    assert len(errors) == 3
    assert sched.queue_depth == 0
    forward.gate = None
    sched._run_batch = forward
    sched.__dict__.pop("_take", None)
    assert len(anyio.run(lambda: sched.score(prompts("later", 2)))) == 2


class PacedForward(FakeForward):
    """Takes ``s_per_token`` a padded token, as an engine does; records each batch's tags."""

    def __init__(self, s_per_token: float) -> None:
        super().__init__(delay=0)
        self.s_per_token = s_per_token
        self.padded: list[int] = []

    async def __call__(self, batch: list[SpanRequest]) -> list[ScoreResult]:
        padded = len(batch) * max(len(r.token_ids) for r in batch)
        self.padded.append(padded)
        self.delay = padded * self.s_per_token
        return await super().__call__(batch)


def test_the_services_own_work_yields_to_a_caller_within_a_short_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A background learning run of 30 prompts holds the engine when a caller arrives: the
    # caller's prompts go in the next forward (not after the run's), alone, and the run's
    # forwards were kept to about BACKGROUND_FORWARD_S (0.05 s here: 25 tokens at 2 ms a
    # token, two 12-token prompts), so the caller waited one short forward; before, the run's
    # forwards filled the whole budget (600 tokens here, 1.2 s).
    from service.backends.base import background_work
    from service.backends.scheduling import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "BACKGROUND_FORWARD_S", 0.05)
    forward = PacedForward(s_per_token=0.002)
    sched = scheduler(forward, token_budget=600)
    stats: list[ForwardStats] = []
    sched.add_observer(stats.append)
    background = [SpanRequest(f"b{i}", tuple(range(12)), 1, 3) for i in range(30)]

    async def main() -> float:
        async def learn() -> None:
            with background_work():
                await sched.score(background)

        async with anyio.create_task_group() as tg:
            tg.start_soon(learn)
            await anyio.sleep(0.1)
            t0 = time.perf_counter()
            await sched.score(prompts("c", 3))
            return time.perf_counter() - t0

    caller_s = anyio.run(main)
    first_caller = next(i for i, b in enumerate(forward.batches) if b[0].startswith("c"))
    assert all({rid[0] for rid in b} in ({"b"}, {"c"}) for b in forward.batches)
    assert forward.batches[first_caller] == ["c2", "c1", "c0"]
    # Before any forward was timed, one prompt; then about 0.05 s of tokens.
    assert forward.padded[0] == 12
    assert all(
        p <= 25 for p, b in zip(forward.padded, forward.batches, strict=True) if b[0][0] == "b"
    )
    assert sum(len(b) for b in forward.batches) == 33
    # One short background forward at most ahead of it, and its own.
    (waited,) = [s.queue_waits_s[0] for s in stats if s.queue_waits_s and s.prompts == 3]
    assert waited <= 0.05 + 0.03
    assert caller_s < 0.3


def test_a_callers_call_is_packed_before_older_background_work() -> None:
    from service.backends.base import background_work, in_background

    forward = FakeForward(delay=0)
    sched = scheduler(forward)

    async def main() -> None:
        async def learn() -> None:
            with background_work():
                assert in_background()
                await sched.score(prompts("b", 2))

        # Both queue while the first forward runs; the caller came second, goes first.
        forward.gate = asyncio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.score, prompts("a", 1))
            await anyio.sleep(0.01)
            tg.start_soon(learn)
            await anyio.sleep(0.01)
            tg.start_soon(sched.score, prompts("c", 1))
            await anyio.sleep(0.01)
            assert not in_background()
            forward.gate.set()

    anyio.run(main)
    assert [b[0][0] for b in forward.batches] == ["a", "c", "b"]
