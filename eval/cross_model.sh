#!/usr/bin/env bash
# One pairing of the cross-model evaluation (issue 20): SCORER orders the passages, GENERATOR
# answers from each order. Results go to $OUT/<set>__<name>/, the generator's bias profile to
# $OUT/profiles/<set>__<name>/.
#
# Steps, each skipped when done, so running this again continues an interrupted run:
#   1. calibrate GENERATOR's position-bias profile (its own template) on the OTHER development
#      set, so no question is both calibration and test; the `bias_matched` ranker variants
#      and `moi:<design>:generator_bias` place by it (with one model for both, MoI's fit
#      places by itself and the rankers by this profile);
#   2. `rag-reorder eval` on every question of SET with STRATEGIES, resuming from its cache.
#
# Usage: eval/cross_model.sh SET CALIB_SET SCORER GENERATOR NAME [DATA_DIR] [OUT_DIR]
#   e.g. eval/cross_model.sh nq_open_dev hotpot_dev HuggingFaceTB/SmolLM2-135M-Instruct \
#          google/gemma-3-270m smollm2-135m__gemma-3-270m
# Environment: RAG_REORDER_* settings (device, dtype); RR is the CLI (default
# .venv/bin/rag-reorder); EVAL_ARGS is appended to `rag-reorder eval`; CALIBRATION_QUESTIONS
# and CALIBRATION_PROMPTS (prompts per question) size step 1 (defaults 16 and 20, about 15
# minutes for Gemma-3-270m on the 2-core CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

SET=$1 CALIB=$2 SCORER=$3 GENERATOR=$4 NAME=$5
DATA=${6:-../shared/data}
OUT=${7:-results/eval}
RR=${RR:-.venv/bin/rag-reorder}  # may be several words, e.g. "python3 -m entrypoints"
K=${K:-10}
STRATEGIES=${STRATEGIES:-moi:pruned_random,retriever,shuffle,litm,query_likelihood,query_generation,bm25,dense}

prof=$OUT/profiles/${SET}__$NAME
mkdir -p "$prof"
export RAG_REORDER_BIAS_PROFILE_DIR=$prof
if [[ ! -s $prof/calibrate-random.json ]]; then
    echo "+ calibrate $GENERATOR on $CALIB" >&2
    $RR --model "$GENERATOR" calibrate --data "$DATA/$CALIB.jsonl" \
        --limit "${CALIBRATION_QUESTIONS:-16}" --num-prompts "${CALIBRATION_PROMPTS:-20}" \
        --max-passages "$K" --design random >"$prof/calibrate-random.json.tmp"
    mv "$prof/calibrate-random.json.tmp" "$prof/calibrate-random.json"
fi
# shellcheck disable=SC2086  # EVAL_ARGS is a list of flags
$RR eval --data "$DATA/$SET.jsonl" --max-passages "$K" --scorer "$SCORER" \
    --generator "$GENERATOR" --strategies "$STRATEGIES" --no-positional \
    --out "$OUT/${SET}__$NAME" ${EVAL_ARGS:-}
