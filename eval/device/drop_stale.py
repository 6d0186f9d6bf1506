"""Remove from eval/results what predates the orientation rule, so eval/device/run.sh re-measures
it: the two MoI bias-profile folders and the moi:random, moi:hybrid and moi:cyclic records of
every cache (eval/results/README.md says why). Run it here, before the device calls; the
working tree travels to the device. Prints what it removed.

Usage: python eval/device/drop_stale.py [eval/results]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

STALE = ("moi:random:", "moi:hybrid:", "moi:cyclic:")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "eval/results")
    for name in ("hotpot_dev", "nq_open_dev"):
        folder = root / "profiles" / name
        if folder.is_dir():
            shutil.rmtree(folder)
            print(f"removed {folder}")
    for cache in sorted(root.glob("*/cache.jsonl")):
        lines = cache.read_text().splitlines(keepends=True)
        keep = [ln for ln in lines if not json.loads(ln)["key"]["variant"].startswith(STALE)]
        cache.write_text("".join(keep))
        print(f"{cache}: removed {len(lines) - len(keep)} of {len(lines)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
