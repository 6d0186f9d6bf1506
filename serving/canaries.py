"""The engine's canaries: the tiny probe request (the warm-up before ``/ready``, then the
liveness canary ``serving.supervisor`` runs when no request has proved the engine alive), and
the rate canary, which re-measures the engine's prefill and decode rates for admission when
they are in doubt (a refusal, work over its deadline on an unconfirmed rate) or stale.

The rate canary is the service's own work: it waits for an idle engine, is timed into the
meter without holding a place in the queue (``MeteredBackend``), and is cancelled as soon as
a request arrives, so it never delays a caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import anyio

from service.backends.base import LogprobBackend
from service.backends.engines.engine_socket import unmetered
from service.backends.engines.remote_backend import RemoteBackend
from service.errors import (
    BackendUnavailable,
    ClientError,
    EngineTimeout,
    EngineUnavailable,
)
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.runtime.throughput import FRESH_S
from serving.admission.backends import MeteredBackend
from serving.admission.control import Admission
from serving.context import AppContext

log = logging.getLogger(__name__)

DefaultRequest = Callable[[str, Sequence[Passage], str], ReorderRequest]
"""``(query, passages, request_id)`` -> the request the routes make of a body naming no
strategy (the server's defaults): the warm-up runs the default strategy once through it."""

# The warm-up and canary request: two short passages, the default design (two prompts of one
# passage each), so it costs two tiny forwards and still runs tokenizer, model and solver.
PROBE_QUERY = "What is the capital of France?"
PROBE_PASSAGES = (
    Passage(text="Paris is the capital and largest city of France."),
    Passage(text="Berlin is the capital of Germany."),
)


# A canary that timed out (a failure only if nothing else progressed meanwhile).
NO_ANSWER = "no answer within the canary's deadline (canary_timeout_s)"

# The rate canary (issue 70): four passages of a few sentences, each prompt two of them, so a
# few hundred prompt tokens a prompt: large enough that fixed costs do not dominate the rate,
# a few seconds on a CPU and milliseconds on a GPU.
RATE_QUERY = "Which river flows through the capital of the country described here?"
RATE_PASSAGES = tuple(
    Passage(text=" ".join([text] * 4))
    for text in (
        "Paris is the capital and largest city of France, on the river Seine.",
        "Berlin is the capital of Germany; the Spree and the Havel flow through it.",
        "Madrid, the capital of Spain, lies on the Manzanares in the centre of the country.",
        "Rome, the capital of Italy, was built on seven hills beside the river Tiber.",
    )
)
# At most one rate canary this often, however many refusals ask for one.
_REMEASURE_MIN_S = 10.0
# How often the rate canary's loop looks at the estimate's age.
_REMEASURE_POLL_S = 30.0
# The rate canary starts only once the engine has been idle this long: a refused caller, or
# a client sending one request after another, sends its next request within milliseconds of
# the last answer, and a canary started then had its forward (about 1.5 s on a 2-core CPU)
# sit in front of that request. It is preempted when a request arrives either way.
_REMEASURE_IDLE_S = 1.0


async def remeasure_loop(ctx: AppContext, backend: LogprobBackend) -> None:
    """Re-measure the engine's rate when it is in doubt (issue 70): asked for by admission
    (a refusal, or work over its deadline on an unconfirmed rate), or stale (no measurement
    for ``FRESH_S``). Waits for an idle engine, scores the rate canary timed into the meter,
    and is preempted like ``auto``'s background runs when a request arrives. Never raises."""
    admission = ctx.admission
    wake = anyio.Event()
    admission.on_remeasure = wake.set
    last = -_REMEASURE_MIN_S
    while True:
        now = time.monotonic()
        age = admission.meter.age_s(now)
        why = admission.remeasure_wanted or ("stale" if age is not None and age > FRESH_S else None)
        if why is None or now - last < _REMEASURE_MIN_S or not ctx.lifecycle.ready:
            # Nothing asked (or asked too soon after the last): until asked, or the next look.
            wait_s = _REMEASURE_POLL_S if why is None else _REMEASURE_MIN_S - (now - last)
            with anyio.move_on_after(max(0.05, wait_s)):
                await wake.wait()
            wake = anyio.Event()
            admission.on_remeasure = wake.set
            continue
        await _idle_for(admission, _REMEASURE_IDLE_S)
        last = time.monotonic()
        # Not measured (failed, or preempted by a request whose own calls measure the engine):
        # asked again later.
        await measure_rates(ctx, backend, why)


async def _idle_for(admission: Admission, seconds: float, poll_s: float = 0.05) -> None:
    """Return once no request has used the engine for ``seconds`` on end."""
    idle_since: float | None = None
    while True:
        now = time.monotonic()
        if admission.tokens_in_flight:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= seconds:
            return
        await anyio.sleep(poll_s)


async def measure_rates(ctx: AppContext, backend: LogprobBackend, why: str) -> bool:
    """Run the rate canary, count and log how it ended; whether it measured. Never raises."""
    admission = ctx.admission
    meter = admission.meter
    before = meter.tokens_per_s, meter.decode_tokens_per_s
    try:
        measured = await _rateprobe(ctx, backend)
    except Exception as exc:
        log.warning("rate canary failed: %s", exc)
        ctx.metrics.rate_probes.labels(why, "failed").inc()
        return False
    if not measured:
        ctx.metrics.rate_probes.labels(why, "preempted").inc()
        return False
    admission.remeasure_wanted = None
    ctx.metrics.rate_probes.labels(why, "measured").inc()
    log.info(
        "engine rate measured (%s) in %.1f s: %s prompt tokens/s, %s answer tokens/s of "
        "decode (was %s, %s)",
        why,
        admission.remeasure_s,
        *(_rate(r) for r in (meter.tokens_per_s, meter.decode_tokens_per_s, *before)),
    )
    return True


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0f}"


