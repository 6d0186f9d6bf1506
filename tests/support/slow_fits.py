"""Assessments slowed down, for tests that need one in flight: module-level, so the learner's
background worker (another process, ``service.runtime.background``) can unpickle them."""

from __future__ import annotations

import time
from typing import Any

from solver import trust as trust_rules


def slow_assess(*args: Any, **kw: Any) -> trust_rules.Trust:
    """``solver.trust.assess`` one second late."""
    time.sleep(1.0)
    return trust_rules.assess(*args, **kw)
