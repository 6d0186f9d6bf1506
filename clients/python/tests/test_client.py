"""``rag_reorder.Client`` / ``AsyncClient`` against a real server process (fake backend), and
against a scripted stdlib HTTP server for what the service itself never sends (429, an HTML
error page)."""

from __future__ import annotations

import inspect
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from rag_reorder import (
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    Client,
    Passage,
    RagReorderError,
    __version__,
    _protocol,
    reorder_item,
)
from rag_reorder._protocol import reorder_request, rerank_request
from servers import API_KEY, BEST_FIRST, ServerProcess, free_port
from servers import FAKE_PASSAGES as PASSAGES
from servers import FAKE_QUERY as QUERY

pytestmark = pytest.mark.timeout(60)


def client(server: ServerProcess, **kwargs: Any) -> Client:
    return Client(server.base_url, api_key=API_KEY, **kwargs)


def test_reorder_returns_the_typed_fit(fake_service: ServerProcess) -> None:
    with client(fake_service) as c:
        out = c.reorder(
            QUERY,
            [Passage(text=PASSAGES[0], id="doc-0", score=1.5), *PASSAGES[1:]],
            placement="descending_utility",
            request_id="client-test-1",
        )
    assert out.id == "client-test-1" and out.model == "fake/known-truth"
    assert out.strategy == "moi" and out.placement == "descending_utility"
    # The fake backend's bias falls from the first slot: descending utility is the truth's order.
    assert list(out.ranking) == BEST_FIRST == list(out.order)
    assert out.passage(0).id == "doc-0" and out.rank(BEST_FIRST[0]) == 0
    utilities = [out.passage(i).utility or 0.0 for i in BEST_FIRST]
    assert utilities == sorted(utilities, reverse=True) and len(set(utilities)) == 4
    assert out.position_bias is not None and out.position_bias.identified
    assert sum(out.position_bias.coefficients) == pytest.approx(1.0)
    assert "usage" in out.raw


def test_top_n_and_the_rerank_route(fake_service: ServerProcess) -> None:
    with client(fake_service) as c:
        best_two = c.reorder(QUERY, PASSAGES, top_n=2)
        placed = c.rerank(QUERY, PASSAGES, results_order="placement", top_n=3)
        ranked = c.rerank(QUERY, PASSAGES, return_documents=False)
    assert sorted(best_two.order) == sorted(BEST_FIRST[:2]) and len(best_two.passages) == 4
    assert placed.results_order == "placement"
    assert [r.index for r in placed.results] == list(placed.order)
    assert placed.results[0].text == PASSAGES[placed.order[0]]
    assert ranked.results_order == "ranking" and ranked.total_tokens > 0
    assert [r.index for r in ranked.results] == list(ranked.ranking) == BEST_FIRST
    assert all(r.text is None for r in ranked.results)


def test_the_error_envelope_becomes_one_exception(fake_service: ServerProcess) -> None:
    with client(fake_service) as c, pytest.raises(RagReorderError) as err:
        c.reorder(QUERY, PASSAGES, strategy="no-such-strategy")
    e = err.value
    assert (e.status, e.type, e.code, e.param) == (
        422,
        "invalid_request_error",
        "validation_error",
        "strategy",
    )
    assert "no-such-strategy" in e.message and e.request_id
    assert str(e).startswith("422 validation_error (strategy): ")

    with Client(fake_service.base_url) as c, pytest.raises(RagReorderError) as err:
        c.reorder(QUERY, PASSAGES)
    assert (err.value.status, err.value.code) == (401, "missing_api_key")


def _occupy(server: ServerProcess) -> threading.Thread:
    """Hold the service's only admission slot for 1.5 s (the fake backend's ``slow-`` ids)."""
    started = threading.Event()

    def slow() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as h:
            started.set()
            r = h.post(
                "/v1/reorder",
                json={"query": QUERY, "passages": PASSAGES},
                headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "slow-1"},
            )
            assert r.status_code == 200, r.text

    t = threading.Thread(target=slow)
    t.start()
    started.wait()
    time.sleep(0.3)  # the slow request is admitted before the client's
    return t


