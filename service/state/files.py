"""Writing the service's state files (bias profiles, positional profiles, the traffic sample's
compaction) so that a reader never sees half of one and any reader can open it.

``tempfile.mkstemp`` creates its file with mode 0600 whatever the umask, and ``os.replace``
keeps that mode: a profile written that way cannot be read by a replica or sidecar running as
another user on a shared volume. The temporary file here is created with ``0o666``, which the
kernel narrows by the process's umask (0644 under the usual 022), like any other file the
process creates; an operator who wants private files sets the umask.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: readers see the old file or the new one.

    The temporary file sits beside it (same file system, so the rename is atomic), named with
    a leading dot and a ``.tmp`` suffix so that no listing of ``*.json`` or ``*.jsonl`` picks
    it up, and is removed if the write fails.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
