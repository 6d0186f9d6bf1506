"""The client's version: the file ``VERSION`` beside this module, the one source of truth of
both distributions (``rag-reorder-client`` and the server, ``rag-reorder``, read it at build
time), so an installed wheel and a checkout agree without asking package metadata."""

from __future__ import annotations

from importlib.resources import files

__version__ = files("rag_reorder").joinpath("VERSION").read_text(encoding="utf-8").strip()
