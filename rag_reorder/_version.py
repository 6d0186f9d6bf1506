"""The installed distribution's version (the client and the server ship in one)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("rag-reorder")
    except PackageNotFoundError:  # imported from a checkout that was not pip-installed
        return "0+unknown"


__version__ = _version()
