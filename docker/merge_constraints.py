"""Pip constraints for the images: lock them from a tested environment, merge them into an image.

    python docker/merge_constraints.py lock > docker/constraints-cpu.txt
        Every runtime dependency of pyproject.toml's project (recursively, extras excluded)
        at its installed version: run it with the virtualenv ``make test`` used
        (``.venv/bin/python docker/merge_constraints.py lock``). torch is left out: the CPU
        image installs it from the CPU wheel index, pinned in the Dockerfile.

    python3 merge_constraints.py IMAGE_FREEZE LOCKED
        The GPU build: every package already in the vLLM image stays at the image's version
        (``pip list --format=freeze``), and the locked pins apply only to packages the image
        lacks. Prints the merged constraints.

Standard library only for ``merge`` (it runs inside the vLLM image before anything is installed).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")
# Left out of the lock: installed separately (torch) or the project itself.
_NOT_LOCKED = {"torch", "rag-reorder"}
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (comments, blanks and other forms skipped) by canonical name."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def merge(image: dict[str, str], locked: dict[str, str]) -> dict[str, str]:
    """The image's pins, plus the locked pins of packages the image does not have."""
    merged = dict(image)
    for name, version in locked.items():
        merged.setdefault(name, version)
    return merged


def render(pins: dict[str, str]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def lock(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Installed versions of the project's runtime dependency closure: the direct dependencies
    from pyproject.toml, their own requirements from the installed distributions."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads(pyproject.read_text())["project"]
    pins: dict[str, str] = {}
    todo = [Requirement(spec).name for spec in project["dependencies"]]
    while todo:
        name = canonical(todo.pop())
        if name in pins:
            continue
        dist = md.distribution(name)
        pins[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return {k: v for k, v in pins.items() if k not in _NOT_LOCKED}


def main(argv: list[str]) -> int:
    if argv == ["lock"]:
        sys.stdout.write(
            "# Runtime dependencies of rag-reorder as tested by `make test` (torch: Dockerfile).\n"
            "# Regenerate: .venv/bin/python docker/merge_constraints.py lock"
            " > docker/constraints-cpu.txt\n" + render(lock())
        )
        return 0
    if len(argv) == 2:
        image = parse_pins(Path(argv[0]).read_text())
        locked = parse_pins(Path(argv[1]).read_text())
        sys.stdout.write(render(merge(image, locked)))
        return 0
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
