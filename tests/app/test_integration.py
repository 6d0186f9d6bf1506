"""The real server process with the real SmolLM2 model: start, serve both APIs, drain, exit 0."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import httpx
import pytest

from tests.app.processes import server_process
from tests.support.models import cache_dir_for_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and largest city of France.",
    "The Loire is the longest river in France.",
    "Madrid is the capital of Spain.",
]
# Small design: 8 prompts of 2 passages, a few seconds on a 2-core CPU.
DESIGN = {"kind": "pruned_random", "num_prompts": 8, "seed": 1}


def test_real_server_with_smollm2(tmp_path: Path, smollm2_dir: Path) -> None:
    # smollm2_dir: the one-off GGUF conversion happens here, not inside the /ready budget.
    env = {
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles"),
        "RAG_REORDER_API_KEY": "integration-key",
        "RAG_REORDER_OPEN_WRITES": "true",
        "HF_HUB_OFFLINE": "1",
        # Every live MoI run sampled into a shared folder, as replicas on one volume would.
        "RAG_REORDER_TRAFFIC_SAMPLE_RATE": "1",
        "RAG_REORDER_TRAFFIC_SAMPLE_DIR": str(tmp_path / "traffic"),
    }
    args = ["-m", "entrypoints", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    with server_process(args, tmp_path / "server.log", env) as server:
        server.wait_ready(120)
        auth = {"Authorization": "Bearer integration-key"}
        with httpx.Client(base_url=server.base_url, timeout=120, headers=auth) as client:
            models = client.get("/v1/models").json()
            assert models["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
            assert models["data"][0]["max_model_len"] >= 2048

            r = client.post(
                "/v1/reorder", json={"query": QUERY, "passages": DOCUMENTS, "design": DESIGN}
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert sorted(body["order"]) == [0, 1, 2, 3]
            assert body["diagnostics"]["prompts"] == 8
            assert body["diagnostics"]["prompts_failed"] == 0
            assert body["usage"]["prompt_tokens"] > 8 * 20
            coef = body["position_bias"]["coefficients"]
            assert len(coef) == 2 and sum(coef) == pytest.approx(1.0)
            # The answer-bearing passage should win even for a 135M model.
            assert body["ranking"][0] == 1, body["passages"]

            r = client.post(
                "/v1/rerank",
                json={
                    "model": "any",
                    "query": QUERY,
                    "documents": DOCUMENTS,
                    "top_n": 2,
                    "reorder": {"design": DESIGN},
                },
            )
            assert r.status_code == 200, r.text
            rerank = r.json()
            assert [x["index"] for x in rerank["results"]] == body["ranking"][:2]
            scores = [x["relevance_score"] for x in rerank["results"]]
            assert scores == sorted(scores, reverse=True)
            assert rerank["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]

            # A bias profile calibrated over HTTP on the real model, then used by a cyclic
            # design (refused before it exists).
            cyclic = {"kind": "pruned_cyclic", "prompt_passages": 2}
            refused = client.post(
                "/v1/reorder", json={"query": QUERY, "passages": DOCUMENTS, "design": cyclic}
            )
            assert refused.status_code == 422 and "profile" in refused.json()["error"]["message"]
            queries = [
                {"query": QUERY, "passages": DOCUMENTS},
                {"query": "Which river is the longest in France?", "passages": DOCUMENTS[::-1]},
            ]
            r = client.post(
                "/v1/bias-profiles/calibrate",
                json={"queries": queries, "design": "pruned_random", "prompt_passages": 2},
            )
            assert r.status_code == 200, r.text
            calibrated = r.json()
            assert calibrated["id"] == "HuggingFaceTB_SmolLM2-135M-Instruct__qa_default__L2"
            assert calibrated["profile"]["oriented_by"] == "data"
            assert calibrated["prompts"] == 16 and calibrated["prompts_failed"] == 0
            listed = client.get("/v1/bias-profiles").json()["data"]
            assert [p["id"] for p in listed] == [calibrated["id"]]
            r = client.post(
                "/v1/reorder", json={"query": QUERY, "passages": DOCUMENTS, "design": cyclic}
            )
            assert r.status_code == 200, r.text
            assert r.json()["position_bias"]["profile"] == calibrated["profile"]

            sampled = client.get("/v1/bias-profiles").json()["traffic_samples"]
            # The pruned-random reorder and rerank (2 slots) were kept; the cyclic one not.
            assert [(t["design"], t["slots"]) for t in sampled] == [("pruned_random", 2)]
            assert sampled[0]["runs"] >= 2

            metrics = client.get("/metrics").text
            assert 'rag_reorder_build_info{backend="TransformersBackend"' in metrics
            calibrations = "rag_reorder_bias_profile_calibrations_total"
            assert f'{calibrations}{{design="pruned_random",source="queries"}} 1.0' in metrics
            # The transformers engine's scheduler: every scoring forward observed once.
            forwards = re.search(r"^rag_reorder_batch_fill_ratio_count (\S+)$", metrics, re.M)
            assert forwards is not None and float(forwards.group(1)) > 0
            assert re.search(r"^rag_reorder_batch_queue_prompts 0\.0$", metrics, re.M)
            assert "rag_reorder_batch_wait_seconds_bucket" in metrics
            assert (
                client.get("/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401
            )

        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log()
    log = server.log()
    assert "backend closed" in log
    # Ready without measuring the engine's rates first (tests/app/processes.py: QUIET).
    assert "engine rate measured" not in log
    assert "capital" not in log  # no query or passage text in the logs
    spooled = (tmp_path / "traffic").rglob("*.jsonl")
    assert all("capital" not in f.read_text() for f in spooled)  # numbers only

    # A restarted (or another) replica on the same folder pools what the first one sampled.
    with server_process(args, tmp_path / "server2.log", env) as again:
        again.wait_ready(120)
        with httpx.Client(base_url=again.base_url, timeout=120, headers=auth) as client:
            assert client.get("/v1/bias-profiles").json()["traffic_samples"] == sampled
            r = client.post(
                "/v1/bias-profiles/calibrate",
                json={"from_traffic": True, "design": "pruned_random", "slots": 2},
            )
            assert r.status_code == 200, r.text
            assert r.json()["queries"] == sampled[0]["runs"]

        # Concurrent requests share the engine's forwards (the scheduler) and get the orders
        # each gets alone.
        bodies = [
            {"query": q, "passages": DOCUMENTS[k:] + DOCUMENTS[:k], "design": DESIGN}
            for k, q in enumerate(
                [QUERY, "Which river is the longest in France?", "capital of Spain", "Berlin"]
            )
        ]
        with httpx.Client(base_url=again.base_url, timeout=120, headers=auth) as client:
            alone = [client.post("/v1/reorder", json=b).json() for b in bodies]
            before = _batch_requests(client.get("/metrics").text)

        async def together() -> list[dict[str, object]]:
            async with httpx.AsyncClient(
                base_url=again.base_url, timeout=120, headers=auth
            ) as client:
                rs = await asyncio.gather(*(client.post("/v1/reorder", json=b) for b in bodies))
                return [r.json() for r in rs]

        shared = asyncio.run(together())
        with httpx.Client(base_url=again.base_url, timeout=120, headers=auth) as client:
            after = _batch_requests(client.get("/metrics").text)
        for one, other in zip(alone, shared, strict=True):
            assert other["order"] == one["order"]
            assert other["position_bias"]["coefficients"] == pytest.approx(
                one["position_bias"]["coefficients"], abs=1e-3
            )
        # One request per forward when alone; sent together, some forward carried several.
        forwards, requests = after[0] - before[0], after[1] - before[1]
        assert 0 < forwards < requests


def _batch_requests(metrics: str) -> tuple[float, float]:
    """(forwards, requests summed over forwards) from the scheduler's histogram."""
    count = re.search(r"^rag_reorder_batch_requests_count (\S+)$", metrics, re.M)
    total = re.search(r"^rag_reorder_batch_requests_sum (\S+)$", metrics, re.M)
    assert count is not None and total is not None
    return float(count.group(1)), float(total.group(1))
