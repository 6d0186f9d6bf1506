"""The request path does no blocking file I/O on the event loop with the folder store: profile
lookups (``auto``'s first read of a key, the adaptive design's bias, a named profile, the
profile routes) come from memory, and ``auto``'s assessment writes run in worker threads. On
a network volume each such call would hold every request for as long as the volume takes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import serving, wait_until
from tests.app.test_auto_http import backend, body, learn

pytestmark = pytest.mark.anyio


@contextmanager
def loop_file_calls(
    monkeypatch: pytest.MonkeyPatch, under: Path
) -> Iterator[list[tuple[str, str]]]:
    """Records file operations on paths under ``under`` (and every fsync) made on a thread
    that runs an event loop."""
    seen: list[tuple[str, str]] = []

    def on_loop() -> bool:
        return asyncio._get_running_loop() is not None

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Path, *args: Any, **kw: Any) -> Any:
            if on_loop() and Path(self).is_relative_to(under):
                seen.append((name, str(self)))
            return fn(self, *args, **kw)

        return call

    for name in ("stat", "glob", "read_text", "open"):
        monkeypatch.setattr(Path, name, wrap(name, getattr(Path, name)))
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if on_loop():
            seen.append(("fsync", str(fd)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield seen
    monkeypatch.undo()


async def test_profile_reads_and_writes_stay_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving(
        tmp_path, backend=backend(), auto_recalibrate_s=0.05, auto_explore_rate=0.0,
        state_refresh_s=0.05,
    ) as h:  # fmt: skip
        profiles = h.ctx.engine.profiles.root
        with loop_file_calls(monkeypatch, profiles) as seen:
            # auto learns: its first read of the key, its runs, the trusted profile's store.
            j = await learn(h)
            assert j["auto"]["path"] == "profile"
            # MoI's default (adaptive) design looks up the stored bias for its slots and the
            # data-oriented profiles of other slot counts.
            moi = (await h.client.post("/v1/reorder", json=body(1, strategy="moi"))).json()
            assert moi["diagnostics"]["adaptive"]["bias_profile"] is not None
            assert seen == []
            # A profile stored by another replica (another process on the folder) is found
            # by the next refresh, not by a read per request.
            other = type(h.ctx.engine.profiles)(profiles)
            other.put(
                model="generator", template="qa_default", coefficients=[0.4, 0.3, 0.2, 0.1],
                identification="answers", runs=50, prompts=200, r2=1.0, source="answers",
                oriented_by="data",
            )  # fmt: skip
            named = "generator__qa_default__L4"
            await wait_until(lambda: h.ctx.engine.profiles.by_id(named) is not None, timeout=10)
            seen.clear()  # the other replica's write above was the test's, on the loop
            r = await h.client.post("/v1/reorder", json=body(2, bias_profile=named))
            assert r.status_code == 200 and r.json()["auto"]["operator"]
            assert (await h.client.get(f"/v1/bias-profiles/{named}")).status_code == 200
            assert (await h.client.get("/v1/bias-profiles")).status_code == 200
            assert seen == []
        assert seen == []
