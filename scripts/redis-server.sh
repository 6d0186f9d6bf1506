#!/usr/bin/env bash
# Installs redis-server, which the state-store tests start as a real process
# (tests/support/redis_server.py): Debian's package, with apt-get (root, or sudo if present).
# A no-op where redis-server is already on PATH.
# Usage: scripts/redis-server.sh
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
command -v redis-server
