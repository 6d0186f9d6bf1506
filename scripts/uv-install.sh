#!/usr/bin/env bash
# Installs packages into a virtualenv with uv (pinned), bootstrapped into that virtualenv by pip.
#
# Why uv: a fresh `make test` builds three virtualenvs, and pip spent most of CI's first minutes
# on them. The main one, fresh, with no cache: pip 240 s, uv 40 s (17 s of it installing uv), the
# same packages at the same versions (`pip freeze` equal; docs/development.md, Tests).
#
# uv reads neither pip.conf nor PIP_* variables: the local wheel folder pip uses (where a machine
# keeps its CPU build of torch, so that `torch==2.13.0` is not the multi-GB CUDA build) is passed
# on as UV_FIND_LINKS, from PIP_FIND_LINKS or pip's configured find-links.
#
# Usage: scripts/uv-install.sh VENV [uv pip install arguments...]
set -euo pipefail
UV_VERSION=0.13.9
VENV=$1
shift
if [[ ! -x $VENV/bin/uv ]]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
if [[ -z ${UV_FIND_LINKS:-} ]]; then
    links=${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
    if [[ -n $links ]]; then
        export UV_FIND_LINKS=$links
    fi
fi
# --compile-bytecode: pip compiles every module at install, uv only when asked. Where
# PYTHONDONTWRITEBYTECODE is set (as on CI's machines) nothing is compiled later either, and
# every process then compiled torch's, transformers' and vLLM's modules from source at import:
# the vLLM suite took 705 s instead of 406.
exec "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "$@"
