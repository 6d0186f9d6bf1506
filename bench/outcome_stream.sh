#!/usr/bin/env bash
# The holdout on a live stream through the deployed path (bench/outcome_stream.py): SmolLM2
# behind vLLM's OpenAI server (float32, as eval/deployed.sh runs it), a rag-reorder server on
# the defaults with outcome feedback on (so the holdout at its default rate is too), started
# from the profile eval/deployed.sh's server learned (eval/results/deployed/state/profiles at 3644731,
# read from git history: auto places from the first request, as a restarted replica would), then the client.
# Resumable: run it again after an interruption (the server's state and the rows are kept).
#
#   bench/outcome_stream.sh [OUT]      # default results/bench/outcome_stream
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/bench/outcome_stream}
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
VPORT=${VPORT:-8796}
RPORT=${RPORT:-8797}
STATE=${STATE:-/tmp/outcome-stream-state}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT" "$STATE"
# The deployed evaluation's learned state is runtime output, kept out of the tree since the
# results moved; it is read from the commit that still held it.
[ -d "$STATE/profiles" ] || git archive "${PROFILES_COMMIT:-3644731}" eval/results/deployed/state/profiles \
    | tar -x -C "$STATE" --strip-components=4
folder=$(RAG_REORDER_MODEL=$MODEL .venv/bin/python -c 'from service.model_assets import resolve_model; from service.config.settings import Settings; print(resolve_model(Settings()))')
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    OMP_NUM_THREADS=${VLLM_THREADS:-2} \
    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model "$folder" --served-model-name "$MODEL" --dtype float32 --max-model-len 4096 \
    --host 127.0.0.1 --port "$VPORT" >>"$STATE/vllm.log" 2>&1 &
vllm=$!
# The defaults, with outcome feedback on: served requests kept (RAG_REORDER_FEEDBACK_MAX_
# REQUESTS). The stream began when feedback also needed RAG_REORDER_GENERATOR_MODEL (another
# name for the scorer here, so auto placed by the scorer's profile only with
# RAG_REORDER_AUTO_LEARN_FROM_SCORER); it keeps that configuration to its end so that every
# request is served alike. Feedback alone needs neither now: the same placement, the same
# holdout, the answers not learned from (the holdout's control is the retriever's order,
# which is never learned from either).
RAG_REORDER_MODEL=$MODEL RAG_REORDER_BIAS_PROFILE_DIR=$STATE/profiles \
    RAG_REORDER_CACHE_DIR=$STATE/cache \
    RAG_REORDER_FEEDBACK_MAX_REQUESTS=10000 RAG_REORDER_GENERATOR_MODEL=smollm2-generator \
    RAG_REORDER_AUTO_LEARN_FROM_SCORER=true RAG_REORDER_OPEN_WRITES=true \
    RAG_REORDER_REQUEST_TIMEOUT_S=600 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
    PYTHONPATH=$PWD .venv/bin/python -m entrypoints serve --host 127.0.0.1 --port "$RPORT" \
    >>"$STATE/server.log" 2>&1 &
server=$!
trap 'kill $vllm $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$VPORT/v1/models" >/dev/null \
    && curl -sf "http://127.0.0.1:$RPORT/ready" >/dev/null; do
    kill -0 $vllm $server || { tail -20 "$STATE"/*.log; exit 1; }
    sleep 2
done
PYTHONPATH=$PWD .venv/bin/python -m bench.outcome_stream --reorder-url "http://127.0.0.1:$RPORT" \
    --data "${DATA:-../shared/data}/nq_open_dev.jsonl" \
    --generator-url "http://127.0.0.1:$VPORT/v1" --generator-model "$MODEL" \
    --requests "${REQUESTS:-1000}" --concurrency "${CONCURRENCY:-4}" --out "$OUT/smollm2.json"
