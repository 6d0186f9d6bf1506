"""A real uvicorn server process on the fake backend, for signal, exit-code and socket tests.

    python -m tests.app.fake_server --port P [--die-after-ready] [--delay S]

Requests whose ``X-Request-Id`` starts with ``slow-`` take ``--delay`` seconds to score, with
``hang-`` they never finish (until cancelled). ``--die-after-ready`` makes every call after
the warm-up raise ``BackendUnavailable``, as a dead engine does.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio

from app.main import create_app
from entrypoints.server import serve_app
from service.backends.base import ScoreResult, SpanRequest
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import BackendUnavailable
from tests.app.conftest import TRUTH


class ScriptedBackend(FakeBackend):
    def __init__(self, *, delay_s: float, die_after_ready: bool) -> None:
        super().__init__(TRUTH)
        self.slow_s = delay_s
        self.die_after_ready = die_after_ready
        self.calls = 0

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.calls += 1
        if self.die_after_ready and self.calls > 1:
            raise BackendUnavailable("the engine died")
        rid = requests[0].request_id if requests else ""
        if rid.startswith("hang-"):
            await anyio.sleep_forever()
        if rid.startswith("slow-"):
            await anyio.sleep(self.slow_s)
        return await super().score(requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--drain-timeout", type=float, default=10.0)
    ap.add_argument("--die-after-ready", action="store_true")
    args = ap.parse_args()
    settings = Settings(
        cache_dir=Path(tempfile.mkdtemp(prefix="rag-reorder-test-")),
        canary_interval_s=0.2 if args.die_after_ready else 0,
        drain_timeout_s=args.drain_timeout,
    )
    backend = ScriptedBackend(delay_s=args.delay, die_after_ready=args.die_after_ready)
    serve_app(create_app(settings, backend=backend), settings, "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
