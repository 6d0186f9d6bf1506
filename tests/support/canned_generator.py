"""A real OpenAI-compatible HTTP server on localhost that answers from a chosen prompt slot:
the generator the online sampler's tests ask (``service.learning.generator_online``).

It reads the ``qa_default`` prompt (``Document [k]`` blocks, in prompt order), picks a slot
with ``slot_of(call number)`` and answers with that document's first sentence, so the answer
is contained in exactly the passage shown there. Every request is recorded (path, headers,
body) for the tests to inspect; ``status`` makes it refuse every call (401, 503...).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_DOC = re.compile(r"Document \[\d+\][^\n]*\n")
_SENTENCE = re.compile(r"[A-Z][^.\n]*\.")


@dataclass
class CannedGenerator:
    slot_of: Callable[[int], int]
    """Call number (0-based) -> the slot whose document it answers from."""
    status: int = 200
    calls: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    """``http://127.0.0.1:<port>/v1`` once serving."""

    def answer(self, body: dict[str, Any]) -> str:
        text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        docs = _DOC.split(text)[1:]
        slot = self.slot_of(len(self.calls) - 1) % len(docs)
        found = _SENTENCE.search(docs[slot])
        return found.group(0) if found else "I do not know."


@contextmanager
def canned_generator(slot_of: Callable[[int], int]) -> Iterator[CannedGenerator]:
    """Serve a ``CannedGenerator`` on a free localhost port for the block."""
    gen = CannedGenerator(slot_of)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            gen.calls.append({"path": self.path, "headers": dict(self.headers), "body": body})
            if gen.status != 200:
                self._send(gen.status, {"error": {"message": "refused by the test"}})
                return
            content = gen.answer(body)
            choice: dict[str, Any] = (
                {"message": {"role": "assistant", "content": content}}
                if self.path.endswith("/chat/completions")
                else {"text": content}
            )
            self._send(200, {"choices": [choice], "usage": {"prompt_tokens": 90}})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    gen.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield gen
    finally:
        server.shutdown()
        server.server_close()
