"""The remote backend's SGLang dialect against a server that answers as SGLang's does.

SGLang does not run on this CPU (docs/remote-engine.md#sglang), so one process of
``tests/support/sglang_server.py`` (FastAPI/uvicorn, SGLang's ``/generate`` request and
answer, true log-probs of the tiny random Llama by transformers) serves the module:

- the server first meets SGLang's own test expectations (``test/srt/test_srt_endpoint.py``:
  the rows' count against ``prompt_tokens``, their texts, ``max_new_tokens: 0``), so what
  the dialect is tested against is SGLang's wire format, not one made up here;
- equality: prompts a reorder plans, scored through the dialect and by the in-process
  transformers backend on the same weights, and greedy generations of both;
- the guards: rows placed by their token ids (SGLang releases without the null first row
  score the same), rows missing at the front (cache hits) or the end, or naming another
  token, fail the prompt, never a wrong score;
- the fault matrix of the vLLM engine (``test_remote_vllm.py``) through ``FaultProxy``
  against a real rag-reorder server process: the engine dead at start, a cut connection, a
  stalled engine, a short answer, a row whose token disagrees, and recovery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.backends.base import (
    Generation,
    GenerationRequest,
    PromptFailure,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.engines import sglang_dialect
from service.backends.engines.remote_backend import RemoteBackend
from service.backends.engines.transformers_backend import TransformersBackend
from service.config.settings import Settings
from service.errors import EngineMismatch, EngineTimeout, EngineUnavailable
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest
from tests.app.processes import free_port, server_process, wait_until_up
from tests.support.fault_proxy import FaultProxy
from tests.support.models import cache_dir_for_tests

pytestmark = pytest.mark.slow

# Both sides float32 on the same CPU and weights: 2.9e-6 nats apart at most, measured on the
# prompts of the reorder below (8 prompts, 48 span tokens).
TOLERANCE = 1e-4
SERVED = "tiny-sglang"
QUERY = "Which river flows through Vienna?"
PASSAGES = [
    "The Danube flows through Vienna, Bratislava and Budapest.",
    "The Rhine rises in the Swiss Alps.",
    "Vienna is the capital of Austria.",
    "The Seine flows through Paris.",
]


@pytest.fixture(scope="module")
def sglang(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The test server's URL (one process for the module)."""
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    args = ["-m", "tests.support.sglang_server", "--model", str(tiny_model_dir)]
    args += ["--port", "{port}", "--served-model-name", SERVED]
    with server_process(args, log, {"HF_HUB_OFFLINE": "1"}) as proc:
        wait_until_up(proc.proc, f"{proc.base_url}/health", log, ready_s=180, poll_s=0.2)
        yield proc.base_url


def quirk(url: str, name: str) -> None:
    r = httpx.post(f"{url}/_test/quirk", json={"quirk": name}, timeout=10)
    assert r.json() == {"quirk": name}


def remote(url: str, model_dir: Path, **extra: Any) -> RemoteBackend:
    settings = Settings(
        backend="remote",
        engine_url=url,
        engine_dialect="sglang",
        model=str(model_dir),
        cache_dir=cache_dir_for_tests(),
        engine_retries=0,
        **extra,
    )
    return RemoteBackend.from_settings(settings)


