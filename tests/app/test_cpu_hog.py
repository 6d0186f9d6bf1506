"""Faults injected, not assumed (issue 70): the real server on SmolLM2, started while busy
processes hold both CPUs (a noisy neighbour, a throttled quota), takes the README's requests
and a stream of 10-passage requests, then the busy processes stop. Nothing is refused 422 at
any point, and once they are gone every request is answered 200 within a minute.

Before issue 70 the first request's slow measurement refused every 10-passage request with
422 ``deadline_unreachable`` for good (17 in a row in the issue), and a cold ``auto`` made its
callers wait 20-100 s on MoI while it learned.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.processes import server_process
from tests.support.models import cache_dir_for_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# Ten real NQ-Open passages, about 100 words each (tests/data/litm_sample.jsonl: five of the
# first question, five of the second), and the first question.
_SAMPLES = [json.loads(line) for line in (ROOT / "tests/data/litm_sample.jsonl").open()][:2]
QUESTION = _SAMPLES[0]["question"]
PASSAGES = [c["text"] for s in _SAMPLES for c in s["ctxs"]][:10]


@contextmanager
def cpu_hog(processes: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``processes`` busy loops at normal priority, stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield procs
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, float, Any]:
    t = time.perf_counter()
    r = client.post(path, json=body)
    return r.status_code, time.perf_counter() - t, r.json()


def ten(k: int, scores: bool = False) -> dict[str, Any]:
    shift = k % len(PASSAGES)
    texts = PASSAGES[shift:] + PASSAGES[:shift]
    passages: list[Any] = (
        [{"text": t, "score": float(len(texts) - i)} for i, t in enumerate(texts)]
        if scores
        else texts
    )
    return {"query": QUESTION, "passages": passages}


def test_a_busy_neighbour_at_start_leaves_no_lasting_refusal(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    env = {
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles"),
        "RAG_REORDER_OPEN_WRITES": "true",
        "HF_HUB_OFFLINE": "1",
        # The rates measured under the hog, then re-measured once it is gone: this test's
        # subject (tests/app/processes.py starts servers without the rate canary).
        "RAG_REORDER_RATE_CANARY": "true",
    }
    args = ["-m", "entrypoints", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    seen: list[tuple[str, int, float, str | None]] = []
    with cpu_hog(3) as hog, server_process(args, tmp_path / "server.log", env) as server:
        server.wait_ready(300)
        with httpx.Client(base_url=server.base_url, timeout=180) as client:
            # The README's first calls, under the hog.
            status, s, body = post(
                client,
                "/v1/reorder",
                {"query": "who wrote the lord of the rings",
                 "passages": [{"id": "a", "title": "Narnia", "text": "C. S. Lewis wrote the "
                               "Chronicles of Narnia."},
                              {"id": "b", "text": "The Lord of the Rings is by J. R. R. Tolkien.",
                               "score": 12.3},
                              "The Hobbit was published in 1937."]},
            )  # fmt: skip
            seen.append(("readme", status, s, None))
            assert status == 200, body
            # A stream of 10-passage requests, the default strategy, with and without the
            # retriever's scores: a cold auto answers them at once and learns meanwhile.
            for k in range(6):
                status, s, body = post(client, "/v1/reorder", ten(k, scores=k % 2 == 1))
                path = body.get("auto", {}).get("path") if status == 200 else None
                seen.append(("hog", status, s, path))
                assert status == 200, body
                assert path == "cold", body["auto"]
                assert s < 20, (s, body["auto"])
            stop(hog)
            # The neighbour is gone: every request, the default and MoI by name, within a
            # minute; none refused.
            for k in range(6, 10):
                status, s, body = post(client, "/v1/reorder", ten(k, scores=k % 2 == 1))
                path = body.get("auto", {}).get("path") if status == 200 else None
                seen.append(("after", status, s, path))
                assert status == 200 and s < 60, (status, s, body)
            # MoI by name, its default design: over its deadline by the rates measured under
            # the hog and not yet confirmed, it is admitted on the idle engine and re-measures.
            status, s, body = post(client, "/v1/reorder", {**ten(11), "strategy": "moi"})
            seen.append(("after-moi", status, s, "moi"))
            assert status == 200 and s < 60, (status, s, body)
            info = client.get("/info").json()
            metrics = client.get("/metrics").text
    print(json.dumps({"requests": seen, "capacity": info["capacity"], "cpus": info["cpus"],
                      "background": info["auto"]["background"]}, indent=1))  # fmt: skip
    assert not [r for r in seen if r[1] == 422], seen
    # The rate canary ran at start, under the hog: measured, or over its deadline there (CI,
    # 2026-12-07: three busy loops on two cores held it past canary_timeout_s) and asked again
    # once the engine is idle. Either way it was counted, and refused nothing (below).
    started = [
        line
        for line in metrics.splitlines()
        if line.startswith("rag_reorder_rate_probes_total{") and 'reason="start"' in line
    ]
    assert sum(float(line.split()[-1]) for line in started) >= 1, (started, server.log()[-4000:])
    assert info["capacity"]["calls"] >= 1 and info["capacity"]["prefill_tokens_per_s"] > 0
    assert info["cpus"]["cpus"] >= 1 and info["cpus"]["torch_threads"] >= 1
    assert "rag_reorder_engine_rate_calls" in metrics
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith('rag_reorder_admission_rejections_total{reason="unreachable"}')
    ]
    assert all(float(line.split()[-1]) == 0 for line in refused), refused
