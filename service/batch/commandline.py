"""What the two command lines share: ``entrypoints.cli`` (serving: serve, reorder, calibrate,
profiles) and ``offline.cli`` (evaluation, distillation, positional and generator profiles).

A pipeline opened on a model for one command, the ``--data`` file read with a clear error,
and the one-line progress counter on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from service.config.settings import Settings
from service.errors import ClientError

if TYPE_CHECKING:
    from service.batch.dataset import Example
    from service.pipeline import Reorderer

TRAINING_DATA = "../shared/data/nq_open_train.jsonl"
"""The training questions beside the checkout, in the commands' examples and defaults: one
place, so the two command lines cannot name two files."""


@asynccontextmanager
async def open_pipeline(settings: Settings) -> AsyncIterator[Reorderer]:
    """The configured backend, loaded off the event loop, in a pipeline; closed on exit."""
    import anyio.to_thread

    from service.backends.engines.remote_backend import RemoteBackend
    from service.backends.factory import create_backend
    from service.pipeline import Reorderer

    backend = await anyio.to_thread.run_sync(lambda: create_backend(settings))
    try:
        if isinstance(backend, RemoteBackend):
            # The server connects in its supervisor; a command scores at once, so it checks
            # the engine (model, tokenizer, context) here and fails with the reason if it
            # cannot: never a score against an engine that was not checked.
            await backend.connect()
        yield Reorderer(backend, settings)
    finally:
        await backend.aclose()


def read_examples(path: Path, limit: int | None) -> list[Example]:
    """``--data`` (JSONL in the shared/data schema), at most ``limit`` questions.

    Raises:
        ClientError: the file cannot be read (``param="data"``).
    """
    from service.batch.dataset import load_examples

    try:
        return list(load_examples(path, limit=limit))
    except OSError as exc:
        raise ClientError(f"cannot read {path}: {exc}", param="data") from None


def progress_line(label: str, unit: str) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback that redraws one progress line on stderr."""

    def progress(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total} {unit}", end="", file=sys.stderr, flush=True)

    return progress
