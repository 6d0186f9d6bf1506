"""Running one request's work: admission, one deadline, cancellation on client disconnect.

The native and the rerank routes go through ``execute``, a calibration through
``run_admitted`` (the same path with its own deadline and one admitted backend per query):

    ready? (503) -> request slot (503) -> [deadline (504) | client disconnect] -> work

The work gets a ``Reorderer`` whose backend checks the request's limits and admits its prompt
tokens (``serving.admission``). Cancellation reaches the backend call: the fake backend and vLLM
stop at once; the transformers backend's scheduler drops the request's prompts not yet in a
forward and discards its rows of the forward already running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request

from service.config.settings import Settings
from service.errors import BackendUnavailable, EngineTimeout
from service.pipeline import Reorderer, ReorderResult
from serving.admission.backends import AdmittedBackend
from serving.admission.deadline import Deadline
from serving.admission.errors import ClientDisconnected, DeadlineExceeded
from serving.context import AppContext, request_id_of

log = logging.getLogger(__name__)

T = TypeVar("T")


async def execute(
    ctx: AppContext,
    request: Request,
    work: Callable[[Reorderer], Awaitable[ReorderResult]],
) -> ReorderResult:
    """Run one reorder or rerank request's ``work`` under the service's admission and its
    deadline (``request_timeout_s``), then count it in the metrics.

    Raises:
        NotReady: loading, warming up, draining or unhealthy (503).
        Overloaded: too many requests in flight (503), the token budget is full, or the
            queue ahead would not let it finish before its deadline.
        DeadlineExceeded: ``request_timeout_s`` passed; the work was cancelled (504).
        ClientDisconnected: the client went away; the work was cancelled.
        ReorderError: whatever the work raised.
    """
    result = await run_admitted(
        ctx, request, lambda reorderer: work(reorderer()), deadline_of=Deadline.of_request
    )
    ctx.metrics.observe(result)
    ctx.metrics.within_deadline.inc()
    if result.auto is not None:
        ctx.engine.learner.count(result.auto.path)
    estimated = result.timing.estimated_s
    log.info(
        "request %s: %s%s, %d passages, %d prompts (%d failed), %d prompt tokens, %.3f s "
        "in the model (estimated %s), %.3f s",
        request_id_of(request.scope),
        result.strategy,
        f" ({result.auto.path})" if result.auto is not None else "",
        result.n_passages,
        result.prompts,
        result.usage.prompts_failed,
        result.usage.prompt_tokens,
        result.timing.scoring_s,
        "-" if estimated is None else f"{estimated:.3f} s",
        result.timing.total_s,
    )
    return result


async def run_admitted(
    ctx: AppContext,
    request: Request,
    work: Callable[[Callable[[], Reorderer]], Awaitable[T]],
    *,
    deadline_of: Callable[[Settings], Deadline],
) -> T:
    """Run ``work`` in one request slot, under a deadline, cancelled if the client leaves.

    ``work`` gets a factory of ``Reorderer``s, each on a fresh ``AdmittedBackend``: one per
    request, whose per-request limits (prompts, prompts x tokens) then apply to it alone. A
    calibration takes one per query, so each query is held to the limits of one request.

    ``deadline_of`` makes the request's deadline (``Deadline.of_request``,
    ``Deadline.of_calibration``) once it may be served; every check on its way takes that one
    value.

    Raises:
        as ``execute``, with the deadline's setting in the 504's message.
    """
    await ctx.check_serving()
    backend = ctx.engine.require()
    settings = ctx.settings
    rid = request_id_of(request.scope)

    deadline = deadline_of(settings)
    gates: list[AdmittedBackend] = []

    def reorderer() -> Reorderer:
        # The backend is also the request's gate: ``Reorderer.reorder`` admits the whole
        # request through it and gives back what its calls did not take, however it ends.
        gate = AdmittedBackend(
            backend,
            ctx.admission,
            settings,
            deadline=deadline,
        )
        gates.append(gate)
        return Reorderer(
            gate, settings, ctx.engine.profiles, ctx.engine.traffic, ctx.engine.learner, gate
        )

    t0 = time.perf_counter()
    with ctx.admission.request():
        try:
            with anyio.fail_after(deadline.length_s):
                result = await cancel_on_disconnect(request, lambda: work(reorderer))
        except TimeoutError:
            # What admission expected of it: a 504 of admitted work is an estimate that was
            # wrong (issue 77), and says by how much.
            estimates = [g.estimated_s for g in gates if g.estimated_s is not None]
            expected = (
                f" (admission estimated its model calls at {sum(estimates):.1f} s)"
                if estimates
                else ""
            )
            raise DeadlineExceeded(
                f"the request did not finish within {deadline.named}; "
                f"its scoring was cancelled{expected}"
            ) from None
        except ClientDisconnected:
            log.info(
                "request %s: client disconnected after %.3f s, work cancelled",
                rid,
                time.perf_counter() - t0,
            )
            raise
        except (BackendUnavailable, EngineTimeout):
            # Maybe the engine died: let the watchdog check now rather than at the next tick.
            ctx.lifecycle.suspect()
            raise
    ctx.lifecycle.succeeded()
    return result


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Await ``work()``, cancelling it if the client disconnects first.

    Starlette does not cancel a handler when its client goes away; after the body has been read,
    the next ``receive`` returns only when the client disconnects (or the response is sent),
    so a watcher task waits on it.

    Raises:
        ClientDisconnected: the client went away and ``work`` was cancelled.
    """
    disconnected = False
    result: list[T] = []
    error: Exception | None = None

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:
            # Raised from here, not inside the task group, which would wrap it in a group.
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if disconnected and not result:
        raise ClientDisconnected("the client closed the connection; the work was cancelled")
    return result[0]
