"""``auto``'s caller named by a gateway's header (``auto_caller_header``), over the real app on
the fake backend in process: every request comes from one client address (the gateway's), and
the header alone tells the RAG backends apart; unset, the header is ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.conversions import MAX_CALLER_CHARS
from service.config.settings import Settings
from tests.app.conftest import Harness, reorder_body, serving

# Every run's fate is visible (still learning, no explore), and a caller is bounded at half.
LEARNING = {"auto_min_runs": 100, "auto_explore_rate": 0.0, "auto_max_caller_share": 0.5}


async def _recorded(h: Harness, caller: str | None) -> bool:
    headers = {} if caller is None else {"X-Caller-Id": caller}
    r = await h.client.post("/v1/reorder", json=reorder_body(), headers=headers)
    assert r.status_code == 200, r.text
    auto = r.json()["auto"]
    assert auto["path"] == "moi", auto
    return bool(auto["recorded"])


async def test_the_gateway_header_names_the_caller(tmp_path: Path) -> None:
    async with serving(tmp_path, auto_caller_header="X-Caller-Id", **LEARNING) as h:
        # a alone: one RAG backend, not bounded.
        assert [await _recorded(h, "rag-a") for _ in range(3)] == [True, True, True]
        # b arrives from the same address: its own caller, and a is bounded from now on.
        assert await _recorded(h, "rag-b")
        assert not await _recorded(h, "rag-a")
        assert await _recorded(h, "rag-b")
        # Without the header: one shared caller, "unknown", bounded like the others.
        assert await _recorded(h, None)
        assert h.metric("rag_reorder_auto_caller_capped_runs_total") == 1


async def test_the_header_is_ignored_unless_configured(tmp_path: Path) -> None:
    async with serving(tmp_path, **LEARNING) as h:
        # One client address: one caller whatever the header says, alone, so never bounded.
        assert [await _recorded(h, f"rag-{i % 2}") for i in range(6)] == [True] * 6
        assert h.metric("rag_reorder_auto_caller_capped_runs_total") == 0


async def test_a_caller_header_over_the_limit_is_refused(tmp_path: Path) -> None:
    async with serving(tmp_path, auto_caller_header="X-Caller-Id", **LEARNING) as h:
        headers = {"X-Caller-Id": "x" * (MAX_CALLER_CHARS + 1)}
        for path, body in (
            ("/v1/reorder", reorder_body()),
            ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ):
            r = await h.client.post(path, json=body, headers=headers)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["param"] == "X-Caller-Id"
            assert str(MAX_CALLER_CHARS) in error["message"]
            assert str(MAX_CALLER_CHARS + 1) in error["message"]


@pytest.mark.parametrize("name", ["Authorization", "Proxy-Authorization", "cookie", "X Caller", ""])
def test_the_caller_header_is_a_plain_header_and_no_secret(name: str) -> None:
    with pytest.raises(ValidationError):
        Settings(auto_caller_header=name)
