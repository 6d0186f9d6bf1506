#!/usr/bin/env bash
# MoI's adaptive design against its default design (docs/evaluation.md, "The adaptive design"):
# `moi:adaptive:bias_matched` on every NQ-Open (200) and HotpotQA (51) dev question, SmolLM2
# scoring and answering, the MoI bias profiles calibrated on the other set (as eval/run.sh).
# The default design's records are the committed ones (results/eval/<set>/cache.jsonl.gz);
# eval/compare_adaptive.py pairs the two.
#
# Two shards run side by side, one thread each (this machine has 2 cores); each shard is a
# `rag-reorder eval` that resumes from its cache, so an interrupted run is continued by
# running this again. Output: results/eval/adaptive/<set>/shard-<k>/.
#
#   bash eval/adaptive.sh                        # then: .venv/bin/python eval/compare_adaptive.py
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA:-../shared/data}
out=${OUT:-results/eval/adaptive}
RR=${RR:-.venv/bin/rag-reorder}
export HF_HUB_OFFLINE=1 RAG_REORDER_DEVICE=${RAG_REORDER_DEVICE:-cpu} RAG_REORDER_DTYPE=float32
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

shard() {  # set, first line (1-based), last line, shard name
    local set=$1 first=$2 last=$3 name=$4 dir=$out/$1/shard-$4
    mkdir -p "$dir"
    sed -n "${first},${last}p" "$data/$set.jsonl" >"$dir/questions.jsonl"
    RAG_REORDER_BIAS_PROFILE_DIR=results/eval/profiles/$set $RR eval \
        --data "$dir/questions.jsonl" --max-passages 10 --strategies moi:adaptive:bias_matched \
        --no-positional --no-progress --resamples 1000 --out "$dir" >"$dir/eval.log" 2>&1
}

# NQ-Open questions 1-125 in one shard; 126-200, then HotpotQA, in the other.
shard nq_open_dev 1 125 a &
(shard nq_open_dev 126 200 b && shard hotpot_dev 1 51 a) &
wait
