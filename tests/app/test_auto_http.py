"""The default strategy, ``auto``, through the HTTP app on the fake backend: MoI while it
learns, then the trusted profile with no model call; what the response, ``/info``, the profile
list and the metrics say; and the requests that name something else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.backends.fakes.fake import FakeBackend
from tests.app.conftest import Harness, TrackingBackend, serving, wait_until

pytestmark = pytest.mark.anyio

TEXTS = [f"Passage {k} is about the river number {k} and its towns." for k in range(10)]
TRUTH = {t: float(k % 5) - 2.0 for k, t in enumerate(TEXTS)}


def recency(slots: int) -> list[float]:
    return [1.0 + j for j in range(slots)]


def backend() -> TrackingBackend:
    return TrackingBackend(TRUTH, bias=recency, noise=0.05)


def body(k: int, **extra: Any) -> dict[str, Any]:
    shift = k % len(TEXTS)
    return {"query": f"which river is number {k}?", "passages": TEXTS[shift:] + TEXTS[:shift],
            **extra}  # fmt: skip


def trusted(h: Harness) -> bool:
    return any(s.trusted for s in h.ctx.engine.learner.status())


async def learn(h: Harness) -> dict[str, Any]:
    """Send MoI requests until the profile is trusted; the first response after it."""
    for k in range(12):
        r = await h.client.post("/v1/reorder", json=body(k))
        assert r.status_code == 200, r.text
        j = r.json()
        if j["auto"]["path"] != "moi":
            return j
        assert j["strategy"] == "auto" and j["auto"]["recorded"]
        assert j["position_bias"] is not None and j["usage"]["prompts_scored"] == 20
        if k >= 5:
            await wait_until(lambda: trusted(h), timeout=60)
    raise AssertionError("no trusted profile after 12 requests")


async def test_auto_learns_then_places_by_the_trusted_profile(tmp_path: Path) -> None:
    async with serving(
        tmp_path, backend=backend(), auto_recalibrate_s=0.05, auto_explore_rate=0.0
    ) as h:
        assert (await h.client.get("/info")).json()["default_strategy"] == "auto"
        first = (await h.client.post("/v1/reorder", json=body(0))).json()
        assert first["auto"]["path"] == "moi" and first["auto"]["ranker"] == "moi"
        assert "learning" in first["auto"]["reason"]
        j = await learn(h)
        auto = j["auto"]
        assert auto["path"] == "profile" and auto["ranker"] == "dense"
        assert auto["profile"] == "fake_known-truth__qa_default__L5"
        assert auto["trust"]["verdict"] == "shaped" and auto["trust"]["source"] == "traffic"
        assert auto["trust"]["top_slots"] == [9, 8] and auto["trust"]["runs"] >= 5
        # No model call on this path, and the ranking's best two go to the strongest slots.
        assert j["usage"]["prompt_tokens"] == 0 and j["position_bias"] is None
        assert j["diagnostics"]["placement"] == "bias_matched"
        assert j["order"][9] == j["ranking"][0] and j["order"][8] == j["ranking"][1]
        assert j["diagnostics"]["details"]["placement_profile"] == auto["profile"]

        info = (await h.client.get("/info")).json()["auto"]
        assert info["scorer_is_generator"] and info["learned_profile_allowed"]
        (prof,) = info["profiles"]
        assert prof["trusted"] and prof["slots"] == 5 and prof["profile"] == auto["profile"]
        listed = (await h.client.get("/v1/bias-profiles")).json()["data"]
        assert [p["trust"]["verdict"] for p in listed] == ["shaped"]

        text = (await h.client.get("/metrics")).text
        assert 'rag_reorder_auto_requests_total{path="profile"} 1.0' in text
        assert h.metric("rag_reorder_auto_requests_total", {"path": "moi"}) >= 5
        labels = {"template": "qa_default", "slots": "5"}
        assert h.metric("rag_reorder_auto_profile_trusted", labels) == 1
        assert h.metric("rag_reorder_auto_profile_age_seconds", labels) >= 0
        assert h.metric("rag_reorder_auto_recalibrations_total", {"outcome": "trusted"}) >= 1

        # The caller's own scores rank when every passage has one.
        scored = body(3)
        scored["passages"] = [
            {"text": t, "score": float(i)} for i, t in enumerate(scored["passages"])
        ]
        s = (await h.client.post("/v1/reorder", json=scored)).json()
        assert s["auto"]["ranker"] == "request_scores" and s["ranking"][0] == 9
        assert s["order"][9] == 9


async def test_requests_that_name_a_strategy_or_profile(tmp_path: Path) -> None:
    async with serving(tmp_path, backend=backend()) as h:
        moi = (await h.client.post("/v1/reorder", json=body(0, strategy="moi"))).json()
        assert moi["strategy"] == "moi" and moi["auto"] is None
        bad = await h.client.post("/v1/reorder", json=body(0, strategy="auto", placement="litm"))
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "placement"
        # Naming no strategy but a placement only MoI gives asks for MoI.
        litm = (await h.client.post("/v1/reorder", json=body(0, placement="litm"))).json()
        assert litm["strategy"] == "moi" and litm["diagnostics"]["placement"] == "litm"
        h.ctx.engine.profiles.put(
            model="generator", template="qa_default", coefficients=[0.4, 0.3, 0.2, 0.1],
            identification="answers", runs=50, prompts=200, r2=1.0, source="answers",
            oriented_by="data",
        )  # fmt: skip
        named = await h.client.post(
            "/v1/reorder", json=body(0, bias_profile="generator__qa_default__L4")
        )
        a = named.json()["auto"]
        assert a["path"] == "profile" and a["operator"] and a["trust"] is None
        assert named.json()["order"][0] == named.json()["ranking"][0]  # primacy profile
        r = await h.client.post("/v1/rerank", json={"query": "q?", "documents": TEXTS})
        assert r.json()["meta"]["reorder"]["auto"]["path"] == "moi"


async def test_a_scorer_that_is_not_the_generator_does_not_place_by_itself(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, backend=FakeBackend(TRUTH), generator_model="big/generator") as h:
        a = (await h.client.post("/v1/reorder", json=body(0))).json()["auto"]
        assert a["path"] == "moi" and not a["recorded"] and "not the generator" in a["reason"]
        info = (await h.client.get("/info")).json()["auto"]
        assert info["generator"] == "big/generator" and not info["scorer_is_generator"]
        assert not info["learned_profile_allowed"]


async def test_explore_requests_are_served_by_the_profile_and_checked_afterwards(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, backend=backend(), auto_recalibrate_s=0.05) as h:
        h.ctx.engine.learner.explore_rate = 0.0
        await learn(h)
        h.ctx.engine.learner.explore_rate = 1.0
        calls = h.backend.started
        j = (await h.client.post("/v1/reorder", json=body(20))).json()
        a = j["auto"]
        assert a["path"] == "explore" and a["ranker"] == "dense" and a["recorded"]
        # The caller got the profile's placement and paid for no model call ...
        assert j["usage"]["prompt_tokens"] == 0 and j["position_bias"] is None
        assert j["order"][9] == j["ranking"][0]
        # ... and MoI checked the profile on its passages afterwards, in the background.
        labels = {"outcome": "recorded"}
        await wait_until(lambda: h.metric("rag_reorder_auto_explore_runs_total", labels) == 1)
        assert h.backend.started > calls
        assert h.metric("rag_reorder_auto_requests_total", {"path": "explore"}) == 1
