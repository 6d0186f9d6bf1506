"""Real server processes shared by the integration tests: each starts once per session.

``fake_service`` serves the fake backend (the app's test passages only) with one request in
flight at a time, so a second concurrent request gets the service's real 503 + Retry-After.
``smollm2_service`` serves the embedded SmolLM2 model on the CPU, as ``make serve`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.processes import ServerProcess, server_process
from tests.support.models import cache_dir_for_tests

API_KEY = "integrations-key"
# A question and four passages SmolLM2 ranks sensibly (tests/app/test_integration.py), and a
# design small enough for about a second per request on a 2-core CPU. With this seed the fit
# finds a recency bias, so `bias_matched` reverses the ranking: a test cannot mistake one
# order for the other.
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and largest city of France.",
    "The Loire is the longest river in France.",
    "Madrid is the capital of Spain.",
]
DESIGN = {"kind": "pruned_random", "num_prompts": 8, "seed": 2}


@pytest.fixture(scope="session")
def fake_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fake-service") / "server.log"
    env = {
        "RAG_REORDER_API_KEY": API_KEY,
        "RAG_REORDER_MAX_CONCURRENT_REQUESTS": "1",
        "RAG_REORDER_RETRY_AFTER_S": "1",
    }
    args = ["-m", "tests.app.fake_server", "--port", "{port}", "--delay", "1.5"]
    with server_process(args, log, env) as server:
        server.wait_ready(60)
        yield server


@pytest.fixture(scope="session")
def smollm2_service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[ServerProcess]:
    # smollm2_dir: the one-off model conversion happens there, not inside the /ready budget.
    tmp = tmp_path_factory.mktemp("smollm2-service")
    env = {
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_CACHE_DIR": str(cache_dir_for_tests()),
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp / "profiles"),
        "HF_HUB_OFFLINE": "1",
    }
    args = ["-m", "app", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    with server_process(args, tmp / "server.log", env) as server:
        server.wait_ready(120)
        yield server
