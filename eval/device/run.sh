#!/usr/bin/env bash
# Device call 3+ (no carry): continue eval/run.sh from the committed results for BUDGET
# seconds, then return the output folder under $OUT. Repeat until the log says it finished;
# then unpack evalout.tgz over eval/results/ here.
set -uo pipefail
source eval/device/env.sh
out=/tmp/evalout
# First call on this machine: start from the committed results, so nothing is recomputed.
[[ -d $out ]] || cp -r eval/results "$out"
t0=$(date +%s)
RR="python3 -m app" EVAL_ARGS="--no-progress" timeout "${BUDGET:-540}" \
    bash eval/run.sh /tmp/data "$out" >"$OUT/eval-log.txt" 2>&1
echo "eval/run.sh rc=$? after $(( $(date +%s) - t0 )) s"
wc -l "$out"/*/cache.jsonl
tar czf "$OUT/evalout.tgz" -C /tmp evalout
