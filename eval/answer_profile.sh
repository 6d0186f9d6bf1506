#!/usr/bin/env bash
# The answer-calibrated profile measured on this machine: SmolLM2's position profile from its
# answers (vLLM's OpenAI server, the chat API, the qa_default prompt), then NQ-Open dev with
# `dense` placed by that profile and, as a same-machine control, by the log-prob profile, paired
# against each other and the committed variants of eval/results/nq_open_dev. Every step
# resumes: run it again after an interruption (~50 min on a 2-core CPU).
#
#   eval/answer_profile.sh [DATA_DIR] [OUT]     # defaults ../shared/data, eval/results/answer_profile
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-eval/results/answer_profile}
RR=${RR:-.venv/bin/rag-reorder}
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
PORT=${PORT:-8765}
export HF_HUB_OFFLINE=1 RAG_REORDER_BIAS_PROFILE_DIR=$OUT/profiles
mkdir -p "$OUT"

if [[ ! -f $OUT/smollm2/profile.json ]] || ! grep -q '"stored": "' "$OUT/smollm2/profile.json"; then
    folder=$(.venv/bin/python -c 'from service.model_assets import resolve_model; from service.settings import Settings; print(resolve_model(Settings()))')
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
        --model "$folder" --served-model-name "$MODEL" --dtype float32 --max-model-len 4096 \
        --host 127.0.0.1 --port "$PORT" >"${TMPDIR:-/tmp}/answer-profile-vllm.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
        kill -0 $server || { tail -40 "${TMPDIR:-/tmp}/answer-profile-vllm.log"; exit 1; }
        sleep 2
    done
    $RR profile-generator --base-url "http://127.0.0.1:$PORT/v1" --model "$MODEL" \
        --data "$DATA/nq_open_train.jsonl" --limit "${QUESTIONS:-50}" --slots 10 \
        --concurrency 8 --no-progress --out "$OUT/smollm2" || true  # a refusal is a result
    kill $server; wait $server 2>/dev/null || true
    trap - EXIT
fi
# `dense` placed by the stored answer profile (the only profile in $RAG_REORDER_BIAS_PROFILE_DIR),
# and by the committed log-prob profile, both on this machine.
LOGPROB=eval/results/profiles/nq_open_dev
$RR eval --data "$DATA/nq_open_dev.jsonl" --max-passages 10 --strategies dense:bias_matched \
    --no-positional --no-progress --out "$OUT/nq_open_dev"
RAG_REORDER_BIAS_PROFILE_DIR=$LOGPROB $RR eval --data "$DATA/nq_open_dev.jsonl" \
    --max-passages 10 --strategies dense:bias_matched --no-positional --no-progress \
    --out "$OUT/nq_open_dev_logprob"
for run in nq_open_dev nq_open_dev_logprob; do $RR eval-report --out "$OUT/$run" --pack; done
.venv/bin/python eval/compare_answer_profile.py --answers "$OUT" \
    --logprob-profile "$LOGPROB/HuggingFaceTB_SmolLM2-135M-Instruct__qa_default__L10.json" \
    --control "$OUT/nq_open_dev_logprob" --committed eval/results/nq_open_dev \
    > "$OUT/comparison.md"
cat "$OUT/comparison.md"
