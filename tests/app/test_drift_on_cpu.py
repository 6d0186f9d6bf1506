"""Drift watching that runs on a CPU (issue 70): the real server on SmolLM2 holds a trusted
profile that no longer describes its model (as after a generator or template change: here
the reverse of what SmolLM2 does), serves every request by it, and its explore runs, sized
to what the engine can run rather than drawn and dropped, detect the change within a stated
number of requests.

Before issue 70, on this CPU 10 of 11 explore runs were dropped (issue 53's note): a CPU
deployment never tested its profile.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from service.state.profile_store import ProfileStore, ProfileTrust
from solver.trust import TrustRules
from tests.app.processes import server_process
from tests.support.models import cache_dir_for_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Six short passages: the learning design (L = 3, 12 prompts) is a few seconds on this CPU.
FACTS = [
    "Paris is the capital of France.",
    "The Seine flows through Paris.",
    "Berlin is the capital of Germany.",
    "The Spree flows through Berlin.",
    "Madrid is the capital of Spain.",
    "Rome is the capital of Italy.",
]
MAX_REQUESTS = 16
"""The stated bound: drift_min_runs (8) explore runs, each drawn while the engine is free."""


def stale_profile(folder: Path) -> None:
    """A trusted profile for L = 3 that weighs the middle slot most. SmolLM2's scores weigh
    the two ends (its calibrated L = 5 profile: 0.211, 0.197, 0.181, 0.203, 0.207), so this is
    what the stored profile of another generator, or another template, looks like to it: its
    top placement slots are the middle ones, SmolLM2's an end."""
    trust = ProfileTrust(
        verdict="shaped", reason="stored before the change", runs=20, flat_p=1e-6, spread=0.5,
        spread_upper=0.6, stability=1.0, top_slots=(2, 3), placement_slots=6, resamples=200,
        covariance=((1e-4, 0.0, 0.0), (0.0, 1e-4, 0.0), (0.0, 0.0, 1e-4)),
        assessed_at=time.time() - 60, source="traffic", learning_since=None,
        trusted_since=time.time() - 60,
    )  # fmt: skip
    ProfileStore(folder).put(
        model=MODEL, template="qa_default", coefficients=[0.15, 0.7, 0.15], identification="full",
        runs=20, prompts=480, r2=0.9, source="learned by auto from 20 live MoI run(s)",
        oriented_by="data", trust=trust,
    )  # fmt: skip


def test_a_changed_generator_is_detected_on_a_cpu(tmp_path: Path, smollm2_dir: Path) -> None:
    profiles = tmp_path / "profiles"
    stale_profile(profiles)
    env = {
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "RAG_REORDER_BIAS_PROFILE_DIR": str(profiles),
        "RAG_REORDER_AUTO_EXPLORE_RATE": "1",
        "RAG_REORDER_AUTO_RECALIBRATE_S": "0.5",
        "HF_HUB_OFFLINE": "1",
    }
    args = ["-m", "entrypoints", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    paths: list[str] = []
    with server_process(args, tmp_path / "server.log", env) as server:
        server.wait_ready(300)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:

            def drifted() -> float:
                for line in client.get("/metrics").text.splitlines():
                    if line.startswith("rag_reorder_auto_drift_events_total"):
                        return float(line.split()[-1])
                return 0.0

            def background() -> dict[str, int]:
                return dict(client.get("/info").json()["auto"]["background"]["explore"])

            for k in range(MAX_REQUESTS):
                passages = FACTS[k % 6 :] + FACTS[: k % 6]
                t = time.perf_counter()
                r = client.post("/v1/reorder", json={"query": "Which river flows through "
                                                     "the capital of France?",
                                                     "passages": passages})  # fmt: skip
                assert r.status_code == 200, r.text
                paths.append(r.json()["auto"]["path"])
                if paths[-1] in ("moi", "cold"):
                    break  # back to learning: the drift was found
                assert time.perf_counter() - t < 10  # served by the profile, never waiting
                # The next request arrives once this one's explore run has had the engine.
                before = sum(background().values())
                deadline = time.monotonic() + 120
                while sum(background().values()) == before and time.monotonic() < deadline:
                    time.sleep(0.5)
                if background().get("recorded", 0) < TrustRules().drift_min_runs:
                    continue  # too few explore runs to test: no drift can be found yet
                deadline = time.monotonic() + 10
                while not drifted() and time.monotonic() < deadline:
                    time.sleep(0.2)  # the background cycle tests drift (recalibrate 0.5 s)
            explore = background()
            events = drifted()
    print({"paths": paths, "explore": explore, "drift_events": events})
    assert events >= 1, (paths, explore, server.log()[-3000:])
    assert paths[-1] in ("moi", "cold"), paths
    assert len(paths) <= MAX_REQUESTS
    assert explore["recorded"] >= 8 and explore["dropped"] == 0
