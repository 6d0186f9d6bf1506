#!/usr/bin/env bash
# Builds the client's wheel (clients/python, distribution rag-reorder-client) and installs it,
# with its framework extras (LangChain, LlamaIndex, Haystack) and test tools, into its own
# virtualenv (default .venv-client): the install a RAG team gets from
# `pip install 'rag-reorder-client[langchain,llamaindex,haystack]'`. `make test` runs the
# client's tests there (clients/python/tests), so an import of the server or of a dependency the
# client does not declare fails them.
#
# The virtualenv and its dependencies are reused while their inputs are unchanged: the client's
# pyproject.toml (its dependencies, the extras' pins, the build backend), this script and the
# interpreter. A stamp ($VENV/.inputs.sha256, written last) holds their hash; any change, or a
# run that failed half-way, rebuilds it from the package index, so the virtualenv never holds
# what the wheel no longer declares. A repeated run needs no registry: the build backend is
# kept in the virtualenv and the wheel is installed --no-deps.
# The client's own wheel is rebuilt and reinstalled on every run, so the tests always see the
# current code as installed. `rm -rf .venv-client` forces a fresh one.
#
# The servers those tests call run in the server's own virtualenv (RAG_REORDER_SERVER_PYTHON,
# set by the Makefile). Usage: scripts/client-venv.sh [VENV_DIR]
set -euo pipefail
SCRIPT=$(realpath "$0")
cd "$(dirname "$SCRIPT")/.."

VENV=${1:-.venv-client}
PYTHON=${PYTHON:-python3}
CLIENT=clients/python
DIST=build/client-dist
STAMP=$VENV/.inputs.sha256
EXTRAS=langchain,llamaindex,haystack,test
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

inputs=$(
    {
        cat "$CLIENT/pyproject.toml" "$SCRIPT"
        echo "$EXTRAS"
        "$PYTHON" -c 'import sys; print(sys.version, sys.executable)'
    } | sha256sum | cut -d' ' -f1
)
if [[ -x $VENV/bin/python && -f $STAMP && $(<"$STAMP") == "$inputs" ]]; then
    fresh=0
else
    fresh=1
    rm -rf "$VENV"
    run "$PYTHON" -m venv "$VENV"
    run "$VENV/bin/python" -m pip install --upgrade pip
    requires=$("$VENV/bin/python" -c \
        'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
        "$CLIENT/pyproject.toml")
    mapfile -t requires <<<"$requires"
    # The build backend (setuptools, which a Python 3.11 virtualenv has anyway) is installed
    # here once, so that building the wheel on a later run needs no build isolation.
    run "$VENV/bin/python" -m pip install --upgrade "${requires[@]}"
fi

# A wheel, not an editable install: the tests must see what users get, and not the checkout.
# No build isolation: it would fetch the build backend from the index on every run; --no-index
# holds this and the reinstall below to that.
rm -rf "$DIST"
run "$VENV/bin/python" -m pip wheel --no-index --no-deps --no-build-isolation \
    --wheel-dir "$DIST" "./$CLIENT"
wheel=$(ls "$DIST"/rag_reorder_client-*.whl)
if ((fresh)); then
    # The extras' dependencies by uv (scripts/uv-install.sh): the same resolution, far sooner.
    run scripts/uv-install.sh "$VENV" "${wheel}[$EXTRAS]"
else
    run "$VENV/bin/python" -m pip install --no-index --no-deps --force-reinstall "$wheel"
fi
# Offline: the reused dependencies still satisfy what the new wheel declares.
run "$VENV/bin/python" -m pip check
how="the reused virtualenv"
if ((fresh)); then
    echo "$inputs" >"$STAMP"
    how="a fresh virtualenv"
fi
rm -f "$LOG"
echo "client-venv: $(basename "$wheel") in $how $VENV in $((SECONDS - start)) s" >&2
