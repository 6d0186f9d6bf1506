"""Runs ``python -m bench.NAME --help`` for many benchmark scripts in one process's forks.

Each script run on its own imports torch, transformers, scipy and the web stack again: 6 to 9 s
of CPU a script, over 200 s for the 33 of them in every `make test`. Here one parent imports
those third-party libraries once, then forks a child per script; the child starts as
``python -m bench.NAME`` would from the checkout's root (``sys.argv``, ``sys.path[0]`` the root,
``__main__``) with none of the project's modules imported, so a broken project import or
option still fails it.
Each child's stdout, stderr and exit code go to ``OUT/<stem>.{out,err,rc}``.

Usage: python tests/bench/help_driver.py OUT SCRIPT [SCRIPT ...]
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

# Third-party only: importing the project here would hide a script's missing import of it.
# Every library the scripts import through the project, not only the obvious ones: with just
# torch, transformers, scipy.optimize and the web stack here, the children still imported
# scipy.stats, peft (sympy), redis and rouge_score (nltk) each, and the whole run took 41.8 s
# against 14.9 s with them (2026-12-07, this machine, /usr/bin/time around this driver).
import anyio  # noqa: F401
import fastapi  # noqa: F401
import httpx  # noqa: F401
import numpy  # noqa: F401
import peft  # noqa: F401
import prometheus_client  # noqa: F401
import pydantic  # noqa: F401
import pydantic_settings  # noqa: F401
import redis  # noqa: F401
import rouge_score.rouge_scorer  # noqa: F401
import safetensors.torch  # noqa: F401
import scipy.linalg
import scipy.optimize
import scipy.stats  # noqa: F401
import starlette.applications  # noqa: F401
import tokenizers  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import uvicorn  # noqa: F401

_TIMEOUT_S = 120.0


def _child(script: Path, out: Path) -> None:
    """In the fork: become ``python -m bench.NAME --help`` and exit with its code."""
    for fd, suffix in ((1, "out"), (2, "err")):
        handle = os.open(out / f"{script.stem}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [str(script), "--help"]
    sys.path[0] = str(script.parents[1])
    code = 0
    try:
        runpy.run_module(f"{script.parent.name}.{script.stem}", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> int:
    out = Path(sys.argv[1])
    root = Path(__file__).resolve().parents[2]
    # As `python -m bench.NAME` from the checkout: the parent's own folder is not on the path.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    os.chdir(root)
    for name in sys.argv[2:]:
        script = Path(name).resolve()
        pid = os.fork()
        if pid == 0:
            _child(script, out)
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                code = 124
                break
            time.sleep(0.01)
        (out / f"{script.stem}.rc").write_text(str(code))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
