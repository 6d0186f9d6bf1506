"""A TCP proxy that can refuse, stall or cut connections, for fault tests against real servers.

It runs its own event loop in a thread, so a synchronous test (or one whose loop drives a
server process) can flip its mode at any moment:

- ``pass``: bytes flow both ways untouched;
- ``down``: the listening socket is closed, so connections are refused (an engine not yet up,
  or gone);
- ``stall``: connections are accepted and requests forwarded, but nothing comes back (an
  engine that hangs);
- ``cut``: open connections are closed as soon as the mode is set, and new ones are closed
  when their first bytes arrive (an engine killed mid-request);
- ``html``: every request is answered 200 with an HTML page (a proxy's login page);
- ``unauthorized``: every request is answered 401 (a gateway after a key rotation).

Beside the mode, ``answer_next(prefix, *statuses)`` scripts single requests: each of the next
requests whose bytes start with ``prefix`` (``b"POST /v1/reorder"``) is answered the next
status (503 with ``Retry-After: 0``, 504 or 502, each with an error envelope in the server's
shape) and its connection closed, kept-alive ones included; other requests pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import deque
from typing import Literal

Mode = Literal["pass", "down", "stall", "cut", "html", "unauthorized"]

_CANNED: dict[str, bytes] = {
    "html": b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 39\r\n"
    b"connection: close\r\n\r\n<html><body>Please log in</body></html>",
    "unauthorized": b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
    b"content-length: 37\r\nconnection: close\r\n\r\n"
    b'{"error": {"message": "invalid key"}}',
}

_WORDS = {
    502: ("Bad Gateway", "bad_gateway", "the upstream closed the connection"),
    503: ("Service Unavailable", "overloaded", "the queue is full; retry after Retry-After"),
    504: ("Gateway Timeout", "deadline_exceeded", "the request did not finish in 600 s"),
}


def _status_answer(status: int) -> bytes:
    reason, code, message = _WORDS[status]
    body = json.dumps({"error": {"type": "server_error", "code": code, "message": message}})
    retry = "retry-after: 0\r\n" if status == 503 else ""
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{retry}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
    ).encode()


class FaultProxy:
    def __init__(self, target_port: int, port: int) -> None:
        self.target_port = target_port
        self.port = port
        self._mode: Mode = "down"
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._script: deque[tuple[bytes, int]] = deque()
        self.scripted = 0
        """Requests answered from the script so far."""
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def mode(self) -> Mode:
        return self._mode

    def set(self, mode: Mode) -> None:
        asyncio.run_coroutine_threadsafe(self._set(mode), self._loop).result(10)

    def answer_next(self, prefix: bytes, *statuses: int) -> None:
        """Answer the next requests starting with ``prefix`` with ``statuses``, one each."""
        for status in statuses:
            _WORDS[status]  # a KeyError names a status there is no answer for
            self._loop.call_soon_threadsafe(self._script.append, (prefix, status))

    def close(self) -> None:
        self.set("down")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _set(self, mode: Mode) -> None:
        self._mode = mode
        if mode == "down":
            if self._server is not None:
                self._server.close()
                self._server = None
            self._cut_all()
            return
        if mode in ("cut", "html", "unauthorized"):
            # Kept-alive connections would still pass through: every call must meet the fault.
            self._cut_all()
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            first = await reader.read(65536)
            if not first or self._mode == "cut":
                return
            canned = _CANNED.get(self._mode)
            if canned is not None:
                # Closed gracefully: an abort could drop the answer before it is sent.
                self._writers.discard(writer)
                writer.write(canned)
                await writer.drain()
                writer.close()
                await writer.wait_closed()
                return
            if await self._scripted(first, writer):
                return
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(upstream)
            upstream.write(first)
            await asyncio.gather(
                self._requests(reader, upstream, writer), self._pump(up_reader, writer, True)
            )
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()

    async def _scripted(self, chunk: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer ``chunk`` from the script when it starts the next scripted request (an HTTP
        client sends a request's line first and waits for the answer before the next)."""
        if not self._script or not chunk.startswith(self._script[0][0]):
            return False
        _, status = self._script.popleft()
        self.scripted += 1
        self._writers.discard(writer)
        writer.write(_status_answer(status))
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        return True

    async def _requests(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        """Client to server, meeting the script on a kept-alive connection too."""
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                if self._mode in ("cut", "down"):
                    return
                if await self._scripted(data, client):
                    dst.transport.abort()
                    return
                dst.write(data)
                await dst.drain()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, answer: bool = False
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                while answer and self._mode == "stall":
                    await asyncio.sleep(0.05)  # hold the answer back
                if self._mode in ("cut", "down"):
                    return
                dst.write(data)
                await dst.drain()
