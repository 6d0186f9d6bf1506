#!/usr/bin/env bash
# The answer-calibrated profile measured on this machine: a generator's position profile from
# its answers (vLLM's OpenAI server on the CPU, the generator's prompt shape), then NQ-Open dev
# with `dense` placed by that profile, paired against the committed variants of the generator's
# run in results/eval (and, with CONTROL=1, against `dense` placed by the log-prob profile
# re-run here). Every step resumes: run it again after an interruption.
#
#   eval/answer_profile.sh [DATA_DIR] [OUT]     # defaults ../shared/data, results/eval/answer_profile
#
# SmolLM2 (the default; ~50 min on a 2-core CPU):   eval/answer_profile.sh
# Gemma-3-270m, a base model answering through /completions (~51 min: its curve needs 100
# questions to be told from flat, 1,000 calls in ~33 min, then the evaluation ~18 min):
#   QUESTIONS=100 MODEL=google/gemma-3-270m NAME=gemma-3-270m API=completions TEMPLATE=qa_completion \
#     LOGPROB=results/eval/profiles/nq_open_dev__gemma-3-270m__gemma-3-270m \
#     COMMITTED=results/eval/nq_open_dev__gemma-3-270m__gemma-3-270m CONTROL=0 eval/answer_profile.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-results/eval/answer_profile}
RR=${RR:-.venv/bin/rag-reorder}
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
NAME=${NAME:-smollm2}
API=${API:-chat}
TEMPLATE=${TEMPLATE:-qa_default}
LOGPROB=${LOGPROB:-results/eval/profiles/nq_open_dev}
COMMITTED=${COMMITTED:-results/eval/nq_open_dev}
CONTROL=${CONTROL:-1}
PORT=${PORT:-8765}
# The SmolLM2 run's folders keep their first names (nq_open_dev, nq_open_dev_logprob).
RUN=nq_open_dev
[[ $NAME == smollm2 ]] || RUN=nq_open_dev__$NAME
export HF_HUB_OFFLINE=1 RAG_REORDER_BIAS_PROFILE_DIR=$OUT/profiles
mkdir -p "$OUT"

if [[ ! -f $OUT/$NAME/profile.json ]] || ! grep -q '"stored": "' "$OUT/$NAME/profile.json"; then
    folder=$(RAG_REORDER_MODEL=$MODEL .venv/bin/python -c 'from service.model_assets import resolve_model; from service.config.settings import Settings; print(resolve_model(Settings()))')
    # A fixed KV cache: by default vLLM on the CPU asks for 0.92 of the memory free, and refuses.
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
        --model "$folder" --served-model-name "$MODEL" --dtype float32 --max-model-len 4096 \
        --host 127.0.0.1 --port "$PORT" >"${TMPDIR:-/tmp}/answer-profile-vllm.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
        kill -0 $server || { tail -40 "${TMPDIR:-/tmp}/answer-profile-vllm.log"; exit 1; }
        sleep 2
    done
    $RR profile-generator --base-url "http://127.0.0.1:$PORT/v1" --model "$MODEL" \
        --api "$API" --template "$TEMPLATE" \
        --data "$DATA/nq_open_train.jsonl" --limit "${QUESTIONS:-50}" --slots 10 \
        --concurrency 8 --no-progress --out "$OUT/$NAME" || {
        # Exit 3: measured and refused to store (a flat curve): a result, placed by whatever
        # profile the folder holds. Anything else is a failure: stop here.
        rc=$?
        [ "$rc" -eq 3 ] || { echo "profile-generator failed (exit $rc)" >&2; exit "$rc"; }
    }
    kill $server; wait $server 2>/dev/null || true
    trap - EXIT
fi
# `dense` placed by the stored answer profile (the generator's in $RAG_REORDER_BIAS_PROFILE_DIR),
# and, with CONTROL=1, by the committed log-prob profile, both on this machine.
$RR eval --data "$DATA/nq_open_dev.jsonl" --max-passages 10 --scorer "$MODEL" \
    --generator "$MODEL" --strategies dense:bias_matched --no-positional --no-progress \
    --out "$OUT/$RUN"
$RR eval-report --out "$OUT/$RUN" --pack
control=()
if [[ $CONTROL == 1 ]]; then
    RAG_REORDER_BIAS_PROFILE_DIR=$LOGPROB $RR eval --data "$DATA/nq_open_dev.jsonl" \
        --max-passages 10 --scorer "$MODEL" --generator "$MODEL" --strategies dense:bias_matched \
        --no-positional --no-progress --out "$OUT/${RUN}_logprob"
    $RR eval-report --out "$OUT/${RUN}_logprob" --pack
    control=(--control "$OUT/${RUN}_logprob")
fi
report=$OUT/comparison.md
[[ $NAME == smollm2 ]] || report=$OUT/comparison-$NAME.md
.venv/bin/python eval/compare_answer_profile.py --answers "$OUT" --name "$NAME" --eval "$RUN" \
    --logprob-profiles "$LOGPROB" "${control[@]}" --committed "$COMMITTED" > "$report"
cat "$report"
