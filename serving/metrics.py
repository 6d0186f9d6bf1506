"""Prometheus metrics: prefix ``rag_reorder_``, base units (seconds, tokens), ``_total`` counters.

Each app owns a registry (tests build many apps in one process, and a metric can only be
registered once per registry). ``/metrics`` also exposes prometheus_client's default registry,
where an in-process vLLM engine registers its own metrics, and the process collectors.
Labels are low-cardinality by construction: route templates from a fixed list, status codes,
the fixed error vocabulary.

With several worker processes (``entrypoints.workers`` sets ``PROMETHEUS_MULTIPROC_DIR``) a scrape
reaches one worker, and prometheus_client sums the counters and histograms every process
writes to that folder. The counters of the collectors read at scrape (``auto``, the
generator's sampler, the state store) live in each worker's memory, where the scraping worker
cannot see the others': ``_CounterMirror`` writes each worker's totals to the folder as
multiprocess counters (the growth since its last write, at most ``MIRROR_S`` old), so they are
summed like the rest, and a dead worker's totals stay in the sums (its successor counts from 0
in a file of its own: no counter goes back).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from service.backends.scheduling.scheduler import ForwardScheduler, ForwardStats
from service.backends.transport.engine_client import EngineCall, EngineClient
from service.backends.transport.engine_load import EngineLoad
from service.learning.generator_online import GeneratorSampler
from service.learning.learner import ProfileLearner
from service.learning.outcomes import VERDICTS, OutcomeMonitor
from service.pipeline import ReorderResult
from service.runtime.throughput import ThroughputMeter
from service.state.response_cache import ResponseCache
from service.state.state_store import StateStore
from service.state.traffic import TrafficSampler

PREFIX = "rag_reorder"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SOLVER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_TOKEN_BUCKETS = tuple(float(4**k) for k in range(3, 11))  # 64 .. 1,048,576
# Over 1: a lone prompt longer than the budget runs alone.
_FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 300)
_SHARING_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIRROR_S = 1.0
"""Seconds between two writes of a worker's scrape-time counters to the shared folder: how
old another worker's counts in a scrape may be (a worker killed outright loses at most this
much of its counts)."""


class _DefaultRegistry(Collector):
    """Re-exports the default registry (engine and process metrics) from an app's registry."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()

    def describe(self) -> list[Metric]:
        # Nothing to check for name clashes: the default registry never holds our prefix.
        return []


class _TrafficSample(Collector):
    """Runs held in the calibration-from-traffic sample, per design group (read at scrape)."""

    def __init__(self, sampler: TrafficSampler) -> None:
        self._sampler = sampler

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_traffic_sample_runs",
            "MoI runs of live requests held for POST /v1/bias-profiles/calibrate "
            '{"from_traffic": true}, by design group (random: random and hybrid).',
            labels=["design"],
        )
        held = {"random": 0, "pruned_random": 0}
        for c in self._sampler.counts():
            held[c.key.design] += c.runs
        for design, runs in held.items():
            family.add_metric([design], runs)
        yield family


class _ScrapeTime(Collector):
    """A collector read at scrape whose counters ``_CounterMirror`` can also write to the
    shared folder (several workers): ``counters`` and ``gauges`` apart."""

    def counters(self) -> Iterator[CounterMetricFamily]:
        """The counter families (totals since this process started)."""
        return iter(())

    def gauges(self) -> Iterator[Metric]:
        """The gauge families (this process's own view)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        yield from self.counters()
        yield from self.gauges()


class _State(_ScrapeTime):
    """The state store's health, failures and queue (read at scrape)."""

    def __init__(self, state: StateStore) -> None:
        self._state = state

    def counters(self) -> Iterator[CounterMetricFamily]:
        s = self._state
        yield _labelled(
            "state_store_failures",
            "Operations on the state store that failed, by operation (read, write, lock).",
            "operation",
            {op: s.failures.get(op, 0) for op in ("read", "write", "lock")},
        )
        yield CounterMetricFamily(
            f"{PREFIX}_state_store_dropped_writes",
            "Sampled runs dropped from a full queue while the state store could not be reached "
            "(state_max_pending_bytes).",
            value=s.dropped,
        )

    def gauges(self) -> Iterator[Metric]:
        s = self._state
        yield GaugeMetricFamily(
            f"{PREFIX}_state_store_up",
            "1 when the state store (the folder, or Redis with state_url) answered its last "
            "operation; 0 while Redis cannot be reached (requests are then served from memory).",
            value=1 if s.up else 0,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_state_store_pending_writes",
            "Writes (profiles, sampled runs) queued for the state store, not yet stored.",
            value=s.pending,
        )