def test_a_503_with_retry_after_is_retried_after_the_wait(fake_service: ServerProcess) -> None:
    # Without retries: the service's own 503, its Retry-After read into the exception.
    busy = _occupy(fake_service)
    with client(fake_service, max_retries=0) as c, pytest.raises(RagReorderError) as err:
        c.reorder(QUERY, PASSAGES)
    assert (err.value.status, err.value.code, err.value.retry_after) == (503, "overloaded", 1.0)
    busy.join()

    busy = _occupy(fake_service)
    t0 = time.monotonic()
    with client(fake_service, max_retries=4) as c:
        out = c.reorder(QUERY, PASSAGES)
    elapsed = time.monotonic() - t0
    busy.join()
    assert list(out.ranking) == BEST_FIRST
    assert elapsed >= 1.0  # it waited Retry-After (1 s) at least once


async def test_the_async_client_reorders_and_retries(fake_service: ServerProcess) -> None:
    busy = _occupy(fake_service)
    async with AsyncClient(fake_service.base_url, api_key=API_KEY, max_retries=4) as c:
        out = await c.reorder(QUERY, PASSAGES)
        placed = await c.rerank(QUERY, PASSAGES, results_order="placement")
    busy.join()
    assert list(out.ranking) == BEST_FIRST
    assert [r.index for r in placed.results] == list(placed.order)


