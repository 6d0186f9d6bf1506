"""Real server processes shared by the client's tests: each starts once per session.

``fake_service`` serves the fake backend (the app's test passages only) with one request in
flight at a time, so a second concurrent request gets the service's real 503 + Retry-After.
``smollm2_service`` serves the embedded SmolLM2 model on the CPU, as ``make serve`` does (it
converts the packaged model on its first start, into the cache the server's tests share).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import API_KEY, SERVER_PYTHON, ServerProcess, server_process

# The server's tests' model cache (tests/support/models.py: cache_dir_for_tests).
CACHE_DIR = os.environ.get("RAG_REORDER_TEST_CACHE_DIR") or str(
    Path.home() / ".cache" / "rag-reorder"
)


@pytest.fixture(scope="session")
def fake_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fake-service") / "server.log"
    env = {
        "RAG_REORDER_API_KEY": API_KEY,
        "RAG_REORDER_MAX_CONCURRENT_REQUESTS": "1",
        "RAG_REORDER_RETRY_AFTER_S": "1",
    }
    args = ["-m", "tests.app.fake_server", "--port", "{port}", "--delay", "1.5"]
    with server_process(args, log, env, python=SERVER_PYTHON) as server:
        server.wait_ready(60)
        yield server


@pytest.fixture(scope="session")
def smollm2_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("smollm2-service")
    env = {
        "RAG_REORDER_BACKEND": "transformers",
        "RAG_REORDER_DEVICE": "cpu",
        "RAG_REORDER_CACHE_DIR": CACHE_DIR,
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp / "profiles"),
        "HF_HUB_OFFLINE": "1",
        # MoI as the default: the snippets' answers are compared with the same request sent
        # again, and auto (the shipped default) changes path once it trusts a profile.
        "RAG_REORDER_STRATEGY": "moi",
    }
    args = ["-m", "entrypoints", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    with server_process(args, tmp / "server.log", env, python=SERVER_PYTHON) as server:
        # The first start on a fresh machine converts the GGUF (~25 s) before /ready.
        server.wait_ready(300)
        yield server
