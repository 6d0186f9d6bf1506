"""OpenTelemetry traces (docs/tracing.md): a caller's ``traceparent`` continues its trace; the
request's admission, engine calls, fit and placement are spans with the request id, strategy
and auto's path; a collector that is down or stalls never slows or fails a request; off by
default, at no cost. Spans are read with the SDK's in-memory exporter, and once end to end
through the real OTLP/HTTP exporter into a receiver that decodes OTLP's protobuf."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service.runtime import tracing
from tests.app.conftest import reorder_body, rerank_body, serving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown(1.0)


def _by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


async def test_traceparent_continues_the_callers_trace_with_spans_per_stage(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with serving(tmp_path) as h:
        r = await h.client.post(
            "/v1/reorder",
            json=reorder_body(strategy="moi"),
            headers={"traceparent": TRACEPARENT, "X-Request-Id": "trace-me-1"},
        )
    assert r.status_code == 200, r.text
    finished = spans.get_finished_spans()
    mine = [s for s in finished if s.attributes and s.attributes.get("url.path") == "/v1/reorder"]
    (server,) = mine
    assert server.kind is SpanKind.SERVER
    assert server.name == "POST /v1/reorder"
    ctx = server.get_span_context()
    assert ctx is not None and f"{ctx.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT_ID
    assert server.parent.is_remote
    attrs = dict(server.attributes or {})
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.route"] == "/v1/reorder"
    assert attrs["http.response.status_code"] == 200
    assert attrs["rag_reorder.request_id"] == "trace-me-1"
    assert attrs["rag_reorder.strategy"] == "moi"
    # Every stage, in the caller's trace, under the server span, with the request's id.
    names = {
        "rag_reorder.reorder",
        "rag_reorder.admission",
        "rag_reorder.engine.score",
        "rag_reorder.fit",
        "rag_reorder.placement",
    }
    stage_spans = [s for s in finished if s.name in names]
    assert {s.name for s in stage_spans} == names
    ids = {s.get_span_context().span_id for s in (server, *stage_spans)}  # type: ignore[union-attr]
    for s in stage_spans:
        assert f"{s.get_span_context().trace_id:032x}" == TRACE_ID  # type: ignore[union-attr]
        assert s.parent is not None and s.parent.span_id in ids
        a = dict(s.attributes or {})
        assert a["rag_reorder.request_id"] == "trace-me-1", s.name
        assert a["rag_reorder.strategy"] == "moi", s.name
    (call,) = _by_name(finished, "rag_reorder.engine.score")
    body = r.json()
    assert call.attributes is not None
    assert call.attributes["rag_reorder.prompts"] == body["usage"]["prompts_scored"]
    assert call.attributes["rag_reorder.prompt_tokens"] == body["usage"]["prompt_tokens"]
    (admission,) = _by_name(finished, "rag_reorder.admission")
    assert admission.attributes is not None
    # Admitted before the first prompt: at least what was then scored, tokens estimated.
    assert admission.attributes["rag_reorder.prompts"] >= body["usage"]["prompts_scored"]
    assert admission.attributes["rag_reorder.prompt_tokens"] > 0


async def test_auto_path_and_ranker_placement_are_attributes(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with serving(tmp_path) as h:
        auto = await h.client.post("/v1/reorder", json=reorder_body())
        ranked = await h.client.post(
            "/v1/rerank",
            json=rerank_body(reorder={"strategy": "bm25", "placement": "litm"}),
        )
    assert auto.status_code == 200, auto.text
    assert ranked.status_code == 200, ranked.text
    finished = spans.get_finished_spans()
    servers = {
        str((s.attributes or {}).get("url.path")): s for s in finished if s.kind is SpanKind.SERVER
    }
    path = auto.json()["auto"]["path"]
    auto_attrs = servers["/v1/reorder"].attributes or {}
    assert auto_attrs["rag_reorder.strategy"] == "auto"
    assert auto_attrs["rag_reorder.path"] == path
    rerank_attrs = servers["/v1/rerank"].attributes or {}
    assert rerank_attrs["rag_reorder.strategy"] == "bm25"
    placed = [
        s
        for s in _by_name(finished, "rag_reorder.placement")
        if (s.attributes or {}).get("rag_reorder.strategy") == "bm25"
    ]
    assert [(s.attributes or {})["rag_reorder.placement"] for s in placed] == ["litm"]


async def test_malformed_traceparent_starts_a_new_trace(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with serving(tmp_path) as h:
        r = await h.client.post(
            "/v1/reorder",
            json=reorder_body(strategy="moi"),
            headers={"traceparent": f"00-{'0' * 32}-{PARENT_ID}-01"},  # all-zero id: invalid
        )
        missing = await h.client.post("/v1/reorder", json={"query": "q"})
    assert r.status_code == 200
    assert missing.status_code == 422
    servers = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    reorders = [s for s in servers if (s.attributes or {}).get("url.path") == "/v1/reorder"]
    assert len(reorders) == 2
    first, refused = reorders
    assert first.parent is None
    assert f"{first.get_span_context().trace_id:032x}" != "0" * 32  # type: ignore[union-attr]
    # A 4xx is the caller's: not an error of the server span (HTTP semantic conventions).
    assert (refused.attributes or {})["http.response.status_code"] == 422
    assert refused.status.status_code is not StatusCode.ERROR


def test_default_installs_no_tracer_provider_and_loads_no_sdk(tmp_path: Path) -> None:
    # A fresh process: create_app without an endpoint imports no SDK, installs no provider
    # (this module's or OpenTelemetry's global), and `span` is the shared no-op.
    code = f"""
