#!/usr/bin/env bash
# Reproduces results/eval/: every strategy on both development sets, 10 passages per question.
#
# Before each evaluation the profiles that some strategies need are measured and stored in a
# profile folder of that run (RAG_REORDER_BIAS_PROFILE_DIR), never taken from a previous run:
#   - MoI bias profiles (cyclic at 10 slots, pruned_cyclic at 5: one `rag-reorder calibrate
#     --design random` stores both, the 5-slot one orienting the 10-slot one) on the OTHER
#     development set, so no question is both calibration and test;
#   - positional profiles (max_relevance, min_distraction) from `rag-reorder calibrate-positions`
#     on the first 50 NQ-Open questions for both sets: at 10 slots a question needs 10
#     non-gold passages, and HotpotQA questions have 8. For NQ-Open those 50 questions are also
#     evaluated; what they pass on is two 10-value per-slot profiles, nothing per question.
#
# Usage: eval/run.sh [DATA_DIR] [OUT_DIR]          (defaults: ../shared/data, results/eval)
# Environment: RAG_REORDER_* settings (device, dtype, model); RR is the CLI to call
# (default .venv/bin/rag-reorder); EVAL_ARGS is appended to every `rag-reorder eval`.
# Steps already done (their output file exists) are skipped, and `eval` resumes from its cache,
# so an interrupted run is continued by running this again.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${1:-../shared/data}
OUT=${2:-results/eval}
RR=${RR:-.venv/bin/rag-reorder}  # may be several words, e.g. "python3 -m entrypoints"
K=${K:-10}
CALIBRATION_QUESTIONS=${CALIBRATION_QUESTIONS:-50}

step() {  # output file, then the command; skipped when the output exists
    local out=$1
    shift
    [[ -s $out ]] && return 0
    echo "+ $*" >&2
    "$@" >"$out.tmp"
    mv "$out.tmp" "$out"
}

run_set() {  # test set, set the MoI bias profiles are calibrated on
    local test=$1 calib=$2
    local prof=$OUT/profiles/$test
    mkdir -p "$prof"
    export RAG_REORDER_BIAS_PROFILE_DIR=$prof
    step "$prof/calibrate-random.json" $RR calibrate --data "$DATA/$calib.jsonl" \
        --limit "$CALIBRATION_QUESTIONS" --max-passages "$K" --design random
    mkdir -p "$prof/positional"
    cp "$OUT/profiles/positional-nq_open_dev/positional/"*.json "$prof/positional/"
    # shellcheck disable=SC2086  # EVAL_ARGS is a list of flags
    $RR eval --data "$DATA/$test.jsonl" --max-passages "$K" --out "$OUT/$test" ${EVAL_ARGS:-}
    # The form the repository keeps: the records packed (cache.jsonl.gz) beside run.json.
    $RR eval-report --out "$OUT/$test" --pack
}

# The positional profiles, measured once and copied into each set's profile folder.
positional=$OUT/profiles/positional-nq_open_dev
mkdir -p "$positional"
RAG_REORDER_BIAS_PROFILE_DIR=$positional step "$positional/calibrate-positions.json" \
    $RR calibrate-positions --data "$DATA/nq_open_dev.jsonl" \
    --limit "$CALIBRATION_QUESTIONS" --max-passages "$K"

run_set hotpot_dev nq_open_dev
run_set nq_open_dev hotpot_dev
