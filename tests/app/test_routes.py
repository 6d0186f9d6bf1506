"""The routes' successful answers, on the fake backend (known utilities and bias)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from service.backends.fakes.fake import primacy_bias
from service.strategies import strategy_names
from tests.app.conftest import (
    BEST_FIRST,
    PASSAGES,
    QUERY,
    TRUTH,
    Harness,
    TrackingBackend,
    reorder_body,
    rerank_body,
    serving,
)

RERANK_PATHS = ["/rerank", "/v1/rerank", "/v2/rerank"]


async def test_reorder_returns_everything_the_fit_knows(served: Harness) -> None:
    passages = [
        {"id": f"doc-{i}", "title": f"T{i}", "text": t, "score": float(10 - i)}
        for i, t in enumerate(PASSAGES[:3])
    ] + [PASSAGES[3]]  # a bare string is a passage too
    r = await served.client.post(
        "/v1/reorder",
        json={"query": QUERY, "passages": passages, "design": {"kind": "pruned_random"}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["order"] == BEST_FIRST and body["ranking"] == BEST_FIRST
    assert body["model"] == "fake/known-truth" and body["id"] == r.headers["x-request-id"]
    assert [p["index"] for p in body["passages"]] == BEST_FIRST
    assert [p["id"] for p in body["passages"]] == [
        f"doc-{i}" if i < 3 else None for i in BEST_FIRST
    ]
    utilities = [p["utility"] for p in body["passages"]]
    assert utilities == sorted(utilities, reverse=True)
    assert body["passages"][-1]["confidence_above_next"] is None
    assert all(p["shown"] for p in body["passages"])
    bias = body["position_bias"]
    assert bias["identified"] and bias["identification"] == "full"
    assert bias["orientation"] == "data" and bias["profile"] is None
    assert sum(bias["coefficients"]) == pytest.approx(1.0)
    diag = body["diagnostics"]
    assert diag["design"] == "pruned_random" and diag["prompts_failed"] == 0
    assert diag["converged"] and diag["slots"] == len(bias["coefficients"])
    assert body["usage"]["prompt_tokens"] > body["usage"]["scored_tokens"] > 0
    assert body["usage"]["prompts_scored"] == diag["prompts"]
    assert set(body["timing"]) == {"tokenize_s", "scoring_s", "solver_s", "total_s", "estimated_s"}
    assert body["timing"]["estimated_s"] > 0  # admission estimated the whole request


async def test_reorder_options_reach_the_pipeline(served: Harness) -> None:
    r = await served.client.post(
        "/v1/reorder",
        json=reorder_body(
            design={"kind": "random", "num_prompts": 10, "seed": 3},
            placement="bias_matched",
            joint=True,
            template="qa_plain",
        ),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["diagnostics"]["design"] == "random"
    assert body["diagnostics"]["prompts"] == 10
    assert body["diagnostics"]["template"] == "qa_plain"
    assert sorted(body["order"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("default", ["bias_matched", "descending_utility"])
async def test_placement_defaults_to_the_server_setting(tmp_path: Path, default: str) -> None:
    """A model whose bias favours the end of the prompt (as SmolLM2's does): `bias_matched`
    puts the best passage last, `descending_utility` first; a request's own choice wins and
    the response names the placement it applied."""
    late = TrackingBackend(TRUTH, bias=lambda n: tuple(reversed(primacy_bias(n))), noise=0.01)
    async with serving(tmp_path, backend=late, placement=default) as h:
        assert (await h.client.get("/info")).json()["default_placement"] == default
        body = (await h.client.post("/v1/reorder", json=reorder_body())).json()
        assert body["ranking"] == BEST_FIRST
        assert body["diagnostics"]["placement"] == default
        expected = BEST_FIRST[::-1] if default == "bias_matched" else BEST_FIRST
        assert body["order"] == expected
        other = "descending_utility" if default == "bias_matched" else "bias_matched"
        body = (await h.client.post("/v1/reorder", json=reorder_body(placement=other))).json()
        assert body["diagnostics"]["placement"] == other
        assert body["order"] == expected[::-1]
        # Other strategies place by their own rule: no placement reported, none accepted.
        body = (await h.client.post("/v1/reorder", json=reorder_body(strategy="inverse"))).json()
        assert body["diagnostics"]["placement"] is None
        r = await h.client.post(
            "/v1/reorder", json=reorder_body(strategy="inverse", placement=default)
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "placement"


async def test_top_n_keeps_the_best_passages_and_scores_all(served: Harness) -> None:
    r = await served.client.post("/v1/reorder", json=reorder_body(top_n=2))
    body = r.json()
    assert body["order"] == BEST_FIRST[:2]
    assert len(body["passages"]) == len(body["ranking"]) == 4
    # bias_matched: the two best passages, in the relative order the placement gives them.
    r = await served.client.post(
        "/v1/reorder", json=reorder_body(top_n=2, placement="bias_matched")
    )
    assert sorted(r.json()["order"]) == sorted(BEST_FIRST[:2])


async def test_single_passage_has_nulls_where_the_fit_knows_nothing(served: Harness) -> None:
    r = await served.client.post("/v1/reorder", json={"query": QUERY, "passages": [PASSAGES[0]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["order"] == [0]
    assert body["passages"][0]["confidence_above_next"] is None
    assert body["position_bias"]["identified"] is False


@pytest.mark.parametrize("path", RERANK_PATHS)
async def test_rerank_speaks_the_cohere_shape(served: Harness, path: str) -> None:
    r = await served.client.post(
        path,
        json=rerank_body(
            model="rerank-english-v3.0",
            top_n=3,
            # Fields other clients send: ignored on the compatible routes.
            rank_fields=["text"],
            truncation=True,
            return_documents=True,
        ),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "model", "usage", "results", "meta"}
    assert body["model"] == "fake/known-truth"
    results = body["results"]
    assert [x["index"] for x in results] == BEST_FIRST[:3]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert results[0]["document"] == {"text": PASSAGES[BEST_FIRST[0]]}
    assert body["usage"]["total_tokens"] == body["meta"]["reorder"]["usage"]["prompt_tokens"]
    meta = body["meta"]["reorder"]
    assert meta["ranking"] == BEST_FIRST and meta["order"] == BEST_FIRST[:3]
    assert meta["position_bias"]["identified"] and "diagnostics" in meta


async def test_rerank_documents_as_objects_without_documents_back(served: Harness) -> None:
    r = await served.client.post(
        "/v1/rerank",
        json={
            "query": QUERY,
            "documents": [{"text": t, "meta": {"source": "x"}} for t in PASSAGES],
            "top_n": 0,  # 0 means all, as in Cohere and Jina
            "return_documents": False,
            "reorder": {"design": {"kind": "random"}, "placement": "bias_matched"},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["results"]) == 4
    assert all(x["document"] is None for x in body["results"])
    assert body["meta"]["reorder"]["diagnostics"]["design"] == "random"


async def test_rerank_scores_are_a_monotone_map_of_utility(served: Harness) -> None:
    body = (await served.client.post("/v1/rerank", json=rerank_body())).json()
    utility = {p["index"]: p["utility"] for p in body["meta"]["reorder"]["passages"]}
    pairs = sorted((utility[x["index"]], x["relevance_score"]) for x in body["results"])
    assert [s for _, s in pairs] == sorted(s for _, s in pairs)


async def test_request_id_is_accepted_echoed_and_reaches_the_engine(served: Harness) -> None:
    r = await served.client.post(
        "/v1/reorder", json=reorder_body(), headers={"X-Request-Id": "client-abc.123"}
    )
    assert r.headers["x-request-id"] == "client-abc.123" and r.json()["id"] == "client-abc.123"
    assert any(rid.startswith("client-abc.123-") for rid in served.backend.request_ids)
    # A header that could forge log lines is replaced, not echoed.
    r = await served.client.get("/v1/models", headers={"X-Request-Id": "bad id\twith tab"})
    assert r.headers["x-request-id"].startswith("req-")


async def test_models_and_info(served: Harness) -> None:
    models = (await served.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake/known-truth"
    assert models["data"][0]["max_model_len"] == 32768
    info = (await served.client.get("/info")).json()
    assert info["ready"] and info["strategies"] == list(strategy_names()) and not info["auth"]
    assert info["limits"]["max_passages"] == 100 and "qa_default" in info["templates"]
    assert info["limits"]["max_calibration_queries"] == 256
    assert info["limits"]["traffic_sample_rate"] == 0.0


async def test_metrics_cover_requests_work_and_the_default_registry(served: Harness) -> None:
    await served.client.post("/v1/reorder", json=reorder_body())
    await served.client.post("/v1/reorder", json={"query": QUERY})  # a 422
    r = await served.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        'rag_reorder_http_requests_total{route="/v1/reorder",status="200"} 1.0',
        "rag_reorder_http_request_duration_seconds_bucket",
        "rag_reorder_request_prompts_bucket",
        "rag_reorder_request_prompt_tokens_bucket",
        "rag_reorder_solver_duration_seconds_bucket",
        "rag_reorder_prompt_tokens_total",
        "rag_reorder_scored_tokens_total",
        'rag_reorder_request_failures_total{code="validation_error",type="invalid_request_error"}',
        "rag_reorder_requests_in_flight 0.0",
        "rag_reorder_build_info{",
        "rag_reorder_ready 1.0",
    ):
        assert name in text, name
    # prometheus_client's default registry (an in-process vLLM engine's metrics live there).
    assert "python_gc_objects_collected_total" in text or "process_" in text
    assert text.count("# TYPE rag_reorder_requests_in_flight") == 1


async def test_no_cors_headers_unless_configured(served: Harness, tmp_path: Path) -> None:
    origin = {"Origin": "https://app.example"}
    r = await served.client.get("/v1/models", headers=origin)
    assert "access-control-allow-origin" not in r.headers
    async with serving(tmp_path, cors_origins=("https://app.example",)) as h:
        r = await h.client.options(
            "/v1/reorder",
            headers={**origin, "Access-Control-Request-Method": "POST"},
        )
        assert r.headers["access-control-allow-origin"] == "https://app.example"


async def test_no_query_or_passage_text_in_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret_query = "what is the launch code zebra-42?"
    backend = TrackingBackend(
        TRUTH, fail_rule=lambda p: p.request_id.startswith("req-") and p.request_id.endswith("-1")
    )
    caplog.set_level(logging.DEBUG)
    async with serving(tmp_path, backend=backend) as h:
        r = await h.client.post("/v1/reorder", json={"query": secret_query, "passages": PASSAGES})
        assert r.status_code == 200 and r.json()["diagnostics"]["prompts_failed"] == 1
        await h.client.post("/v1/reorder", json={"query": secret_query, "passages": ["x" * 10**6]})
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "zebra-42" not in logged
    assert not any(t in logged for t in TRUTH)
    assert "request " in logged  # the per-request summary line is there, without the text


async def test_adaptive_design_reports_how_it_ran(served: Harness) -> None:
    r = await served.client.post(
        "/v1/reorder", json=reorder_body(design={"kind": "adaptive", "stop_confidence": 0.8})
    )
    assert r.status_code == 200, r.text
    diag = r.json()["diagnostics"]
    # Four passages are too few to adapt: the default design in one round, said so.
    assert diag["design"] == "adaptive" and diag["prompts"] == 8
    assert diag["adaptive"] == {
        "rounds": 1,
        "prompts": 8,
        "max_prompts": 8,
        "stopped": "small_request",
        "confidence": pytest.approx(diag["adaptive"]["confidence"]),
        "target": 0.8,
        "bias": "fitted",
        "bias_profile": None,
        "bias_basis": None,
    }
    plain = await served.client.post("/v1/reorder", json=reorder_body())
    assert plain.json()["diagnostics"]["adaptive"] is None


@pytest.mark.parametrize(
    ("design", "field"),
    [
        ({"kind": "adaptive", "stop_confidence": 1.0}, "stop_confidence"),
        ({"kind": "adaptive", "stop_confidence": 0.2}, "stop_confidence"),
        ({"kind": "pruned_random", "stop_confidence": 0.9}, "stop_confidence"),
        ({"kind": "adaptive", "num_prompts": 99}, "num_prompts"),
    ],
)
async def test_adaptive_options_out_of_range_are_422(
    served: Harness, design: dict[str, object], field: str
) -> None:
    r = await served.client.post("/v1/reorder", json=reorder_body(design=design))
    assert r.status_code == 422, r.text
    assert field in r.text
