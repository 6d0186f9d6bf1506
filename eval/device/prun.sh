#!/usr/bin/env bash
# Device call 2+ (after stage1/stage2 on the same machine): the evaluation as a pool of
# `rag-reorder eval` processes on the one GPU (eval/device/parallel.py) for BUDGET seconds,
# continuing from the committed results; then evalout.tgz, the log, the chunks' logs and a GPU
# utilisation trace under $OUT. Repeat until the log says "unfinished chunks: none".
set -uo pipefail
source eval/device/env.sh
export OMP_NUM_THREADS=2  # several processes share the machine's 16 cores
out=/tmp/evalout
# First call on this machine: start from the committed results, so nothing is recomputed.
[[ -d $out ]] || cp -r eval/results "$out"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 15 \
    >"$OUT/gpu-util.txt" 2>&1 &
smi=$!
python3 eval/device/parallel.py --data /tmp/data --out "$out" --budget "${BUDGET:-520}" \
    --procs "${PROCS:-5}" 2>&1 | tee "$OUT/eval-log.txt"
kill "$smi"
mkdir -p "$OUT/logs" && cp /tmp/shards/*.log "$OUT/logs/" 2>/dev/null
tar czf "$OUT/evalout.tgz" -C /tmp evalout