def test_no_server_is_a_connection_error_after_the_retries() -> None:
    c = Client(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    with c, pytest.raises(RagReorderError) as err:
        c.reorder(QUERY, PASSAGES)
    assert (err.value.status, err.value.code) == (None, "connection_error")


def test_a_timeout_is_reported_as_such(fake_service: ServerProcess) -> None:
    with client(fake_service, timeout=0.3, max_retries=0) as c, pytest.raises(RagReorderError) as e:
        c.reorder(QUERY, PASSAGES, request_id="slow-timeout")
    assert (e.value.status, e.value.code) == (None, "timeout")


# --- a scripted server: what a gateway in front of the service may answer -----------------


@contextmanager
def scripted(
    responses: list[tuple[int, dict[str, str], bytes]],
    delay_s: float = 0.0,
    tls: ssl.SSLContext | None = None,
) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A real HTTP server (HTTPS with ``tls``) answering POSTs from ``responses`` in turn (the
    last one repeats), each after ``delay_s``; yields its base URL and the headers of the
    requests it saw."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            seen.append({k.lower(): v for k, v in self.headers.items()})
            time.sleep(delay_s)
            status, headers, body = responses[min(len(seen), len(responses)) - 1]
            self.send_response(status)
            for k, v in {"content-length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


OK_BODY = json.dumps(
    {
        "id": "r1",
        "model": "m",
        "strategy": "moi",
        "order": [1, 0],
        "ranking": [1, 0],
        "passages": [
            {"index": 1, "id": None, "utility": 0.5, "confidence_above_next": 0.9, "shown": True},
            {"index": 0, "id": None, "utility": -0.5, "shown": True},
        ],
        "position_bias": None,
        "diagnostics": {"placement": "bias_matched", "warnings": []},
    }
).encode()


def test_429_is_retried_and_retry_after_may_be_a_date() -> None:
    # An HTTP date one second ahead rounds to 0-1 s: the retry comes after at most ~1.1 s.
    soon = formatdate(time.time() + 1, usegmt=True)
    answers = [
        (429, {"retry-after": "0"}, b""),
        (503, {"retry-after": soon}, b""),
        (200, {"content-type": "application/json"}, OK_BODY),
    ]
    with scripted(answers) as (base, seen), Client(base, api_key="k", max_retries=2) as c:
        out = c.reorder("q", ["a", "b"])
    assert list(out.order) == [1, 0] and out.passage(1).confidence_above_next == 0.9
    assert len(seen) == 3
    assert seen[0]["authorization"] == "Bearer k"
    assert seen[0]["user-agent"] == f"rag-reorder-python/{__version__}"


def test_the_services_engine_unavailable_is_final_its_overload_is_retried() -> None:
    # The service retried its engine already: a 503 engine_unavailable is not sent again;
    # overloaded, not_ready and draining (turned away before any work) are.
    def envelope(code: str) -> tuple[int, dict[str, str], bytes]:
        body = {"error": {"type": "unavailable_error", "message": code, "code": code}}
        return (
            503,
            {"retry-after": "0", "content-type": "application/json"},
            json.dumps(body).encode(),
        )

    with (
        scripted([envelope("engine_unavailable"), OK]) as (base, seen),
        Client(base, max_retries=3) as c,
        pytest.raises(RagReorderError) as e,
    ):
        c.reorder("q", ["a", "b"])
    assert (e.value.status, e.value.code) == (503, "engine_unavailable") and len(seen) == 1
    answers = [envelope("overloaded"), envelope("not_ready"), envelope("draining"), OK]
    with scripted(answers) as (base, seen), Client(base, max_retries=3) as c:
        assert list(c.reorder("q", ["a", "b"]).order) == [1, 0]
    assert len(seen) == 4


def test_a_gateway_error_page_is_an_http_error_not_a_crash() -> None:
    page = (502, {"content-type": "text/html"}, b"<html>bad gateway</html>")
    with scripted([page]) as (base, seen), Client(base) as c, pytest.raises(RagReorderError) as e:
        c.reorder("q", ["a"])
    assert (e.value.status, e.value.code) == (502, "http_error") and len(seen) == 1


OK = (200, {"content-type": "application/json"}, OK_BODY)


def test_a_supplied_http_client_still_sends_the_key_the_agent_and_the_headers() -> None:
    with (
        scripted([OK]) as (base, seen),
        httpx.Client(base_url=base, headers={"x-theirs": "1"}) as h,
    ):
        c = Client(api_key="k", headers={"x-tenant": "t1"}, http_client=h)
        c.reorder("q", ["a", "b"], request_id="r-7")
    sent = seen[0]
    assert sent["authorization"] == "Bearer k" and sent["x-tenant"] == "t1"
    assert sent["user-agent"] == f"rag-reorder-python/{__version__}"
    assert sent["x-request-id"] == "r-7" and sent["x-theirs"] == "1"


async def test_a_supplied_async_http_client_still_sends_the_key_the_agent_and_the_headers() -> None:
    with scripted([OK]) as (base, seen):
        async with httpx.AsyncClient(base_url=base) as http:
            c = AsyncClient(api_key="k", headers={"x-tenant": "t1"}, http_client=http)
            await c.reorder("q", ["a", "b"])
    assert seen[0]["authorization"] == "Bearer k" and seen[0]["x-tenant"] == "t1"
    assert seen[0]["user-agent"] == f"rag-reorder-python/{__version__}"


async def test_https_trusts_what_httpx_trusts_and_every_client_shares_one_tls_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A service behind TLS with its own CA, trusted through SSL_CERT_FILE as httpx trusts it.
    # The clients build that verification context once per process, not once each (reading
    # the CA bundle was 20-90 ms of CPU a client: an adapter built per request paid it).
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with scripted([OK], tls=server_tls) as (base, seen):
        with Client(base, max_retries=0) as c, pytest.raises(RagReorderError) as e:
            c.reorder("q", ["a", "b"])  # certifi's CAs do not hold this one
        assert e.value.code == "connection_error" and "CERTIFICATE_VERIFY_FAILED" in str(e.value)
        built: list[ssl.SSLContext] = []
        real = httpx.create_ssl_context

        def counted() -> ssl.SSLContext:
            built.append(real())
            return built[-1]

        monkeypatch.setattr(_protocol.httpx, "create_ssl_context", counted)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        for _ in range(3):
            with Client(base, max_retries=0) as c:
                assert list(c.reorder("q", ["a", "b"]).order) == [1, 0]
        async with AsyncClient(base, max_retries=0) as ac:
            assert list((await ac.reorder("q", ["a", "b"])).order) == [1, 0]
    assert len(built) == 1 and len(seen) == 4


def test_the_default_timeout_outlasts_the_services_deadline() -> None:
    # The service answers 504 at its deadline (120 s by default): the client must still be
    # listening then, or its user sees a bare timeout instead of the service's error.
    assert DEFAULT_TIMEOUT_S >= 120 + 10
    with Client() as c:
        assert c._http.timeout.read == DEFAULT_TIMEOUT_S
        assert c._http.timeout.connect == 5.0


def test_a_read_timeout_after_the_request_was_sent_is_not_retried() -> None:
    # The server got the request and is working on it: a retry would start the job again.
    with scripted([OK], delay_s=1.0) as (base, seen), pytest.raises(RagReorderError) as e:
        c = Client(base, timeout=0.3, max_retries=3, backoff_s=0.01)
        with c:
            c.reorder("q", ["a", "b"])
    assert e.value.code == "timeout" and "not retried" in e.value.message
    time.sleep(1.0)  # let the server log what it received
    assert len(seen) == 1


async def test_the_async_client_does_not_retry_a_read_timeout_either() -> None:
    with scripted([OK], delay_s=1.0) as (base, seen), pytest.raises(RagReorderError) as e:
        async with AsyncClient(base, timeout=0.3, max_retries=3, backoff_s=0.01) as c:
            await c.reorder("q", ["a", "b"])
    assert e.value.code == "timeout"
    time.sleep(1.0)
    assert len(seen) == 1


def test_a_504_is_final() -> None:
    late = (
        504,
        {"content-type": "application/json"},
        b'{"error": {"message": "late", "type": "timeout_error", "code": "deadline_exceeded"}}',
    )
    with scripted([late]) as (base, seen), pytest.raises(RagReorderError) as e:
        Client(base, max_retries=3).reorder("q", ["a"])
    assert (e.value.status, e.value.code, len(seen)) == (504, "deadline_exceeded", 1)


def test_top_k_is_the_best_k_in_prompt_order_not_the_first_slots() -> None:
    body = json.loads(OK_BODY)
    body.update(order=[3, 2, 1, 0], ranking=[0, 1, 2, 3])  # a recency placement
    body["passages"] = [{"index": i, "shown": True} for i in range(4)]
    answer = (200, {"content-type": "application/json"}, json.dumps(body).encode())
    with scripted([answer]) as (base, _), Client(base) as c:
        out = c.reorder("q", ["a", "b", "c", "d"])
    assert out.top(2) == [1, 0] and list(out.order[:2]) == [3, 2]
    with pytest.raises(ValueError, match="k must be >= 1"):
        out.top(0)


def test_both_clients_and_the_request_builder_take_the_same_arguments() -> None:
    # The clients only send what one builder per route makes: their signatures are the
    # builder's, so a new option added to one and not the others fails here.
    for name, build in (("reorder", reorder_request), ("rerank", rerank_request)):
        expected = list(inspect.signature(build).parameters.values())
        for cls in (Client, AsyncClient):
            method = list(inspect.signature(getattr(cls, name)).parameters.values())
            assert method[1:] == expected, (cls.__name__, name)


async def test_reorder_batch_answers_each_item_in_its_place(fake_service: ServerProcess) -> None:
    """Issue 94: one good item and one with an invalid option; the good one is answered, the
    bad one carries its own 422; the async client parses the same call alike."""
    items = [
        reorder_item(QUERY, PASSAGES, placement="descending_utility"),
        reorder_item(QUERY, PASSAGES, design={"num_prompts": 0}),
    ]
    with client(fake_service) as c:
        out = c.reorder_batch(items, request_id="client-batch")
    good, bad = out.items
    assert (good.index, good.status, good.request_id) == (0, 200, "client-batch.0")
    assert list(good.result().order) == BEST_FIRST and good.result().id == "client-batch.0"
    assert (bad.index, bad.status, bad.request_id) == (1, 422, "client-batch.1")
    assert out.failed == [bad] and bad.reordering is None
    with pytest.raises(RagReorderError) as err:
        out.results()
    assert err.value.param == "design.num_prompts"
    assert err.value.code == "validation_error" and err.value.request_id == "client-batch.1"

    async with AsyncClient(fake_service.base_url, api_key=API_KEY) as ac:
        again = await ac.reorder_batch(items[:1])
        with pytest.raises(RagReorderError) as empty:
            await ac.reorder_batch([])
    assert again.results()[0].order == good.result().order
    assert (empty.value.status, empty.value.param) == (422, "items")
