"""What every benchmark writes beside its figures: the command that measured them and where."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """The exact command (this script and its arguments) and the machine it ran on."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = script.relative_to(Path(__file__).resolve().parents[1])
    except ValueError:
        shown = script
    return {
        "command": shlex.join(["python", str(shown), *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }


def write(result: dict[str, Any], path: str | Path) -> None:
    """Write ``result`` as JSON (creating the folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
