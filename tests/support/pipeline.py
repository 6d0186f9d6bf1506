"""A serving pipeline over a given backend, with its cache and profiles under a test folder."""

from __future__ import annotations

from pathlib import Path

from service.backends.base import LogprobBackend
from service.config.settings import Settings
from service.pipeline import Reorderer
from service.state.profile_store import ProfileStore


def reorderer_in(tmp_path: Path, backend: LogprobBackend, **settings: object) -> Reorderer:
    """``Reorderer`` with ``Settings(cache_dir=tmp_path, **settings)`` and profiles in
    ``tmp_path / "profiles"``."""
    s = Settings(cache_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return Reorderer(backend, s, ProfileStore(tmp_path / "profiles"))
