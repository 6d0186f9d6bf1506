"""The real servers the client's tests call, and the request they share.

The client's tests run in the client's own virtualenv (``scripts/client-venv.sh``), where the
server is not installed: the servers run under the server's interpreter,
``RAG_REORDER_SERVER_PYTHON`` (the Makefile passes ``.venv/bin/python``), from the repository
root. The helper that starts them is the server's tests' own (``tests/app/processes.py``,
standard library and httpx only), loaded from its file so that the repository root, and with it
the server's packages, stay off this interpreter's path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVER_PYTHON = os.environ.get("RAG_REORDER_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))


def _load_processes() -> object:
    spec = importlib.util.spec_from_file_location(
        "rag_reorder_test_processes", ROOT / "tests" / "app" / "processes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


_processes = _load_processes()
ServerProcess = _processes.ServerProcess  # type: ignore[attr-defined]
server_process = _processes.server_process  # type: ignore[attr-defined]

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

# What `fake_service` knows (tests/app/conftest.py's TRUTH, which the fake server scores by):
# four passages with known utilities, the best first in BEST_FIRST.
FAKE_QUERY = "which passage answers the question?"
FAKE_TRUTH = {
    "The first passage talks about rivers.": -1.0,
    "The second passage is the real answer.": 2.0,
    "The third passage mentions the answer in passing.": 0.8,
    "The fourth passage is about something else.": -0.4,
}
FAKE_PASSAGES = list(FAKE_TRUTH)
BEST_FIRST = sorted(range(len(FAKE_PASSAGES)), key=lambda i: -FAKE_TRUTH[FAKE_PASSAGES[i]])
free_port = _processes.free_port  # type: ignore[attr-defined]
