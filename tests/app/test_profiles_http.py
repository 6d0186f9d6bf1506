"""Bias profiles over HTTP: list, read, calibrate (API.md, "Around them"), on the fake backend.

The fake backend is built with a recency bias (the direction SmolLM2 has, and the one a
generic primacy prior gets backwards), so a calibration that returns the truth's direction
shows the pruned-random runs oriented the full-length profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.backends.fakes.fake import primacy_bias
from tests.app.conftest import PASSAGES, QUERY, TRUTH, Harness, TrackingBackend, serving


def recency_bias(n_slots: int) -> tuple[float, ...]:
    return tuple(reversed(primacy_bias(n_slots)))


def calibration_body(queries: int = 6, **options: Any) -> dict[str, Any]:
    """``queries`` queries over the four known passages, each in a different rotation."""
    return {
        "queries": [
            {
                "query": f"{QUERY} ({k})",
                "passages": PASSAGES[k % 4 :] + PASSAGES[: k % 4],
            }
            for k in range(queries)
        ],
        **options,
    }


def cosine(a: list[float], b: tuple[float, ...]) -> float:
    x, y = np.asarray(a), np.asarray(b)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


async def test_calibrate_stores_an_oriented_profile_that_cyclic_requests_then_use(
    tmp_path: Path,
) -> None:
    backend = TrackingBackend(TRUTH, bias=recency_bias, noise=0.05)
    async with serving(tmp_path, backend=backend) as h:
        # Before: no profile, so a cyclic design is refused as unidentifiable.
        cyc = {"query": QUERY, "passages": PASSAGES, "design": {"kind": "cyclic"}}
        before = await h.client.post("/v1/reorder", json=cyc)
        assert before.status_code == 422
        assert before.json()["error"]["code"] == "unidentifiable_design"
        empty = {"object": "list", "data": [], "traffic_samples": []}
        assert (await h.client.get("/v1/bias-profiles")).json() == empty

        r = await h.client.post("/v1/bias-profiles/calibrate", json=calibration_body())
        assert r.status_code == 200, r.text
        out = r.json()
        prof, orienting = out["profile"], out["orienting_profile"]
        assert out["id"] == prof["id"] == "fake_known-truth__qa_default__L4"
        assert prof["slots"] == 4 and prof["oriented_by"] == "profile"
        assert sum(prof["coefficients"]) == pytest.approx(1.0)
        # The direction came from the data: recency, as built, not the primacy prior.
        assert cosine(prof["coefficients"], recency_bias(4)) > 0.98
        assert prof["coefficients"][-1] > prof["coefficients"][0]
        assert orienting["slots"] == 2 and orienting["oriented_by"] == "data"
        assert orienting["coefficients"][1] > orienting["coefficients"][0]
        assert out["queries"] == 6 and out["prompts_failed"] == 0
        # random at N = 4 is 4! = 24 orders, capped by the design's default; plus 2N pruned.
        assert out["prompts"] > 6 * 8 and out["prompt_tokens"] > 0
        assert (
            h.metric(
                "rag_reorder_bias_profile_calibrations_total",
                {"design": "random", "source": "queries"},
            )
            == 1
        )

        listed = (await h.client.get("/v1/bias-profiles")).json()["data"]
        assert [p["id"] for p in listed] == [orienting["id"], prof["id"]]  # by slot count
        read = await h.client.get(f"/v1/bias-profiles/{prof['id']}")
        assert read.status_code == 200 and read.json() == prof
        only = await h.client.get("/v1/bias-profiles", params={"template": "no-such-template"})
        assert only.json()["data"] == []

        # After: the cyclic request finds the profile and orders by the truth.
        after = await h.client.post("/v1/reorder", json=cyc)
        assert after.status_code == 200, after.text
        body = after.json()
        assert body["position_bias"]["profile"]["id"] == prof["id"]
        assert body["ranking"] == sorted(range(4), key=lambda i: -TRUTH[PASSAGES[i]])
        # The default placement follows the profile: recency, so the best passage goes last.
        assert body["diagnostics"]["placement"] == "bias_matched"
        assert body["order"] == body["ranking"][::-1]
        route = {"route": "/v1/bias-profiles/{profile_id}", "status": "200"}
        assert h.metric("rag_reorder_http_requests_total", route) == 1


async def test_pruned_random_calibration_stores_one_data_profile(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, bias=recency_bias)
    async with serving(tmp_path, backend=backend) as h:
        body = calibration_body(4, design="pruned_random", prompt_passages=3, source="unit test")
        r = await h.client.post("/v1/bias-profiles/calibrate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["orienting_profile"] is None
        assert out["profile"]["slots"] == 3 and out["profile"]["oriented_by"] == "data"
        assert out["profile"]["source"] == "unit test"
        assert cosine(out["profile"]["coefficients"], recency_bias(3)) > 0.99
        # Each query was scored as a request of its own, with the calibration's request id.
        rid = r.headers["x-request-id"]
        mine = [i.removeprefix(f"{rid}-") for i in backend.request_ids if i.startswith(rid)]
        assert {i.split("-")[0] for i in mine} == {"0", "1", "2", "3"}


async def test_unknown_profile_is_404(served: Harness) -> None:
    r = await served.client.get("/v1/bias-profiles/nope__qa_default__L4")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["param"] == "profile_id"
    assert "nope__qa_default__L4" in err["message"]
    # A path-like id is only ever compared with listed ids, never opened.
    r = await served.client.get("/v1/bias-profiles/..%2F..%2Fetc%2Fpasswd")
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("change", "param", "status", "fragment"),
    [
        (lambda b: b["queries"][1]["passages"].pop(), "queries[1].passages", 422, "3 passages"),
        (lambda b: b.update(queries=b["queries"] * 3), "queries", 422, "over the limit of 5"),
        (
            lambda b: b["queries"][0]["passages"].__setitem__(2, "x" * 300),
            "queries[0].passages[2]",
            422,
            "over the limit of 200",
        ),
        (lambda b: b.update(num_prompts=11), "num_prompts", 422, "over the limit of 10"),
        (lambda b: b.update(design="pruned_random", prompt_passages=9), "design", 422, ""),
        (lambda b: b.update(design="cyclic"), "design", 422, "random"),
        (lambda b: b["queries"][0].update(passages=["only one"]), "queries[0].passages", 422, ""),
    ],
)
async def test_bad_calibrations_name_the_parameter_and_store_nothing(
    tmp_path: Path, change: Any, param: str, status: int, fragment: str
) -> None:
    async with serving(
        tmp_path, max_calibration_queries=5, max_passage_chars=200, max_prompts_per_request=10
    ) as h:
        body = calibration_body(4)
        change(body)
        warmup_calls = h.backend.started
        r = await h.client.post("/v1/bias-profiles/calibrate", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"]
        assert h.backend.started == warmup_calls  # refused before any scoring
        assert (await h.client.get("/v1/bias-profiles")).json()["data"] == []


async def test_too_few_prompts_is_unidentifiable_and_stores_nothing(served: Harness) -> None:
    body = calibration_body(2, design="pruned_random", num_prompts=1)
    r = await served.client.post("/v1/bias-profiles/calibrate", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "unidentifiable_design" and err["param"] == "num_prompts"
    assert (await served.client.get("/v1/bias-profiles")).json()["data"] == []


async def test_each_query_is_held_to_the_per_request_token_limit(tmp_path: Path) -> None:
    # One query's prompts fit; the whole calibration's would not if it counted as one request.
    async with serving(tmp_path, max_prompt_tokens_x_prompts=8_000) as h:
        ok = await h.client.post(
            "/v1/bias-profiles/calibrate", json=calibration_body(6, design="pruned_random")
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["prompt_tokens"] > 8_000
    # No warm-up: its own probe (431 tokens) is held to the same limit and would fail start.
    async with serving(tmp_path, max_prompt_tokens_x_prompts=200, warmup=False) as h:
        r = await h.client.post("/v1/bias-profiles/calibrate", json=calibration_body(2))
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "prompt_tokens_x_prompts"


async def test_calibration_deadline_is_504_naming_its_setting(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, delay_s=0.2)
    async with serving(tmp_path, backend=backend, calibration_timeout_s=0.3) as h:
        r = await h.client.post("/v1/bias-profiles/calibrate", json=calibration_body(6))
        assert r.status_code == 504
        assert "calibration_timeout_s = 0.3 s" in r.json()["error"]["message"]
        assert backend.cancelled >= 1
        assert (await h.client.get("/v1/bias-profiles")).json()["data"] == []


async def test_profiles_need_the_api_key_when_one_is_set(tmp_path: Path) -> None:
    async with serving(tmp_path, api_key="s3cret") as h:
        for method, path in [
            ("GET", "/v1/bias-profiles"),
            ("GET", "/v1/bias-profiles/x"),
            ("POST", "/v1/bias-profiles/calibrate"),
        ]:
            r = await h.client.request(method, path, json=calibration_body(2))
            assert r.status_code == 401, (method, path)


async def test_calibrate_from_sampled_live_traffic(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, bias=recency_bias, noise=0.05)
    async with serving(tmp_path, backend=backend, traffic_sample_rate=1.0) as h:
        traffic = {"from_traffic": True, "design": "pruned_random", "slots": 2}
        none_yet = await h.client.post("/v1/bias-profiles/calibrate", json=traffic)
        assert none_yet.status_code == 422 and none_yet.json()["error"]["param"] == "slots"
        assert "held: none" in none_yet.json()["error"]["message"]

        # Live requests: 3 pruned-random (L = 2 of 4), 3 random (N = 4), 1 cyclic, 1 joint.
        for k in range(3):
            for kind in ("pruned_random", "random"):
                body = {
                    "query": f"{QUERY} {k}",
                    "passages": PASSAGES[k:] + PASSAGES[:k],
                    "design": {"kind": kind, "seed": k},
                }
                r = await h.client.post("/v1/reorder", json=body)
                assert r.status_code == 200, r.text
        joint = {"query": QUERY, "passages": PASSAGES, "joint": True}
        assert (await h.client.post("/v1/reorder", json=joint)).status_code == 200
        listed = (await h.client.get("/v1/bias-profiles")).json()
        held = {(t["design"], t["slots"]): t["runs"] for t in listed["traffic_samples"]}
        assert held == {("pruned_random", 2): 3, ("random", 4): 3}  # joint not kept
        metrics = (await h.client.get("/metrics")).text
        assert 'rag_reorder_traffic_sample_runs{design="pruned_random"} 3.0' in metrics

        scored_before = backend.started
        r = await h.client.post("/v1/bias-profiles/calibrate", json=traffic)
        assert r.status_code == 200, r.text
        pruned = r.json()
        assert backend.started == scored_before  # no model calls
        assert pruned["queries"] == 3 and pruned["prompt_tokens"] == 0
        assert pruned["profile"]["oriented_by"] == "data"
        assert pruned["profile"]["coefficients"][1] > pruned["profile"]["coefficients"][0]
        assert pruned["profile"]["source"] == "live traffic: 3 sampled pruned_random runs"

        # The full-length runs are oriented by that stored data profile.
        full = {"from_traffic": True, "design": "random", "slots": 4}
        r = await h.client.post("/v1/bias-profiles/calibrate", json=full)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["profile"]["oriented_by"] == "profile"
        assert out["warnings"] == [
            "only 3 sampled run(s): a profile from few queries is noisy, and it replaced any "
            "earlier one; let traffic accumulate (rag_reorder_traffic_sample_runs)"
        ]
        assert out["orienting_profile"]["id"] == pruned["id"]
        assert cosine(out["profile"]["coefficients"], recency_bias(4)) > 0.95
        labels = {"design": "random", "source": "traffic"}
        assert h.metric("rag_reorder_bias_profile_calibrations_total", labels) == 1


async def test_full_length_traffic_without_a_data_profile_warns_of_the_prior(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, traffic_sample_rate=1.0) as h:
        body = {"query": QUERY, "passages": PASSAGES, "design": {"kind": "random"}}
        assert (await h.client.post("/v1/reorder", json=body)).status_code == 200
        full = {"from_traffic": True, "design": "random", "slots": 4}
        r = await h.client.post("/v1/bias-profiles/calibrate", json=full)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["profile"]["oriented_by"] == "prior" and out["orienting_profile"] is None
        assert any("primacy prior" in w for w in out["warnings"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"from_traffic": True}, "slots"),
        ({"from_traffic": True, "slots": 4, "seed": 3}, "seed"),
        ({"from_traffic": True, "slots": 4, "num_prompts": 3}, "num_prompts"),
        (
            {"from_traffic": True, "slots": 4, "queries": [{"query": "q", "passages": ["a", "b"]}]},
            "queries",
        ),
        ({"slots": 4, "queries": [{"query": "q", "passages": ["a", "b"]}]}, "slots"),
        ({}, "queries"),
        ({"from_traffic": True, "slots": 4, "template": "nope"}, "template"),
        ({"queries": [{"query": "q", "passages": ["a", "b"]}], "template": "nope"}, "template"),
    ],
)
async def test_traffic_options_are_checked(
    tmp_path: Path, body: dict[str, Any], param: str
) -> None:
    async with serving(tmp_path, traffic_sample_rate=0.5) as h:
        r = await h.client.post("/v1/bias-profiles/calibrate", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == param


async def test_from_traffic_with_sampling_off_says_which_setting(served: Harness) -> None:
    body = {"from_traffic": True, "slots": 4}
    r = await served.client.post("/v1/bias-profiles/calibrate", json=body)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "from_traffic" and "RAG_REORDER_TRAFFIC_SAMPLE_RATE" in err["message"]


async def test_replicas_sharing_a_traffic_folder_calibrate_from_each_others_runs(
    tmp_path: Path,
) -> None:
    """Two replicas (two apps) share `traffic_sample_dir`: the one that served the traffic
    is not the one the calibration request lands on."""
    shared = {"traffic_sample_rate": 1.0, "traffic_sample_dir": tmp_path / "traffic"}
    backend = TrackingBackend(TRUTH, bias=recency_bias, noise=0.05)
    async with serving(tmp_path / "a", backend=backend, **shared) as a:
        for k in range(3):
            body = {
                "query": f"{QUERY} {k}",
                "passages": PASSAGES[k:] + PASSAGES[:k],
                "design": {"kind": "pruned_random", "seed": k},
            }
            assert (await a.client.post("/v1/reorder", json=body)).status_code == 200
    async with serving(tmp_path / "b", **shared) as b:  # started after a stopped
        listed = (await b.client.get("/v1/bias-profiles")).json()["traffic_samples"]
        assert [(t["design"], t["slots"], t["runs"]) for t in listed] == [("pruned_random", 2, 3)]
        metrics = (await b.client.get("/metrics")).text
        assert 'rag_reorder_traffic_sample_runs{design="pruned_random"} 0.0' in metrics  # b's own
        traffic = {"from_traffic": True, "design": "pruned_random", "slots": 2}
        r = await b.client.post("/v1/bias-profiles/calibrate", json=traffic)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["queries"] == 3 and out["profile"]["oriented_by"] == "data"
        assert out["profile"]["coefficients"][1] > out["profile"]["coefficients"][0]