def test_the_server_meets_sglangs_own_test_expectations(sglang: str) -> None:
    # test_logprob_start_len: prompt_tokens == logprob_start_len + len(rows), the rows' texts
    # end the prompt; test_logprob_match: input_ids scored with max_new_tokens 0.
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    body = {
        "text": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 4,
    }
    answer = httpx.post(f"{sglang}/generate", json=body, timeout=60).json()
    assert isinstance(answer, list) and len(answer) == 2
    for text, item in zip(prompts, answer, strict=True):
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == 4 + len(meta["input_token_logprobs"])
        assert text.endswith("".join(row[-1] for row in meta["input_token_logprobs"]))
        assert meta["input_token_logprobs"][0][0] is None  # the row at the start has no value
        assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) == 4
        assert item["text"] == "".join(row[-1] for row in meta["output_token_logprobs"])
    ids = [row[1] for row in answer[0]["meta_info"]["input_token_logprobs"]]
    single = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0}
    single["sampling_params"] = {"max_new_tokens": 0}
    one = httpx.post(f"{sglang}/generate", json=single, timeout=60).json()
    assert isinstance(one, dict) and one["meta_info"]["completion_tokens"] == 0
    assert [row[1] for row in one["meta_info"]["input_token_logprobs"]] == ids
    # Older releases (test_srt_endpoint.py at 2fce449b): prompt_tokens == start + 1 + len(rows).
    quirk(sglang, "legacy")
    try:
        old = httpx.post(f"{sglang}/generate", json=body, timeout=60).json()
    finally:
        quirk(sglang, "none")
    meta = old[0]["meta_info"]
    assert meta["prompt_tokens"] == 4 + 1 + len(meta["input_token_logprobs"])
    bad = {**single, "sampling_params": {"max_new_tokens": -1}}
    r = httpx.post(f"{sglang}/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "max_new_tokens" in r.json()["message"]


async def test_scores_and_generations_equal_the_transformers_backend(
    sglang: str, tiny_model_dir: Path
) -> None:
    backend = remote(sglang, tiny_model_dir)
    await backend.connect()
    assert backend.connected and backend.max_model_len == 2048
    local = TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")
    captured: list[SpanRequest] = []

    class Recorder:
        model_id = "tiny"
        max_model_len = local.max_model_len
        tokenizer = local.tokenizer

        async def score(self, requests: Any) -> Any:
            captured.extend(requests)
            return await local.score(requests)

        async def generate(self, requests: Any) -> Any:
            return await local.generate(requests)

        async def aclose(self) -> None:
            return None

    settings = Settings(cache_dir=cache_dir_for_tests())
    request = ReorderRequest(QUERY, [Passage(text=p) for p in PASSAGES])
    local_result = await Reorderer(Recorder(), settings).reorder(request)  # type: ignore[arg-type]
    assert len(captured) >= 8
    theirs = await backend.score(captured)
    ours = await local.score(captured)
    worst = 0.0
    for a, b in zip(theirs, ours, strict=True):
        assert isinstance(a, SpanLogprobs) and isinstance(b, SpanLogprobs), (a, b)
        worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    assert worst <= TOLERANCE, worst
    remote_result = await Reorderer(backend, settings).reorder(request)
    assert remote_result.order == local_result.order
    # Greedy generations, one with score ids (scored as one more prompt).
    prompt = tuple(captured[0].token_ids[: captured[0].span_start])
    gens = [
        GenerationRequest("g1", prompt, 6, frozenset()),
        GenerationRequest("g2", prompt[:-3], 4, frozenset(), score_ids=prompt[-3:]),
    ]
    for a, b in zip(await backend.generate(gens), await local.generate(gens), strict=True):
        assert isinstance(a, Generation) and isinstance(b, Generation), (a, b)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOLERANCE
        assert (a.score_logprobs is None) == (b.score_logprobs is None)
        if a.score_logprobs is not None and b.score_logprobs is not None:
            pairs = zip(a.score_logprobs, b.score_logprobs, strict=True)
            assert max(abs(x - y) for x, y in pairs) <= TOLERANCE
    await backend.aclose()
    await local.aclose()


async def test_rows_are_placed_by_token_id_and_answers_short_of_the_span_fail(
    sglang: str, tiny_model_dir: Path
) -> None:
    backend = remote(sglang, tiny_model_dir)
    await backend.connect()
    ids = tuple(backend.tokenizer.encode(f"{QUERY} {PASSAGES[0]}").ids)
    reqs = [SpanRequest("a", ids, 3, len(ids)), SpanRequest("b", ids, 1, len(ids) - 2)]
    exact = await backend.score(reqs)
    assert all(isinstance(r, SpanLogprobs) for r in exact)
    reasons: dict[str, list[str]] = {}
    try:
        for name in ("legacy", "cache_partial", "short", "wrong_token"):
            quirk(sglang, name)
            results = await backend.score(reqs)
            if name == "legacy":  # one row fewer, placed by its ids: the same scores
                assert results == exact
                continue
            assert all(isinstance(r, PromptFailure) for r in results), (name, results)
            reasons[name] = [r.reason for r in results if isinstance(r, PromptFailure)]
    finally:
        quirk(sglang, "none")
    assert all("do not cover the span" in r for r in reasons["cache_partial"])
    assert all("do not cover the span" in r for r in reasons["short"])
    assert all("do not match the prompt's tokens" in r for r in reasons["wrong_token"])
    assert await backend.score(reqs) == exact
    # A server scoring other tokens for the probe text: a tokenizer mismatch, proven.
    quirk(sglang, "wrong_token")
    try:
        with pytest.raises(EngineMismatch, match="tokenizer"):
            await backend.connect()
    finally:
        quirk(sglang, "none")
    assert not backend.connected
    # Rows for part of the probe (a cache hit): retried later, never fatal; the old layout
    # connects.
    quirk(sglang, "cache_partial")
    try:
        with pytest.raises(EngineUnavailable, match="part of the probe"):
            await backend.connect()
    finally:
        quirk(sglang, "legacy")
    try:
        await backend.connect()
    finally:
        quirk(sglang, "none")
    assert backend.connected and await backend.score(reqs) == exact
    with pytest.raises(EngineMismatch, match="someone/else"):
        await remote(sglang, tiny_model_dir, engine_model="someone/else").connect()
    await backend.aclose()


async def test_a_dead_stalled_or_cut_engine_raises_and_the_backend_recovers(
    sglang: str, tiny_model_dir: Path
) -> None:
    proxy = FaultProxy(int(sglang.rsplit(":", 1)[1]), free_port())
    backend = remote(f"http://127.0.0.1:{proxy.port}", tiny_model_dir, engine_timeout_s=3)
    ids = tuple(backend.tokenizer.encode(f"{QUERY} {PASSAGES[1]}").ids)
    reqs = [SpanRequest(f"r{i}", ids, 2 + i, len(ids)) for i in range(3)]
    try:
        with pytest.raises(EngineUnavailable):  # dead: connection refused
            await backend.connect()
        with pytest.raises(EngineUnavailable):
            await backend.score(reqs)
        proxy.set("pass")
        await backend.connect()
        assert all(isinstance(r, SpanLogprobs) for r in await backend.score(reqs))
        proxy.set("stall")
        with pytest.raises(EngineTimeout):
            await backend.score(reqs)
        proxy.set("cut")
        with pytest.raises(EngineUnavailable, match="not retried"):
            await backend.score(reqs)
        proxy.set("html")
        with pytest.raises(EngineUnavailable, match="not a JSON array"):
            await backend.score(reqs)
        proxy.set("unauthorized")
        with pytest.raises(EngineUnavailable, match="ENGINE_API_KEY"):
            await backend.score(reqs)
        proxy.set("pass")
        await backend.connect()
        assert all(isinstance(r, SpanLogprobs) for r in await backend.score(reqs))
    finally:
        await backend.aclose()
        proxy.close()


def test_the_service_on_sglang_answers_faults_as_documented_and_recovers(
    sglang: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    proxy = FaultProxy(int(sglang.rsplit(":", 1)[1]), free_port())
    env = {
        "RAG_REORDER_BACKEND": "remote",
        "RAG_REORDER_ENGINE_DIALECT": "sglang",
        "RAG_REORDER_ENGINE_URL": f"http://127.0.0.1:{proxy.port}",
        "RAG_REORDER_MODEL": str(tiny_model_dir),
        "RAG_REORDER_ENGINE_TIMEOUT_S": "5",
        "RAG_REORDER_ENGINE_RETRIES": "1",
        "RAG_REORDER_CANARY_INTERVAL_S": "1",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "HF_HUB_OFFLINE": "1",
    }
    body = {"query": QUERY, "passages": PASSAGES, "strategy": "moi"}
    statuses: list[int] = []

    def post(base: str) -> httpx.Response:
        r = httpx.post(f"{base}/v1/reorder", json=body, timeout=60)
        statuses.append(r.status_code)
        return r

    def wait_for(base: str, check: Any, what: str, log: Any) -> None:
        deadline = time.monotonic() + 60
        while not check(httpx.get(f"{base}/ready", timeout=5)):
            assert time.monotonic() < deadline, f"{what}\n{log()}"
            time.sleep(0.2)

    try:
        with server_process(
            ["-m", "entrypoints", "serve", "--port", "{port}"], tmp_path / "rr.log", env
        ) as rr:
            # 1. The engine is dead at start: alive, not ready with the reason, 503 at once.
            wait_until_up(rr.proc, f"{rr.base_url}/health", rr.log_path, ready_s=120, poll_s=0.2)
            wait_for(
                rr.base_url,
                lambda r: (
                    r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
                ),
                "never engine_unavailable",
                rr.log,
            )
            r = post(rr.base_url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            # 2. Stalled: 504 engine_timeout, not a hang.
            proxy.set("stall")
            r = post(rr.base_url)
            assert r.status_code == 504 and r.json()["error"]["code"] == "engine_timeout", r.text
            proxy.set("pass")
            rr.wait_ready(60)
            # 3. Cut mid-request: 503 engine_unavailable; ready again once the engine is back.
            with httpx.Client(timeout=60) as client:
                pending = asyncio.run(_post_while_cut(client, rr.base_url, body, proxy))
            statuses.append(pending.status_code)
            assert pending.status_code == 503, pending.text
            assert pending.json()["error"]["code"] == "engine_unavailable"
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            # 4. Short answers and rows naming other tokens: every prompt refused, never
            # scored, so nothing identifies a fit: 502 scoring_failed, as for any engine
            # whose answers cannot be used.
            for name in ("short", "wrong_token"):
                quirk(sglang, name)
                try:
                    r = post(rr.base_url)
                finally:
                    quirk(sglang, "none")
                assert r.status_code == 502, (name, r.text)
                assert r.json()["error"]["code"] == "scoring_failed", (name, r.text)
                assert "prompts failed" in r.json()["error"]["message"]
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            assert f"serves '{SERVED}'" in rr.log()
        assert set(statuses) <= {200, 502, 503, 504}, statuses
    finally:
        proxy.close()


async def _post_while_cut(
    client: httpx.Client, base: str, body: dict[str, Any], proxy: FaultProxy
) -> httpx.Response:
    """Send a request, and cut the engine's connections while it is being scored. The engine
    stalls first, so the request is surely in flight at the cut: on a quiet machine the fake
    engine scored the whole request within the 0.3 s before it (200, CI 2026-12-07)."""
    proxy.set("stall")
    loop = asyncio.get_running_loop()
    pending = loop.run_in_executor(
        None, lambda: client.post(f"{base}/v1/reorder", json=body, timeout=60)
    )
    await asyncio.sleep(0.3)
    proxy.set("cut")
    await asyncio.sleep(0.2)
    proxy.set("down")
    return await pending


def test_the_dialect_is_validated() -> None:
    with pytest.raises(ValueError, match="engine_dialect"):
        Settings(backend="remote", engine_url="http://e:1", engine_dialect="tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="RAG_REORDER_ENGINE_DIALECT is 'sglang'"):
        Settings(backend="transformers", engine_dialect="sglang")
    assert Settings(backend="remote", engine_url="http://e:1").engine_dialect == "vllm"


def test_rows_that_fit_the_prompt_at_two_places_are_refused() -> None:
    # Three rows of one repeated token on four: as asked (from 0) or one later (without the
    # null row) both match by id, and would score different positions: refused.
    req = SpanRequest("p", (5, 5, 5, 5), 1, 4)
    rows = [[None, 5, None], [-1.0, 5, None], [-2.0, 5, None]]
    result = sglang_dialect.span_from_item(req, {"meta_info": {"input_token_logprobs": rows}})
    assert isinstance(result, PromptFailure) and "2 places" in result.reason
    # Distinct tokens place at once: the same rows with a null at the start cover the span.
    req = SpanRequest("q", (7, 8, 9, 10), 1, 4)
    rows = [[None, 7, None], [-1.0, 8, None], [-2.0, 9, None], [-0.5, 10, None]]
    result = sglang_dialect.span_from_item(req, {"meta_info": {"input_token_logprobs": rows}})
    assert result == SpanLogprobs("q", (-1.0, -2.0, -0.5))
