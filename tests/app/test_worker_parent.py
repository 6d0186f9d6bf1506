"""The supervisor's children end with it, including one whose supervisor died before the
child armed its parent-death signal (``app.workers._die_with_parent``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from app.workers import _die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def test_a_child_whose_supervisor_is_already_gone_ends_before_it_runs() -> None:
    # The supervisor's pid as passed before the fork, and the child's parent then differ
    # (here: a pid that is not this process): the child exits instead of serving unwatched.
    proc = subprocess.run(
        [sys.executable, "-c", "print('served')"],
        preexec_fn=functools.partial(_die_with_parent, os.getpid() + 10**6),
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert proc.returncode == 1 and proc.stdout == b""


def test_a_child_of_a_live_supervisor_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "print('served')"],
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout == b"served\n"
