"""Admission: whether a request may have the engine now, and on what terms.

Scoring with prompt log-probs prefills every permutation in full and cannot share a prefix
cache (docs/operations.md), so what a request costs is the sum of its prompts' tokens plus the
answer budgets of what it generates, and all of that is known before the engine runs. Admission
prices it at the engine's measured rates and says no early, with the reason and when to come
back, rather than let a request queue for a 504 after the engine has spent its time on it.

What it decides, in the order a request meets it:

1. **Ready?** Loading, warming up, draining or unhealthy: 503 ``not_ready``
   (``serving.context.Lifecycle``).
2. **A request slot**: at most ``max_concurrent_requests`` in flight, 503 ``overloaded``
   (``Admission.request``).
3. **Its size**, per request, never per call, before the engine sees anything
   (``backends.AdmittedBackend``): the characters it renders into prompts
   (``max_prompt_chars_x_prompts``, charged before each prompt is rendered, so a request that
   could never fit is refused before its token ids exist), its distinct prompts
   (``max_prompts_per_request``) and prompts x tokens (``max_prompt_tokens_x_prompts``): 422.
4. **Its whole work against its deadline** (``Admission.reserve``). Before its first prompt
   is built, the request's strategy states its model calls (``Work.admit``), priced at the
   measured prefill and decode rates (``service.runtime.throughput.ThroughputMeter``):
   - over its deadline even on an idle engine, on a confirmed rate: 422
     ``deadline_unreachable``, naming the estimate, the deadline and the share that would
     fit. A retry could not succeed, so it is not told to retry.
   - not done in time behind the work queued ahead: 503 with a ``Retry-After`` from the same
     estimate.
   - admitted: its estimate stays reserved in the tokens in flight, so later arrivals queue
     behind it, and its calls draw on the reservation without being checked again
     (admitted means expected to finish).
5. **Each call** of work not admitted as a whole (``Admission.tokens``): the queue ahead plus
   the call must fit 90% of what is left of the deadline, and the in-flight budgets hold
   (``max_inflight_prompt_tokens``; ``unmeasured_inflight_prompt_tokens`` until a rate is
   measured, so a queue waiting at start is not admitted all at once). One call is always
   admitted when nothing is in flight: no wrong estimate can starve an idle engine.
6. **Its pace** (``AdmittedBackend``): a call estimated over a fifth of its deadline is sent
   in parts; after each, the rest is projected at the pace its own parts ran, and work that
   would end after its deadline is stopped at once (503, reason ``progress``). A rate
   measured quiet is wrong once a busy neighbour arrives.
7. **The deadline itself** (``serving.execution``): the work is cancelled when it passes
   (504 ``deadline_exceeded``) or when the client leaves.

Why an estimate may refuse, and how it heals. A refusal for good (422) needs a confirmed
rate (``ThroughputMeter.confirmed``: several recent calls, not contradicted by the newest call
that ran alone) and work over the deadline even at the fastest rate the engine has recently
shown; work over it even at ``PLAUSIBLE_SPEEDUP`` times that is refused whatever the rate.
Otherwise it is the estimate that is in doubt: the work is admitted on an idle engine (its
calls re-measure the rate) and gets 503 behind others; with the rate canary on, work over
twice its deadline even at the fastest rate gets 503 while the canary re-measures, and its
retry is decided on that rate. Every refusal or doubt asks for a re-measurement
(``Admission.remeasure``), which the rate canary (``serving.canaries``) runs as soon as the
engine is idle. The service's own work (the canaries, ``auto``'s background runs) is timed
into the meter without holding a place in the queue (``backends.MeteredBackend``), so a
request arriving meanwhile sees an idle engine and preempts it.

A request's deadline is one value (``deadline.Deadline``: when, how long, which setting), made
once when its work may start (``serving.execution``) and passed to every check above: the
estimates, a refusal's ``Retry-After`` (priced against a fresh deadline of the same length: a
calibration's is ``calibration_timeout_s``, not ``request_timeout_s``), the parts of a long
call and the 504, each naming the setting to raise.

With several worker processes on one engine, the counts are the engine's, summed over the
workers (``service.runtime.shared_counts``), and the rates are the engine process's.

The modules, in reading order: ``deadline`` (the one value), ``control`` (``Admission``: the
counts and the decisions on them), ``backends`` (the backend as a request, or the service's
own work, sees it) and ``errors`` (what a refusal raises).
"""