_Label = TypeVar("_Label", bound=str)


def _labelled(
    name: str, documentation: str, label: str, counts: Mapping[_Label, int]
) -> CounterMetricFamily:
    """A counter family of one label, a sample per ``counts`` entry."""
    family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=[label])
    for value, n in counts.items():
        family.add_metric([value], n)
    return family


class _Outcomes(_ScrapeTime):
    """``auto``'s randomized holdout and the uplift per key (docs/outcomes.md), at scrape:
    the gauges are read from the outcomes every worker and replica share."""

    def __init__(self, monitor: OutcomeMonitor) -> None:
        self._monitor = monitor

    def counters(self) -> Iterator[CounterMetricFamily]:
        m = self._monitor
        yield _labelled(
            "holdout_draws",
            "auto's placed requests by the arm drawn (RAG_REORDER_HOLDOUT_RATE): placed, "
            "holdout (the control order), pass_through (outcome_policy act), exempt (the "
            "caller's holdout: false).",
            "arm",
            m.drawn,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_outcome_policy_switches",
            "Times outcome_policy act switched a key to the retriever's order or back.",
            value=m.switches,
        )

    def gauges(self) -> Iterator[Metric]:
        uplift = GaugeMetricFamily(
            f"{PREFIX}_outcome_uplift",
            "The placement's uplift over the holdout's control order per key "
            "(model|template|passages): the estimate and its always-valid bounds.",
            labels=["key", "bound"],
        )
        outcomes = GaugeMetricFamily(
            f"{PREFIX}_outcomes",
            "Outcomes reported (POST /v1/feedback) per key and arm, kept in the state store.",
            labels=["key", "arm"],
        )
        verdict = GaugeMetricFamily(
            f"{PREFIX}_outcome_verdict",
            "1 for each key's verdict: helps, hurts, no_difference, not_enough.",
            labels=["key", "verdict"],
        )
        passing = GaugeMetricFamily(
            f"{PREFIX}_outcome_pass_through",
            "1 while outcome_policy act serves this key the retriever's order.",
            labels=["key"],
        )
        for u in self._monitor.status():
            k = u.key.label
            for bound, value in (("estimate", u.estimate), ("lower", u.lower), ("upper", u.upper)):
                uplift.add_metric([k, bound], value)
            for arm, n in u.outcomes.items():
                outcomes.add_metric([k, arm], n)
            for v in VERDICTS:
                verdict.add_metric([k, v], 1.0 if u.verdict == v else 0.0)
            passing.add_metric([k], 1.0 if u.pass_through else 0.0)
        yield from (uplift, outcomes, verdict, passing)


