#!/usr/bin/env bash
# Device call 8+ (after scripts/device/stage.sh has unpacked the bundle on the same machine): the
# evaluation as a pool of `rag-reorder eval` processes on the one GPU
# (scripts/device/parallel.py) for BUDGET seconds, continuing from the committed results; then
# evalout.tgz, the log, the chunks' logs and a GPU utilisation trace under $OUT. Repeat until
# the log says "unfinished chunks: none". PARALLEL_ARGS goes to parallel.py (e.g. its
# --pairing runs, scripts/device/README.md).
set -uo pipefail
source scripts/device/env.sh
export OMP_NUM_THREADS=2  # several processes share the machine's 16 cores
out=/tmp/evalout
# First call on this machine: start from the committed results, so nothing is recomputed.
[[ -d $out ]] || cp -r results/eval "$out"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 15 \
    >"$OUT/gpu-util.txt" 2>&1 &
smi=$!
# shellcheck disable=SC2086  # PARALLEL_ARGS is a list of flags
python3 scripts/device/parallel.py --data /tmp/data --out "$out" --budget "${BUDGET:-520}" \
    --procs "${PROCS:-5}" ${PARALLEL_ARGS:-} 2>&1 | tee "$OUT/eval-log.txt"
kill "$smi"
mkdir -p "$OUT/logs" && tail -n 30 /tmp/shards/*.log >"$OUT/logs/chunks-tail.txt" 2>/dev/null
tar czf "$OUT/evalout.tgz" -C /tmp evalout
