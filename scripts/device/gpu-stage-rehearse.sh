#!/usr/bin/env bash
# Rehearses scripts/device/gpu-stage.sh here, on the CPU, before device time is spent (issue 41):
# the parts of .gpucarry/ (scripts/device/gpu-bundle.sh) carried one call at a time into a scratch
# folder, joined, checked and installed offline (pip --no-index --find-links) into a fresh
# CPython 3.12 virtualenv that has the machine's packages as stubs (scripts/device/
# gpu-device-packages.txt: torch 2.11.0 and the rest, metadata only). Then every installed
# distribution's top-level modules are imported, one subprocess each; on the CPU those that
# need torch or CUDA cannot import and are listed apart. Prints the timings.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The machine's interpreter is CPython 3.12: find one here (PATH, then pyenv's versions).
source scripts/device/gpu-common.sh
PY312=${PY312:-$(find_python312)} || { echo "rehearsal: needs a CPython 3.12 (set PY312)" >&2; exit 1; }
WORK=${WORK:-/tmp/gpu-rehearse}
DEVICE_PACKAGES=${DEVICE_PACKAGES:-scripts/device/gpu-device-packages.txt}
rm -rf "$WORK" && mkdir -p "$WORK"
VENV=$WORK/vllm-env
"$PY312" -m venv "$VENV"
site=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
write_stub_packages "$site" "$DEVICE_PACKAGES"
# One call per part, as on the device: each run sees only its own part folder.
start=$(date +%s.%N)
for part in .gpucarry/part[0-9][0-9]_; do
    rm -rf "$WORK/tree" && mkdir -p "$WORK/tree/.gpucarry"
    ln -s "$PWD/$part" "$WORK/tree/.gpucarry/"
    (cd "$WORK/tree" && CARRY_DIR=$WORK/carry WHEELS_DIR=$WORK/wheels VENV=$VENV \
        PYTHON=$PY312 bash "$OLDPWD/scripts/device/gpu-stage.sh")
done
printf 'rehearsal: %d calls and the install in %.1f s\n' \
    "$(ls -d .gpucarry/part[0-9][0-9]_ | wc -l)" "$(echo "$(date +%s.%N) - $start" | bc)"
"$VENV/bin/python" - "$site" "$DEVICE_PACKAGES" <<'PY'
import pathlib, re, subprocess, sys
site = pathlib.Path(sys.argv[1])
# The machine's own packages are stubs here (metadata, no code): a module that fails only
# because one of them is missing imports on the device.
machine = {
    re.sub(r"[-_.]+", "_", line.split("==")[0]).lower()
    for line in pathlib.Path(sys.argv[2]).read_text().splitlines()
    if line and not line.startswith("#")
}
ok, cpu_only, on_machine, failed = [], [], [], []
for dist in sorted(site.glob("*.dist-info")):
    top = dist / "top_level.txt"
    if top.exists():
        names = [n for n in top.read_text().split() if n and not n.startswith("_")]
    else:  # no top_level.txt: the packages and modules its RECORD installs at the top
        names = []
        for line in (dist / "RECORD").read_text().splitlines():
            path = line.split(",")[0]
            head, _, rest = path.partition("/")
            if rest == "__init__.py" or (not rest and head.endswith(".py")):
                names.append(head.removesuffix(".py"))
    for name in names:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if r.returncode == 0:
            ok.append(name)
            continue
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        missing = re.match(r"ModuleNotFoundError: No module named '([^'.]+)", last)
        if missing and missing.group(1).lower() in machine:
            on_machine.append(f"{dist.name}: import {name}: {last}")
            continue
        needs_gpu = any(k in last for k in ("torch", "cuda", "CUDA", "libnv", "nvidia", "triton"))
        (cpu_only if needs_gpu else failed).append(f"{dist.name}: import {name}: {last}")
print(f"rehearsal: {len(ok)} top-level modules import")
print(f"rehearsal: {len(cpu_only)} need torch or CUDA, as expected on the CPU:")
print("\n".join("  " + x for x in cpu_only))
print(f"rehearsal: {len(on_machine)} need a package the machine has (a stub here)")
print(f"rehearsal: {len(failed)} fail for another reason:")
print("\n".join("  " + x for x in failed))
PY