class _Generator(_ScrapeTime):
    """``auto``'s online sampling of the generator (``generator_url``), at scrape."""

    def __init__(self, sampler: GeneratorSampler) -> None:
        self._sampler = sampler

    def counters(self) -> Iterator[CounterMetricFamily]:
        c = self._sampler.counters
        yield _labelled(
            "generator_samples",
            "auto's requests drawn (RAG_REORDER_GENERATOR_SAMPLE_RATE) to be asked of the "
            "generator in the background, passages in a random order, by outcome: taken "
            "(queued), dropped (the queue was full), over_budget (the hour's calls were spent), "
            "caller_capped (the caller held its share).",
            "outcome",
            c.samples,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_generator_calls",
            "HTTP calls sent to the generator, retries included "
            "(bounded by RAG_REORDER_GENERATOR_MAX_CALLS_PER_HOUR).",
            value=self._sampler.calls,
        )
        yield _labelled(
            "generator_failures",
            "Sampled requests the generator did not answer, by why: unavailable, timeout, "
            "refused (key, model, route), bad_answer (no OpenAI completion), budget, error.",
            "reason",
            c.failures,
        )
        yield _labelled(
            "generator_answers",
            "The generator's answers to sampled requests by attribution: contained (passages "
            "holding the whole answer), overlap (most of its content words), none "
            "(unattributed: no weight in the estimate).",
            "attribution",
            c.answers,
        )
        yield _labelled(
            "generator_feedback",
            "Answers sent to POST /v1/feedback, by outcome: used (the served order was a "
            "random placement: pooled into the generator's profile), unused.",
            "outcome",
            c.feedback,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_generator_drift_events",
            "Trusted generator profiles withdrawn because their newest answers "
            "(RAG_REORDER_GENERATOR_DRIFT_WINDOW) disagreed with the older ones; the profile "
            "is then learned again from new answers only.",
            value=c.drift_events,
        )

    def gauges(self) -> Iterator[Metric]:
        trusted = GaugeMetricFamily(
            f"{PREFIX}_generator_profile_trusted",
            "1 while auto places requests of this passage count by the generator's profile "
            "learned online from its answers.",
            labels=["passages"],
        )
        for st in self._sampler.status():
            trusted.add_metric([str(st.slots)], 1.0 if st.placing is not None else 0.0)
        yield trusted


class _Auto(_ScrapeTime):
    """``auto``'s paths, recalibrations, drift events and each profile's trust (at scrape)."""

    def __init__(self, learner: ProfileLearner) -> None:
        self._learner = learner

    def counters(self) -> Iterator[CounterMetricFamily]:
        c = self._learner.counters
        yield _labelled(
            "auto_requests",
            "Requests answered by the auto strategy, by path: profile (placed by a trusted "
            "profile, no model call), flat (trusted flat profile: best first), moi (no "
            "trusted profile: MoI, run kept for learning), explore (MoI to check the profile), "
            "cold (no trusted profile, MoI too slow to wait on: served at once, learned in "
            "the background).",
            "path",
            c.paths,
        )
        yield _labelled(
            "auto_recalibrations",
            "Background assessments of a learned profile, by outcome (trusted, undecided, failed).",
            "outcome",
            c.recalibrations,
        )
        yield _labelled(
            "auto_explore_runs",
            "Explore requests' MoI runs, run in the background after the answer was served, "
            "by outcome: recorded, preempted (a request started using the engine), dropped "
            "(another was pending), failed, expired (no idle engine for 300 s).",
            "outcome",
            c.shadow_runs,
        )
        yield _labelled(
            "auto_background_learning_runs",
            "Learning runs of requests served on the cold path (MoI too slow to wait on), run "
            "in the background while the engine idles, by outcome: recorded, preempted, "
            "dropped, failed (or past request_timeout_s), expired (no idle engine for 300 s).",
            "outcome",
            c.learning_runs,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_auto_explore_skipped",
            "Requests drawn to explore while a background run was still pending or running: "
            "served by the profile without one (explore is sized to what the engine can run).",
            value=c.explore_skipped,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_auto_drift_events",
            "Trusted profiles that explore runs contradicted (auto went back to MoI).",
            value=c.drift_events,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_auto_caller_capped_runs",
            "Learning runs not kept because their caller already held its share "
            "(RAG_REORDER_AUTO_MAX_CALLER_SHARE) while other callers contribute.",
            value=c.caller_capped,
        )

    def gauges(self) -> Iterator[Metric]:
        labels = ["template", "slots"]
        trusted = GaugeMetricFamily(
            f"{PREFIX}_auto_profile_trusted",
            "1 while auto places by a trusted profile of this template and slot count.",
            labels=labels,
        )
        runs = GaugeMetricFamily(
            f"{PREFIX}_auto_learning_runs",
            "MoI runs pooled at the last assessment of this profile.",
            labels=labels,
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_auto_profile_age_seconds",
            "Seconds since this profile became trusted (absent while it is not).",
            labels=labels,
        )
        flat_p = GaugeMetricFamily(
            f"{PREFIX}_auto_profile_flat_p",
            "p-value of the test of this profile against flat, at its last assessment.",
            labels=labels,
        )
        stability = GaugeMetricFamily(
            f"{PREFIX}_auto_profile_stability",
            "Share of bootstrap refits placing the same top slots, at its last assessment.",
            labels=labels,
        )
        now = time.time()
        for st in self._learner.status():
            lv = [st.key.template, str(st.key.slots)]
            trusted.add_metric(lv, 1 if st.trusted else 0)
            runs.add_metric(lv, st.pooled_runs)
            t = st.last or (st.stored.trust if st.stored is not None else None)
            if t is not None:
                flat_p.add_metric(lv, t.flat_p)
                stability.add_metric(lv, t.stability)
            held = st.stored.trust if st.stored is not None else None
            if st.trusted and held is not None and held.trusted_since is not None:
                age.add_metric(lv, max(0.0, now - held.trusted_since))
        yield from (trusted, runs, age, flat_p, stability)


