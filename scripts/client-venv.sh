#!/usr/bin/env bash
# Builds the client's wheel (clients/python, distribution rag-reorder-client) and installs it,
# with its framework extras (LangChain, LlamaIndex, Haystack) and test tools, into a fresh virtualenv (default .venv-client):
# the install a RAG team gets from `pip install 'rag-reorder-client[langchain,llamaindex]'`.
# `make test` runs the client's tests there (clients/python/tests), so an import of the server
# or of a dependency the client does not declare fails them. Fresh on every run, on purpose:
# a virtualenv kept from an earlier run could hold what the wheel no longer declares.
#
# The servers those tests call run in the server's own virtualenv (RAG_REORDER_SERVER_PYTHON,
# set by the Makefile). Usage: scripts/client-venv.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-client}
PYTHON=${PYTHON:-python3}
DIST=build/client-dist
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
LOG=$(mktemp)
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 60 "$LOG" >&2
        echo "client-venv: failed: $*" >&2
        exit 1
    fi
}
rm -rf "$VENV" "$DIST"
run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install --upgrade pip
# A wheel, not an editable install: the tests must see what users get, and not the checkout.
run "$VENV/bin/python" -m pip wheel --no-deps --wheel-dir "$DIST" ./clients/python
wheel=$(ls "$DIST"/rag_reorder_client-*.whl)
run "$VENV/bin/python" -m pip install "${wheel}[langchain,llamaindex,haystack,test]"
rm -f "$LOG"
echo "client-venv: $(basename "$wheel") in $VENV in $((SECONDS - start)) s" >&2
