"""Calibrated position-bias profiles on disk, one per (model, template, slot count).

A profile is what makes cyclic designs usable (METHOD.md 3.1, 3.3): they cannot identify the
bias, so they take it from here. Files are small JSON documents written atomically.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from service.errors import InvalidRequest

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class StoredProfile:
    """A calibrated profile and where it came from."""

    model: str
    template: str
    slots: int
    coefficients: tuple[float, ...]
    identification: str
    runs: int
    prompts: int
    r2: float
    source: str
    created_at: float


class ProfileStore:
    """Profiles as ``<root>/<model>__<template>__L<slots>.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, model: str, template: str, slots: int) -> Path:
        name = f"{_SAFE.sub('_', model)}__{_SAFE.sub('_', template)}__L{slots}.json"
        return self.root / name

    def get(self, model: str, template: str, slots: int) -> StoredProfile | None:
        """The profile for this key, or ``None`` when none was calibrated."""
        p = self.path(model, template, slots)
        if not p.is_file():
            return None
        data = json.loads(p.read_text())
        data["coefficients"] = tuple(float(c) for c in data["coefficients"])
        return StoredProfile(**data)

    def put(
        self,
        *,
        model: str,
        template: str,
        coefficients: Sequence[float],
        identification: str,
        runs: int,
        prompts: int,
        r2: float,
        source: str,
    ) -> StoredProfile:
        """Store a profile (atomic replace). Raises ``InvalidRequest`` for a bad profile."""
        coef = tuple(float(c) for c in coefficients)
        if not coef or any(c < 0 for c in coef) or abs(sum(coef) - 1.0) > 1e-6:
            raise InvalidRequest("a bias profile needs non-negative coefficients summing to 1")
        prof = StoredProfile(
            model, template, len(coef), coef, identification, runs, prompts, r2, source, time.time()
        )
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(prof), fh, indent=1)
        os.replace(tmp, self.path(model, template, len(coef)))
        return prof

    def list(self) -> list[StoredProfile]:
        """Every stored profile, sorted by model, template and slot count."""
        if not self.root.is_dir():
            return []
        out = []
        for p in sorted(self.root.glob("*.json")):
            data = json.loads(p.read_text())
            data["coefficients"] = tuple(float(c) for c in data["coefficients"])
            out.append(StoredProfile(**data))
        return sorted(out, key=lambda s: (s.model, s.template, s.slots))
