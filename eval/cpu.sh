#!/usr/bin/env bash
# Continue the committed evaluation (results/eval/) on this machine's CPU, in the background
# of a session, for BUDGET seconds: scripts/device/parallel.py with one process, niced, writing
# its merged caches straight back into results/eval/<set>/cache.jsonl. Finished records are
# never recomputed and every finished variant is kept at the deadline, so repeated runs
# (across sessions) walk through what is left; then rebuild the reports
# (scripts/device/README.md, "After the last call"). Same model, dtype and profiles as the GPU
# runs (float32 transformers); the records' wall_s are then CPU seconds.
#
#   BUDGET=7200 bash eval/cpu.sh            # log: /tmp/shards-cpu/eval-log.txt
#   pkill -f scripts/device/parallel.py         # stop early (e.g. before CI): it still merges
#
# NQ-Open questions took 10-15 minutes each this way on the 2-core development VM; the
# finished questions land in the cache at the end of each question.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA:-../shared/data}
work=${WORK:-/tmp/shards-cpu}
mkdir -p "$work"
export HF_HUB_OFFLINE=1 RAG_REORDER_DEVICE=cpu RAG_REORDER_DTYPE=float32
nice -n 19 .venv/bin/python scripts/device/parallel.py --data "$data" --out results/eval \
    --work "$work" --procs 1 --budget "${BUDGET:-3600}" --rr ".venv/bin/rag-reorder" \
    2>&1 | tee -a "$work/eval-log.txt"