class _CounterMirror:
    """Writes the counters of a worker's scrape-time collectors to the shared multiprocess
    folder (module docstring), where every worker's scrape sums them.

    Each family becomes a prometheus_client ``Counter`` registered nowhere (its values go to
    this process's ``counter_<pid>.db``; ``/metrics`` reads them through the folder, never
    through a registry, so nothing is exposed twice), advanced by what the in-memory total
    grew since the last ``sync``. Every label value is written at once, zeros included, so a
    scrape lists the same series as one process does.
    """

    def __init__(self) -> None:
        self._sources: list[_ScrapeTime] = []
        self._counters: dict[str, Counter] = {}
        self._written: dict[tuple[str, tuple[str, ...]], float] = {}

    def add(self, source: _ScrapeTime) -> None:
        self._sources.append(source)
        self.sync()

    def sync(self) -> None:
        """Write what each counter grew since the last call (on the event loop, as a scrape
        reads them: two calls never interleave)."""
        for source in self._sources:
            self._write(source.counters())

    def _write(self, families: Iterable[CounterMetricFamily]) -> None:
        for family in families:
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # _created: a multiprocess counter has none
                names = tuple(sample.labels)
                values = tuple(sample.labels[n] for n in names)
                counter = self._counters.get(family.name)
                if counter is None:
                    counter = self._counters[family.name] = Counter(
                        family.name, family.documentation, names, registry=None
                    )
                child = counter.labels(*values) if names else counter
                last = self._written.get((family.name, values), 0.0)
                if sample.value > last:
                    child.inc(sample.value - last)
                    self._written[family.name, values] = sample.value


