"""``auto``'s caller behind a real proxy hop: a real server process (the fake backend) behind a
small forwarding proxy that sets ``X-Forwarded-For`` to the client's address, as an ingress
does. The server believes the proxy only if its address is in ``forwarded_allow_ips``; then
each client is its own caller and ``auto_max_caller_share`` bounds them, the first included."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from entrypoints.cli import _parser, _settings
from tests.app.conftest import PASSAGES, QUERY
from tests.app.processes import server_process

PROXY_ADDRESS = "127.0.0.5"  # where the proxy connects from: not the default 127.0.0.1


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body


def _forward(conn: socket.socket, upstream: int) -> None:
    """One request: the client's, with ``X-Forwarded-For`` set to its address, sent from
    ``PROXY_ADDRESS``; the answer relayed until the server closes."""
    with conn:
        request = _read_request(conn)
        if request is None:
            return
        head, _, body = request.partition(b"\r\n\r\n")
        lines = [
            line
            for line in head.split(b"\r\n")
            if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"x-forwarded-for")
        ]
        client_ip = conn.getpeername()[0]
        lines += [f"X-Forwarded-For: {client_ip}".encode(), b"Connection: close"]
        with socket.create_connection(
            ("127.0.0.1", upstream), timeout=30, source_address=(PROXY_ADDRESS, 0)
        ) as up:
            up.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            while chunk := up.recv(65536):
                conn.sendall(chunk)


@contextmanager
def forwarding_proxy(upstream: int) -> Iterator[str]:
    """A reverse proxy on a free loopback port in front of ``upstream``; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_forward, args=(conn, upstream), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        listener.close()


def client_from(address: str, base_url: str) -> httpx.Client:
    """A client whose connections come from ``address`` (another loopback address)."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=base_url, transport=transport, timeout=60)


def test_each_client_behind_a_trusted_proxy_is_its_own_caller(tmp_path: Path) -> None:
    env = {
        "RAG_REORDER_FORWARDED_ALLOW_IPS": PROXY_ADDRESS,
        "RAG_REORDER_AUTO_MAX_CALLER_SHARE": "0.5",
        "RAG_REORDER_AUTO_EXPLORE_RATE": "0",
        "RAG_REORDER_AUTO_MIN_RUNS": "100",  # keeps learning: every run's fate is visible
    }
    args = ["-m", "tests.app.fake_server", "--port", "{port}"]
    with server_process(args, tmp_path / "server.log", env) as server:
        server.wait_ready(60)
        upstream = int(server.base_url.rsplit(":", 1)[1])
        with (
            forwarding_proxy(upstream) as url,
            client_from("127.0.0.2", url) as a,
            client_from("127.0.0.3", url) as b,
        ):
            body = {"query": QUERY, "passages": PASSAGES}

            def recorded(client: httpx.Client) -> bool:
                r = client.post("/v1/reorder", json=body)
                assert r.status_code == 200, r.text
                auto = r.json()["auto"]
                assert auto["path"] == "moi"
                return bool(auto["recorded"])

            # a alone: one RAG backend in front, not bounded.
            assert [recorded(a) for _ in range(3)] == [True, True, True]
            # b arrives: from now on a is bounded too, at half of the recent runs.
            assert recorded(b)
            assert not recorded(a)
            assert recorded(b)
            metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            assert "rag_reorder_auto_caller_capped_runs_total 1.0" in metrics


def test_serve_takes_the_trusted_proxies_from_its_flag() -> None:
    args = _parser().parse_args(["serve", "--forwarded-allow-ips", "10.0.0.0/8,192.168.1.1"])
    assert _settings(args).forwarded_allow_ips == "10.0.0.0/8,192.168.1.1"