async def _rateprobe(ctx: AppContext, backend: LogprobBackend) -> bool:
    """Score the rate canary on the metered backend, then generate its short answers (issue
    77: decode is measured on this machine, not priced by ``DECODE_PRIOR``); ``False`` if a
    request arrived first (cancelled at once: the service's own work never delays a caller).
    """
    reorderer = Reorderer(MeteredBackend(backend, ctx.admission), ctx.settings, ctx.engine.profiles)
    rid = f"rate-{time.monotonic_ns():x}"
    scoring = ReorderRequest(
        RATE_QUERY, RATE_PASSAGES, request_id=rid, design=DesignSpec(kind="pruned_random")
    )
    # Then one greedy answer per passage (a lockstep batch of four) with the default answer
    # budget, as lore generates: the decode rate is per answer-budget token, so the canary's
    # answers must stop where real ones do. After the scoring half, so its prompts' share is
    # priced at the prefill rate just measured and the rest is decode.
    generating = ReorderRequest(RATE_QUERY, RATE_PASSAGES, strategy="lore", request_id=f"{rid}-g")
    t0 = time.monotonic()
    done = False
    async with anyio.create_task_group() as tg:

        async def preempt() -> None:
            while ctx.admission.tokens_in_flight == 0:
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

        async def run() -> None:
            nonlocal done
            with anyio.fail_after(ctx.settings.canary_timeout_s):
                await reorderer.reorder(scoring)
                try:
                    await reorderer.reorder(generating)
                except Exception as exc:
                    # An engine or template that cannot generate still has its prefill rate
                    # measured; generating requests keep the decode prior.
                    log.warning("rate canary: the generation half failed: %s", exc)
            done = True
            tg.cancel_scope.cancel()

        tg.start_soon(preempt)
        tg.start_soon(run)
    if done:
        ctx.admission.remeasure_s = time.monotonic() - t0
    return done


async def probe(
    ctx: AppContext,
    backend: LogprobBackend,
    what: str,
    *,
    default_request: DefaultRequest | None = None,
) -> tuple[str | None, bool]:
    """Run the tiny probe request: ``(None, False)`` if it scored, else (why, engine dead).

    The probe is MoI's (it scores, so it proves the engine), or with ``default_request`` a
    request naming no strategy, resolved as the routes resolve one.
    """
    reorderer = Reorderer(backend, ctx.settings, ctx.engine.profiles)
    request_id = f"{what}-{time.monotonic_ns():x}"
    if default_request is not None:
        req = default_request(PROBE_QUERY, PROBE_PASSAGES, request_id)
    else:
        req = ReorderRequest(PROBE_QUERY, PROBE_PASSAGES, request_id=request_id)
    error: str | None = None
    dead = False
    try:
        # Not timed into the engine process's meter (several workers): admission's rate is
        # of real work, as in one process, where this probe bypasses admission (issue 90).
        with unmetered(), anyio.fail_after(ctx.settings.canary_timeout_s):
            try:
                result = await reorderer.reorder(req)
            except EngineUnavailable as exc:
                if what != "canary":
                    raise
                # One connection cut mid-call (a keep-alive the engine or a proxy between was
                # closing) is not an engine down: every caller would get 503 until the next
                # check. The probe is the service's own and tiny, so it asks once more; an
                # engine really gone fails this too and is called down.
                log.info("canary: %s; asking the engine once more", exc.message)
                result = await reorderer.reorder(req)
        if result.usage.prompts_failed:
            error = f"{result.usage.prompts_failed} of {result.usage.prompts} prompts failed"
        else:
            # The engine's rate for deadline-aware admission from the first request: a low
            # estimate (the probe is tiny), so it errs toward refusing, and it counts only
            # until an admitted call completes.
            ctx.admission.seed(result.usage.prompt_tokens, result.timing.scoring_s)
    except TimeoutError:
        error = NO_ANSWER
    except (EngineUnavailable, EngineTimeout) as exc:
        # A remote engine: down or slow now, not dead for good (readiness only).
        error = f"remote engine: {exc.message}"
        ctx.lifecycle.engine(exc.message)
        if isinstance(backend, RemoteBackend):
            # What answers next may be another deployment: no scoring until checked again.
            backend.mark_down(exc.message)
    except BackendUnavailable as exc:
        error, dead = f"engine unavailable: {exc.message}", True
    except ClientError as exc:
        # Only the configured defaults shape the probe: its refusal is a configuration error.
        error = f"the default {req.strategy!r} request is refused: {exc.message}"
    except Exception as exc:
        log.exception("%s request failed", what)
        error = f"{type(exc).__name__}"
    if error is None:
        ctx.lifecycle.succeeded()
        if ctx.lifecycle.engine_down is not None:
            ctx.lifecycle.engine(None)
    else:
        ctx.metrics.canary_failures.inc()
    return error, dead