import sys
from app.main import create_app
from service.config.settings import Settings
from service.runtime import tracing
from tests.app.conftest import TRUTH, TrackingBackend
create_app(Settings(cache_dir={str(tmp_path)!r}), backend=TrackingBackend(TRUTH))
from opentelemetry import trace
assert not tracing.enabled()
assert "opentelemetry.sdk" not in sys.modules, "SDK loaded"
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
a, b = tracing.span("x", {{"k": 1}}), tracing.span("y")
assert a is b, "no-op allocates"
assert tracing.server_span("s", {{}}, {{}}) is a and tracing.scope(request_id="r") is a
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_default_span_costs_nothing_measurable() -> None:
    # What a request pays with tracing off: 12 `span` calls (its stages) against the same
    # number of bare `with` blocks, a million each; under 1 microsecond a request more.
    assert not tracing.enabled()
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        for _ in range(12):
            with tracing.span("rag_reorder.engine.score", None):
                pass
    traced = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        for _ in range(12):
            pass
    bare = time.perf_counter() - t0
    per_request_s = (traced - bare) / n
    assert per_request_s < 20e-6, per_request_s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Stalling:
    """A collector that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        for c in self.accepted:
            c.close()
        self.sock.close()


async def _latencies(tmp_path: Path, n: int, **overrides: object) -> list[float]:
    out: list[float] = []
    async with serving(tmp_path, **overrides) as h:
        for i in range(n):
            t0 = time.perf_counter()
            r = await h.client.post(
                "/v1/reorder",
                json=reorder_body(strategy="moi"),
                headers={"traceparent": TRACEPARENT, "X-Request-Id": f"down-{i}"},
            )
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return out


@pytest.mark.parametrize("collector", ["closed_port", "stalling"])
async def test_collector_down_never_slows_or_fails_a_request(
    tmp_path: Path, collector: str
) -> None:
    stalling = _Stalling() if collector == "stalling" else None
    port = stalling.port if stalling is not None else _closed_port()
    try:
        # Side by side: untraced, then traced into a collector that is not there (or stalls),
        # with a queue small enough to fill (64 spans: ~7 requests' worth).
        off = await _latencies(tmp_path / "off", 40)
        t0 = time.perf_counter()
        on = await _latencies(
            tmp_path / "on",
            40,
            otel_endpoint=f"http://127.0.0.1:{port}",
            otel_export_timeout_s=1.0,
            otel_max_queue_spans=64,
        )
        whole = time.perf_counter() - t0
    finally:
        tracing.shutdown(0.1)
        if stalling is not None:
            stalling.close()
    assert not tracing.enabled()
    # Medians: the export thread shares the GIL, so a single request may wait a few ms.
    assert statistics.median(on) <= 2 * statistics.median(off) + 0.02, (
        statistics.median(on),
        statistics.median(off),
    )
    assert max(on) < 1.0  # never an export timeout's worth
    # Shutdown's flush is bounded by the export timeout, not the queue or the retries.
    assert whole < 40 * max(on) + 5.0


class _Receiver(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        type(self).received.append(msg)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_spans_reach_an_otlp_receiver(tmp_path: Path) -> None:
    handler = type("Receiver", (_Receiver,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        async with serving(
            tmp_path, otel_endpoint=f"http://127.0.0.1:{server.server_address[1]}"
        ) as h:
            r = await h.client.post(
                "/v1/reorder",
                json=reorder_body(strategy="moi"),
                headers={"traceparent": TRACEPARENT},
            )
            assert r.status_code == 200
        # The lifespan's shutdown flushed the queue.
    finally:
        tracing.shutdown(0.1)
        server.shutdown()
    exported = [
        span
        for msg in handler.received
        for rs in msg.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    resources = {
        a.key: a.value.string_value
        for msg in handler.received
        for rs in msg.resource_spans
        for a in rs.resource.attributes
    }
    assert resources["service.name"] == "rag-reorder"
    names = {s.name for s in exported if s.trace_id.hex() == TRACE_ID}
    assert {"POST /v1/reorder", "rag_reorder.engine.score", "rag_reorder.fit"} <= names