class ServiceMetrics:
    """The service's metrics, registered in a private registry."""

    def __init__(self, *, include_default_registry: bool = True) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = PREFIX
        self.build_info = Gauge(
            f"{p}_build_info",
            "Always 1; the labels say what is running.",
            ["version", "model", "backend"],
            registry=r,
        )
        self.ready = Gauge(f"{p}_ready", "1 when /ready answers 200.", registry=r)
        self.score_mode = Gauge(
            f"{p}_score_mode",
            "Always 1 once the engine is checked; `mode` is how vLLM scores (token_ids or "
            "prompt_logprobs), `check` the start-up comparison of the two (agreed, disagreed, "
            "failed, not_run).",
            ["mode", "check"],
            registry=r,
        )
        self.http_requests = Counter(
            f"{p}_http_requests",
            "HTTP requests answered, by route template and status code.",
            ["route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            f"{p}_http_request_duration_seconds",
            "Time from the first byte read to the response, by route template.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            f"{p}_request_failures",
            "Error responses by envelope type and code.",
            ["type", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            f"{p}_requests_in_flight",
            "Reorder and rerank requests admitted and running.",
            registry=r,
        )
        self.inflight_prompt_tokens = Gauge(
            f"{p}_inflight_prompt_tokens",
            "Prompt tokens admitted and being scored (the admission budget in use).",
            registry=r,
        )
        self.admission_rejections = Counter(
            f"{p}_admission_rejections",
            "Requests refused by admission, by reason: 503 for concurrency, token_budget, "
            "deadline (the queue ahead would not let it finish in time, or a doubted rate "
            "while it is re-measured; shed at once), or progress (admitted, but its own first "
            "calls ran too slowly to finish in time: stopped early); 422 for unreachable (its "
            "own estimated work exceeds its deadline on an idle engine).",
            ["reason"],
            registry=r,
        )
        self.within_deadline = Counter(
            f"{p}_requests_within_deadline",
            "Reorder and rerank requests answered within their deadline (200): its rate is "
            "the goodput.",
            registry=r,
        )
        self.estimated_wait = Gauge(
            f"{p}_estimated_wait_seconds",
            "Seconds the engine needs for the prompt tokens admitted now, at its measured "
            "rate: what a new request would queue behind (0 while the rate is unmeasured).",
            registry=r,
        )
        self.engine_tokens_per_s = Gauge(
            f"{p}_engine_prompt_tokens_per_second",
            "The engine's prompt tokens per busy second, measured from completed calls, that "
            "deadline-aware admission uses (0 until the first call completes).",
            registry=r,
        )
        self.engine_decode_tokens_per_s = Gauge(
            f"{p}_engine_decode_tokens_per_second",
            "The engine's answer-budget tokens per second of decode, measured from completed "
            "generations (0 until one is measured).",
            registry=r,
        )
        self.engine_rate_calls = Gauge(
            f"{p}_engine_rate_calls",
            "Measurements (completed calls) within the last 300 s that the engine's rate "
            "rests on; admission refuses work for good (422) only on 4 or more.",
            registry=r,
        )
        self.engine_rate_age = Gauge(
            f"{p}_engine_rate_age_seconds",
            "Seconds since the engine's rate was last measured (-1 before the first).",
            registry=r,
        )
        self.engine_rate_confirmed = Gauge(
            f"{p}_engine_rate_confirmed",
            "1 when the engine's rate may refuse work for good (enough recent calls, not "
            "contradicted by the newest call alone on the engine), else 0.",
            registry=r,
        )
        self.rate_probes = Counter(
            f"{p}_rate_probes",
            "Rate canaries (a small scoring call and a short generation the service times to "
            "re-measure the engine) by why they ran (start, refused, doubted, stale, progress) "
            "and how they ended (measured, preempted by a request, failed).",
            ["reason", "outcome"],
            registry=r,
        )
        self.canary_deferred = Counter(
            f"{p}_canary_deferred",
            "Liveness canaries that timed out queued behind work that was progressing: not "
            "counted as failures.",
            registry=r,
        )
        self.prompts = Histogram(
            f"{p}_request_prompts",
            "Prompts (permutations) planned per request.",
            buckets=_PROMPT_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            f"{p}_request_prompt_tokens",
            "Prompt tokens prefilled per request.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.scored_tokens = Counter(
            f"{p}_scored_tokens", "Tokens whose log-probs were read.", registry=r
        )
        self.prompts_failed = Counter(
            f"{p}_prompts_failed", "Prompts that failed to score and were dropped.", registry=r
        )
        self.scoring_duration = Histogram(
            f"{p}_scoring_duration_seconds",
            "Time spent in the model per request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.solver_duration = Histogram(
            f"{p}_solver_duration_seconds",
            "Time spent in the fit per request.",
            buckets=_SOLVER_BUCKETS,
            registry=r,
        )
        self.strategy_requests = Counter(
            f"{p}_strategy_requests",
            "Reorder and rerank requests answered successfully, by strategy.",
            ["strategy"],
            registry=r,
        )
        self.order_changed = Counter(
            f"{p}_order_changed",
            "Successful requests whose order differs from the retriever's (input) order, by "
            "strategy; divide by strategy_requests for the share.",
            ["strategy"],
            registry=r,
        )
        self.fit_r2 = Histogram(
            f"{p}_fit_r2",
            "R^2 of the MoI fit (share of the log-likelihood variance across permutations "
            "that utilities and position bias explain).",
            buckets=(0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.generated_tokens = Counter(
            f"{p}_generated_tokens",
            "Tokens generated (answers of lore, self_consistency).",
            registry=r,
        )
        self.calibrations = Counter(
            f"{p}_bias_profile_calibrations",
            "Bias profiles calibrated and stored through POST /v1/bias-profiles/calibrate, by "
            "design and source (queries or traffic).",
            ["design", "source"],
            registry=r,
        )
        self.canary_failures = Counter(
            f"{p}_canary_failures", "Warm-up and canary requests that failed.", registry=r
        )
        # The transformers engine's scheduler (vLLM reports its own queue as vllm:*).
        self.batch_queue = Gauge(
            f"{p}_batch_queue_prompts",
            "Prompts waiting for a forward in the transformers engine's scheduler (all "
            "in-flight requests together).",
            registry=r,
        )
        self.batch_fill = Histogram(
            f"{p}_batch_fill_ratio",
            "Padded tokens per forward against the batch token budget (transformers engine).",
            buckets=_FILL_BUCKETS,
            registry=r,
        )
        self.batch_wait = Histogram(
            f"{p}_batch_wait_seconds",
            "Per prompt, time from its request's scoring call to the start of its forward "
            "(transformers engine).",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            f"{p}_queue_wait_seconds",
            "Per scoring call, time from the call to the start of its first forward: the queue "
            "ahead of it (transformers engine).",
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            f"{p}_batch_requests",
            "Requests whose prompts share a forward (transformers engine).",
            buckets=_SHARING_BUCKETS,
            registry=r,
        )
        # The remote engine (backend `remote`): its HTTP calls as this replica sees them.
        self.engine_calls = Counter(
            f"{p}_engine_calls",
            "HTTP calls to the remote engine, by path and outcome (ok, http_<status>, timeout, "
            "unavailable, bad_answer: a 200 whose body is not a JSON object).",
            ["path", "outcome"],
            registry=r,
        )
        self.engine_call_duration = Histogram(
            f"{p}_engine_call_duration_seconds",
            "Time of one HTTP call to the remote engine, retries and waits included, by path.",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_retries = Counter(
            f"{p}_engine_retries",
            "Retries of calls the remote engine provably did not run (never connected, 429, "
            "503; also 502, 504 and cut connections with RAG_REORDER_ENGINE_RETRY_UNSAFE).",
            registry=r,
        )
        self.engine_weight_changes = Counter(
            f"{p}_engine_weight_changes",
            "Reconnects after which the remote engine's probe log-probs moved beyond "
            "RAG_REORDER_ENGINE_PROBE_TOLERANCE: other weights under the same served name.",
            registry=r,
        )
        self.engine_in_flight = Gauge(
            f"{p}_engine_calls_in_flight",
            "HTTP calls to the remote engine waiting for or holding an answer.",
            registry=r,
        )
        self.engine_other_requests = Gauge(
            f"{p}_engine_other_requests",
            "Requests of the remote engine's other clients (its queue beyond this replica's "
            "prompts) at the last read of its /metrics, for auto's background runs; -1 "
            "before a good read and while reads fail.",
            registry=r,
        )
        if include_default_registry:
            r.register(_DefaultRegistry())
        # Decided at start, as prometheus_client decides where its values live.
        self._mirror = _CounterMirror() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None

    def observe(self, result: ReorderResult) -> None:
        """Record a successful request's work."""
        self.prompts.observe(result.prompts)
        self.request_prompt_tokens.observe(result.usage.prompt_tokens)
        self.prompt_tokens.inc(result.usage.prompt_tokens)
        self.scored_tokens.inc(result.usage.scored_tokens)
        self.prompts_failed.inc(result.usage.prompts_failed)
        self.generated_tokens.inc(result.usage.generated_tokens)
        self.scoring_duration.observe(result.timing.scoring_s)
        self.strategy_requests.labels(result.strategy).inc()
        if list(result.order) != sorted(result.order):
            self.order_changed.labels(result.strategy).inc()
        if result.fit is not None:
            self.solver_duration.observe(result.timing.solver_s)
            r2 = result.fit.r2
            if r2 is not None and math.isfinite(r2):
                self.fit_r2.observe(r2)

    def track_scheduler(self, scheduler: ForwardScheduler) -> None:
        """Expose the queue of a transformers engine and observe each of its forwards."""
        self.batch_queue.set_function(lambda: scheduler.queue_depth)
        scheduler.add_observer(self._observe_forward)

    def _observe_forward(self, stats: ForwardStats) -> None:
        self.batch_fill.observe(stats.padded_tokens / stats.token_budget)
        self.batch_requests.observe(stats.callers)
        for wait in stats.waits_s:
            self.batch_wait.observe(wait)
        for wait in stats.queue_waits_s:
            self.queue_wait.observe(wait)

    def track_engine(self, client: EngineClient) -> None:
        """Observe every call to a remote engine and expose its calls in flight."""
        self.engine_in_flight.set_function(lambda: client.in_flight)
        client.add_observer(self._observe_engine_call)

    def track_engine_load(self, load: EngineLoad) -> None:
        """Expose the remote engine's queue as ``auto``'s background runs see it."""
        self.engine_other_requests.set_function(
            lambda: load.others if load.failure is None and load.read else -1.0
        )

    def _observe_engine_call(self, call: EngineCall) -> None:
        self.engine_calls.labels(call.path, call.outcome).inc()
        self.engine_call_duration.labels(call.path).observe(call.seconds)
        self.engine_retries.inc(call.retries)

    def track_capacity(self, wait_s: Callable[[], float | None], meter: ThroughputMeter) -> None:
        """Expose admission's estimates and what they rest on (read at scrape; unknown
        reads 0, an age never measured -1)."""
        self.estimated_wait.set_function(lambda: wait_s() or 0.0)
        self.engine_tokens_per_s.set_function(lambda: meter.tokens_per_s or 0.0)
        self.engine_decode_tokens_per_s.set_function(lambda: meter.decode_tokens_per_s or 0.0)
        self.engine_rate_calls.set_function(lambda: meter.calls(time.monotonic()))

        def age() -> float:
            a = meter.age_s(time.monotonic())
            return -1.0 if a is None else a

        self.engine_rate_age.set_function(age)
        self.engine_rate_confirmed.set_function(
            lambda: 1.0 if meter.confirmed(time.monotonic()) else 0.0
        )

    def track_generator(self, sampler: GeneratorSampler) -> None:
        """Expose ``auto``'s online sampling of the generator."""
        self._track(_Generator(sampler))

    def track_outcomes(self, monitor: OutcomeMonitor) -> None:
        """Expose auto's randomized holdout and the uplift per key."""
        self._track(_Outcomes(monitor))

    def track_auto(self, learner: ProfileLearner) -> None:
        """Expose what the auto strategy does and how far it trusts its profiles."""
        self._track(_Auto(learner))

    def track_state(self, state: StateStore) -> None:
        """Expose the state store's health (Redis; the folder is always up)."""
        self._track(_State(state))

    def track_cache(self, cache: ResponseCache) -> Callable[[], None]:
        """The response cache's metrics: plain counters advanced by what its totals grew
        (multiprocess-safe as they are), and the bytes this process holds (summed over live
        workers). Returns the callback the cache calls after each change."""
        p, r = PREFIX, self.registry
        hits = Counter(
            f"{p}_cache_hits", "Responses served from the cache, by tier.", ["tier"], registry=r
        )
        misses = Counter(f"{p}_cache_misses", "Cache lookups that found nothing.", registry=r)
        evictions = Counter(
            f"{p}_cache_evictions",
            "Cached responses dropped: `bytes` to fit `cache_max_bytes`, `ttl` expired.",
            ["reason"],
            registry=r,
        )
        failures = Counter(
            f"{p}_cache_redis_failures",
            "Redis cache calls that failed (the request went on without Redis).",
            registry=r,
        )
        held = Gauge(
            f"{p}_cache_bytes",
            "Bytes of responses held in the in-process cache (all workers).",
            registry=r,
            multiprocess_mode="livesum",
        )
        for tier in ("local", "redis"):
            hits.labels(tier)
        for reason in ("bytes", "ttl"):
            evictions.labels(reason)
        seen: dict[str, int] = {}

        def advance(counter: Counter, name: str, total: int) -> None:
            grew = total - seen.get(name, 0)
            if grew > 0:
                counter.inc(grew)
                seen[name] = total

        def changed() -> None:
            c = cache.counters
            for tier, n in c.hits.items():
                advance(hits.labels(tier), f"hits:{tier}", n)
            for reason, n in c.evictions.items():
                advance(evictions.labels(reason), f"evictions:{reason}", n)
            advance(misses, "misses", c.misses)
            advance(failures, "redis_failures", c.redis_failures)
            held.set(cache.bytes_held)

        return changed

    def _track(self, collector: _ScrapeTime) -> None:
        self.registry.register(collector)
        if self._mirror is not None:
            self._mirror.add(collector)

    def sync_counters(self) -> None:
        """With several workers, write this worker's scrape-time counters to the shared
        folder now (``_CounterMirror``); nothing to do in one process."""
        if self._mirror is not None:
            self._mirror.sync()

    async def sync_forever(self) -> None:
        """``sync_counters`` every ``MIRROR_S`` until cancelled, and once more then (a
        draining worker's last counts reach the sums). Returns at once in one process."""
        if self._mirror is None:
            return
        try:
            while True:
                self._mirror.sync()
                await asyncio.sleep(MIRROR_S)
        finally:
            self._mirror.sync()

    def track_traffic(self, sampler: TrafficSampler) -> None:
        """Expose the size of the live-traffic calibration sample."""
        self.registry.register(_TrafficSample(sampler))

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for an ``Accept`` header: body and content type. With several
        worker processes (``PROMETHEUS_MULTIPROC_DIR``, set by ``entrypoints.workers``) counters and
        histograms are the sums over every worker (this worker's scrape-time counters written
        first, so its own are current), gauges this worker's own."""
        encoder, content_type = choose_encoder(accept)
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder:
            self.sync_counters()
            return encoder(_AcrossWorkers(self.registry, folder)), content_type
        return encoder(self.registry), content_type


class _AcrossWorkers(CollectorRegistry):
    """Counters and histograms summed over the worker processes' files (the scrape-time
    collectors' counters among them, through ``_CounterMirror``), gauges (the ones read by a
    function at scrape, which multiprocess files cannot hold, and the collectors of auto,
    state and traffic) from this worker's registry."""

    _SUMMED = frozenset({"counter", "histogram", "summary"})

    def __init__(self, own: CollectorRegistry, folder: str) -> None:
        super().__init__(auto_describe=False)
        self._own = own
        self._folder = folder

    def collect(self) -> Iterator[Metric]:
        # prometheus_client ships this collector untyped.
        files = MultiProcessCollector(None, self._folder)  # type: ignore[no-untyped-call]
        for family in files.collect():  # type: ignore[no-untyped-call]
            if family.type in self._SUMMED:
                yield family
        for family in self._own.collect():
            if family.type not in self._SUMMED:
                yield family
