#!/usr/bin/env bash
# The label-free generator profile measured on this machine: `profile-generator --no-labels`
# against vLLM's OpenAI server on the CPU (NQ-Open training questions, their labels unread), then
# the comparison with the gold-based profile of the same generator (eval/compare_blind_profile.py).
# Every step resumes: run it again after an interruption.
#
#   eval/blind_profile.sh [DATA_DIR] [OUT]    # defaults ../shared/data, results/eval/blind_profile
#
# SmolLM2 to 600 questions: QUESTIONS=600 STEPS=50,100,200,300,400,500,600 TIMEOUT=1800 eval/blind_profile.sh
# Gemma-3-270m: MODEL=google/gemma-3-270m NAME=gemma-3-270m API=completions TEMPLATE=qa_completion eval/blind_profile.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-results/eval/blind_profile}
RR=${RR:-.venv/bin/rag-reorder}
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
NAME=${NAME:-smollm2}
API=${API:-chat}
TEMPLATE=${TEMPLATE:-qa_default}
QUESTIONS=${QUESTIONS:-200}
PORT=${PORT:-8791}
export HF_HUB_OFFLINE=1 RAG_REORDER_BIAS_PROFILE_DIR=$OUT/profiles
mkdir -p "$OUT"
if ! curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q "$MODEL"; then
    folder=$(RAG_REORDER_MODEL=$MODEL .venv/bin/python -c 'from service.model_assets import resolve_model; from service.config.settings import Settings; print(resolve_model(Settings()))')
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        nice -n 10 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
        --model "$folder" --served-model-name "$MODEL" --dtype float32 --max-model-len 4096 \
        --host 127.0.0.1 --port "$PORT" >"${TMPDIR:-/tmp}/blind-profile-vllm.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
        kill -0 $server || { tail -40 "${TMPDIR:-/tmp}/blind-profile-vllm.log"; exit 1; }
        sleep 2
    done
fi
# Exit 3: measured, and the trust rule cannot tell yet (nothing stored): still a result.
nice -n 10 $RR profile-generator --no-labels --base-url "http://127.0.0.1:$PORT/v1" \
    --model "$MODEL" --api "$API" --template "$TEMPLATE" --data "$DATA/nq_open_train.jsonl" \
    --limit "$QUESTIONS" --slots 10 --max-tokens 16 --concurrency 4 --timeout "${TIMEOUT:-600}" --no-progress \
    --out "$OUT/$NAME" || { rc=$?; [ "$rc" -eq 3 ] || exit "$rc"; }
.venv/bin/python eval/compare_blind_profile.py --blind "$OUT/$NAME" --steps "${STEPS:-50,100,200}" \
    --data "$DATA/nq_open_train.jsonl" \
    --gold "results/eval/answer_profile/$NAME/profile.json" > "$OUT/compare_$NAME.json"
cat "$OUT/compare_$NAME.json"
