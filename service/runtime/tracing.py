"""OpenTelemetry traces: off unless an OTLP endpoint is configured (docs/tracing.md).

The only module that imports OpenTelemetry, and only as an option: without the ``otel`` extra
(``pip install 'rag-reorder[otel]'``) or without ``otel_endpoint``, no tracer provider is
installed and ``span`` returns one shared no-op context manager (one global read, no
allocation), so a request pays nothing measurable.

When on, spans go to a ``BatchSpanProcessor``: ending a span only appends it to a bounded
queue (full: the span is dropped, counted by the SDK), and a background thread exports it
over OTLP/HTTP with a bounded timeout. A collector that is down, refuses or stalls costs that
thread its time, never a request its latency or its answer.

Spans are made only inside a recording span (the HTTP server span, ``server_span``): the
canary, the rate probe and ``auto``'s background runs start none. Every span inside a
request scope (``scope``) carries that scope's attributes (the request id, strategy, auto's
path), under the ``rag_reorder.`` namespace; the server span follows OpenTelemetry's HTTP
semantic conventions (set by ``app.middleware``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

NAMESPACE: Final = "rag_reorder."
# The OTLP/HTTP path of traces under a collector's base URL (as OTEL_EXPORTER_OTLP_ENDPOINT).
TRACES_PATH: Final = "/v1/traces"

AttributeValue = str | bool | int | float
Attributes = Mapping[str, AttributeValue]

_NOOP: Final[AbstractContextManager[None]] = nullcontext()


class _Process:
    """This process's tracer (``None``: off) and the provider behind it."""

    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_process = _Process()
# The request's attributes (request id, strategy, auto's path), shared by its spans: one
# mutable dict per request, so what the pipeline learns late (auto's path) reaches the
# server span that ends last.
_scope: ContextVar[dict[str, AttributeValue] | None] = ContextVar("rag_reorder_trace_scope")


def available() -> bool:
    """Whether the OpenTelemetry SDK and its OTLP/HTTP exporter are installed (the extra)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """Whether spans are recorded in this process."""
    return _process.tracer is not None


def configure(
    endpoint: str | None,
    *,
    service_version: str,
    export_timeout_s: float,
    max_queue_spans: int,
) -> bool:
    """Install this process's tracer provider exporting to ``endpoint`` (OTLP/HTTP), or
    nothing when ``endpoint`` is ``None``; whether tracing is now on.

    ``endpoint`` is a collector's base URL (``http://collector:4318``; ``/v1/traces`` is
    appended unless given). The SDK's own environment variables still apply: the sampler
    (``OTEL_TRACES_SAMPLER``), headers and TLS (``OTEL_EXPORTER_OTLP_*``), the service name
    (``OTEL_SERVICE_NAME``, default ``rag-reorder``). Without the extra it logs an error
    and serves untraced: traces never stop the service.
    """
    if endpoint is None:
        return False
    if not available():
        log.error(
            "RAG_REORDER_OTEL_ENDPOINT is set but OpenTelemetry is not installed "
            "(pip install 'rag-reorder[otel]'): serving without traces"
        )
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint.rstrip("/")
    if not url.endswith(TRACES_PATH):
        url += TRACES_PATH
    resource: dict[str, Any] = {"service.version": service_version}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        resource["service.name"] = "rag-reorder"
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url, timeout=export_timeout_s),
            max_queue_size=max_queue_spans,
            max_export_batch_size=min(512, max_queue_spans),
            export_timeout_millis=export_timeout_s * 1000,
        )
    )
    install(provider)
    log.info("exporting traces over OTLP/HTTP to %s", url)
    return True


def install(provider: TracerProvider) -> None:
    """Record spans with ``provider`` (``configure``'s, or a test's in-memory one). It stays
    this module's: the global provider is left alone, so a process's other libraries and
    several apps in one test process do not fight over it."""
    _process.provider = provider
    _process.tracer = provider.get_tracer("rag_reorder")


def shutdown(timeout_s: float) -> None:
    """Stop recording; flush what is queued for at most ``timeout_s`` (at shutdown)."""
    provider = _process.provider
    _process.tracer = _process.provider = None
    if provider is None:
        return
    if not provider.force_flush(int(timeout_s * 1000)):
        log.warning("traces not flushed within %g s at shutdown; dropped", timeout_s)
    provider.shutdown()


def server_span(
    name: str, headers: Mapping[str, str], attributes: Attributes
) -> AbstractContextManager[Span | None]:
    """The request's SERVER span, continuing the caller's trace from a W3C ``traceparent``
    in ``headers`` (malformed or absent: a new trace); ``None`` when tracing is off."""
    tracer = _process.tracer
    if tracer is None:
        return _NOOP
    return _server_span(tracer, name, headers, attributes)


@contextmanager
def _server_span(
    tracer: Tracer, name: str, headers: Mapping[str, str], attributes: Attributes
) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(headers)
    with tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes
    ) as current:
        yield current


def span(name: str, attributes: Attributes | None = None) -> AbstractContextManager[Span | None]:
    """An INTERNAL span ``name`` (``rag_reorder.*``) under the current one, with the request
    scope's attributes and ``attributes``; a no-op when tracing is off or outside a traced
    request. An exception leaving it is recorded on it and sets its status to error."""
    tracer = _process.tracer
    if tracer is None:
        return _NOOP
    from opentelemetry.trace import get_current_span

    if not get_current_span().is_recording():
        return _NOOP
    merged = dict(_scope.get(None) or {})
    if attributes:
        merged.update(attributes)
    return tracer.start_as_current_span(name, attributes=merged)


def scope(**attributes: AttributeValue) -> AbstractContextManager[dict[str, AttributeValue] | None]:
    """A request's attribute scope (names without the namespace): every ``span`` inside
    carries them; ``annotate`` adds to the innermost. Yields the dict (read it at the end),
    ``None`` when tracing is off."""
    if _process.tracer is None:
        return _NOOP
    return _scoped({NAMESPACE + k: v for k, v in attributes.items()})


@contextmanager
def _scoped(values: dict[str, AttributeValue]) -> Iterator[dict[str, AttributeValue]]:
    token = _scope.set(values)
    try:
        yield values
    finally:
        _scope.reset(token)


def annotate(**attributes: AttributeValue) -> None:
    """Add attributes (names without the namespace) to the current request scope and the
    current span; nothing when tracing is off."""
    if _process.tracer is None:
        return
    values = {NAMESPACE + k: v for k, v in attributes.items()}
    current = _scope.get(None)
    if current is not None:
        current.update(values)
    from opentelemetry.trace import get_current_span

    get_current_span().set_attributes(values)


def set_attributes(target: Span | None, attributes: Attributes) -> None:
    """Set ``attributes`` on a span ``span``/``server_span`` yielded (``None``: off)."""
    if target is not None:
        target.set_attributes(attributes)


def end_server_span(
    target: Span | None, status_code: int, attributes: Attributes | None = None
) -> None:
    """Close out a ``server_span``: the response's status and the request scope's attributes;
    only a 5xx marks it an error (HTTP semantic conventions: a 4xx is the caller's)."""
    if target is None:
        return
    from opentelemetry.trace import Status, StatusCode

    target.set_attributes({**(attributes or {}), "http.response.status_code": status_code})
    if status_code >= 500:
        target.set_status(Status(StatusCode.ERROR))
        target.set_attribute("error.type", str(status_code))
