#!/usr/bin/env bash
# Every device call that carries a part of .gpucarry/ (scripts/device/gpu-bundle.sh) runs this
# first: it keeps the carried part in $CARRY_DIR and, once every part is there (the joined tar
# matches its checksum), installs vLLM offline into $VENV, a virtualenv over the machine's own
# packages (--system-site-packages: its torch 2.11.0+cu130 satisfies vLLM's torch==2.11.0, and
# nothing CUDA travels). A call before the last one only stores its part; after the install
# it is a no-op.
#
# Rehearsed on the CPU (REHEARSE=1 scripts/device/gpu-stage-rehearse.sh): the same steps into a
# python3.12 virtualenv whose torch is a stub.
set -euo pipefail
CARRY_DIR=${CARRY_DIR:-/tmp/gpucarry}
WHEELS_DIR=${WHEELS_DIR:-/tmp/gpuwheels}
VENV=${VENV:-/tmp/vllm-env}
PYTHON=${PYTHON:-python3}
mkdir -p "$CARRY_DIR"
for d in .gpucarry/part[0-9][0-9]_; do
    [[ -d $d ]] || continue
    cp "$d"/part[0-9][0-9] "$d/bundle.sha" "$CARRY_DIR/"
done
if [[ -f $VENV/.vllm-ready ]]; then
    echo "gpu bundle: vLLM ready in $VENV"
    exit 0
fi
have=$(cd "$CARRY_DIR" && ls part[0-9][0-9] 2>/dev/null | tr '\n' ' ')
want=$(cat "$CARRY_DIR/bundle.sha")
start=$SECONDS
if [[ $(cat "$CARRY_DIR"/part[0-9][0-9] | sha256sum | cut -d' ' -f1) != "$want" ]]; then
    echo "gpu bundle: parts so far: $have"
    exit 0
fi
echo "gpu bundle: complete ($have), installing"
rm -rf "$WHEELS_DIR" && mkdir -p "$WHEELS_DIR"
cat "$CARRY_DIR"/part[0-9][0-9] | tar xf - -C "$WHEELS_DIR" --strip-components=1
joined=$SECONDS
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv --system-site-packages "$VENV"
# The machine's python3 is itself a virtualenv's (/opt/torch/.venv, found on 2026-11-26), and
# --system-site-packages reaches only its base interpreter's site: without this .pth, vLLM
# found no torch. Its site folders come after the venv's own, so the carried wheels win.
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-site.pth"
# --no-deps: requirements.txt pins the whole closure resolved by scripts/device/gpu-bundle.sh, less
# the wheels it leaves behind (LEAVE there), which pip would otherwise ask for.
PIP_CONSTRAINT= PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q --no-deps \
    --no-index --find-links "$WHEELS_DIR" --no-compile -r "$WHEELS_DIR/requirements.txt"
"$VENV/bin/python" -m pip check || echo "gpu bundle: pip check found the conflicts above (LEAVE's wheels expected)"
installed=$SECONDS
# Whole seconds from bash: the machine has no bc.
echo "gpu bundle: joined and unpacked in $((joined - start)) s, installed in $((installed - joined)) s"
touch "$VENV/.vllm-ready"
