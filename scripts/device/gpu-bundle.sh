#!/usr/bin/env bash
# Builds .gpucarry/ (git-ignored): every wheel the lent GPU machine lacks to run vLLM, for
# issue 41. The machine has CPython 3.12 and torch 2.11.0+cu130 (in /opt/torch/.venv, with
# about 200 more packages) but no vLLM and no network, and takes at most 64 MiB per call, so the wheels travel as one tar cut into
# parts of PART_MIB (default 60) MiB, one part per `device` call (scripts/device/gpu-stage.sh
# stores them there and installs once all have arrived).
#
# Which vLLM: 0.26.0 is the newest release that pins torch==2.11.0 (0.27.0 on pin 2.13.0),
# and it targets CUDA 13 (it requires nvidia-cutlass-dsl[cu13]; torch 2.11.0's own wheel
# requires cuda-toolkit 13.0.2), the machine's cu130. Checked from the wheels' metadata
# (PEP 658 `.metadata` files), which is also how this script resolves: nothing of torch or
# CUDA is downloaded here.
#
# What is carried: vLLM's whole dependency closure for cp312 / manylinux (glibc <= GLIBC,
# default 2.35) minus what the machine already has. Those are listed in DEVICE_PACKAGES
# (default scripts/device/gpu-device-packages.txt, `name==version` lines); the resolver sees them
# as installed (stub dist-infos in a scratch venv), so it downloads only those it must replace
# (a version vLLM's pins exclude). The file is the H200's `pip list --format=freeze` of
# 2026-11-26 (scripts/device/gpu-engines.sh's info stage writes a fresh one to $OUT): 739 MiB in
# 13 parts, against 1,137 MiB in 19 with only torch, triton and transformers listed; 561 MiB
# in 10 with the CuTe DSL left behind too (LEAVE below).
#
# Writes: .gpucarry/partNN_/ (a part and the tar's sha256, each a carry path),
# .gpucarry/wheels.tsv, and the committed manifest scripts/device/gpu-bundle.manifest.tsv
# (wheel, size, sha256; then each part's). Timing of the split and of the reassembly below
# (REHEARSE=1) is printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=${VLLM:-0.26.0}
# Beside vLLM, what the device script runs that the machine may lack: the test runner and its
# plugins (tests/service/test_vllm_backend.py) and matplotlib (bench/load.py's plot).
EXTRA=${EXTRA:-pytest pytest-timeout pytest-asyncio==1.5.0 matplotlib}
PART_MIB=${PART_MIB:-60}
# Requirements of vLLM that a text model's prompt log-probs never import, left behind to save
# device calls (266 MiB, 4 parts when the bundle was 19): video decoding (cv2 and PyNvVideoCodec, imported in
# try/except in vllm/multimodal/video.py; torchcodec, checked before use), tilelang and its z3
# (imported inside functions of vllm/model_executor/kernels/mhc/tilelang.py) and
# tokenspeed-triton (tokenspeed-mla's DeepSeek MLA kernels, imported inside functions).
# Read from vllm 0.26.0's sources on 2026-11-26. And CUTLASS's CuTe DSL (nvidia-cutlass-dsl
# and its libraries, 178 MiB, the cu12 build among them; quack-kernels and tokenspeed-mla,
# which import it): on an H100/H200 (SM 9.0, FlashAttention 3) a dense model's path imports
# it only in try/except (ll_bf16.is_available, jit_monitor, flashinfer) or inside functions
# of FA4 (SM 10.0), MLA, MoE and model-specific kernels: scripts/device/gpu_leave_check.py walks
# the carried wheels' imports from the engine, worker, runner, warm-up, Llama and
# FlashAttention modules (none reaches a left-behind package) and lists those inside
# functions; run it after any change of LEAVE or of vLLM's version. Absent, the
# warm-up skips the MoE router GEMM kernels, 14-18 s of every engine start on the H200
# (kernel_warmup.py, results/bench/gpu_h200_20261127_2/logs.md). The install is then --no-deps
# over exact pins (the closure is resolved here), so pip does not ask for them; `LEAVE=`
# carries everything.
LEAVE=${LEAVE-opencv-python-headless pynvvideocodec torchcodec tilelang z3-solver tokenspeed-triton \
nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13 nvidia-cuda-nvdisasm quack-kernels \
tokenspeed-mla}
GLIBC=${GLIBC:-2.35}
DEVICE_PACKAGES=${DEVICE_PACKAGES:-scripts/device/gpu-device-packages.txt}
OUT=.gpucarry
MANIFEST=scripts/device/gpu-bundle.manifest.tsv
# Resolve with a CPython 3.12 (the machine's): pip evaluates the requirements' markers
# (`six; python_version > "3.11"`) against the interpreter it runs on, not --python-version.
source scripts/device/gpu-common.sh
HOST_PY=${HOST_PY:-$(find_python312)} ||
    { echo "gpu-bundle: needs a CPython 3.12 to resolve (set HOST_PY)" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=

mkdir -p "$OUT/wheels"
rm -rf "$OUT/resolve" "$OUT"/part[0-9][0-9]_
"$HOST_PY" -m venv "$OUT/resolve"
# A pip recent enough to take --platform with --dry-run (the venv's own may predate it).
"$OUT/resolve/bin/python" -m pip install -q --upgrade 'pip>=25' 2>&1 | grep -v 'is ignored' || true
site=$("$OUT/resolve/bin/python" -c "import site; print(site.getsitepackages()[0])")
write_stub_packages "$site" "$DEVICE_PACKAGES"
platforms=(--platform manylinux2014_x86_64)
for minor in $(seq 17 "${GLIBC#2.}"); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
"$OUT/resolve/bin/python" -m pip install -q --dry-run --report "$OUT/report.json" \
    --python-version 3.12 --implementation cp --abi cp312 "${platforms[@]}" \
    --only-binary=:all: "vllm==$VLLM" $EXTRA 2>&1 | grep -v 'is ignored' || true
test -s "$OUT/report.json" || { echo "gpu-bundle: resolution failed" >&2; exit 1; }

# Download what the report names (checking its sha256), keep nothing else.
"$HOST_PY" - "$OUT" "$LEAVE" <<'PY'
import hashlib, json, pathlib, re, sys, urllib.request
out = pathlib.Path(sys.argv[1])
leave = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2].split()}
report = json.loads((out / "report.json").read_text())
wheels = out / "wheels"
wanted, pins = {}, []
for item in report["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if name in leave:
        print(f"gpu-bundle: leaving {name}=={meta['version']} behind")
        continue
    pins.append(f"{name}=={meta['version']}")
    info = item["download_info"]
    url = info["url"]
    sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
    wanted[url.rsplit("/", 1)[1]] = (url, sha)
for stale in wheels.iterdir():
    if stale.name not in wanted and stale.name != "requirements.txt":
        stale.unlink()
rows = []
for name, (url, sha) in sorted(wanted.items()):
    path = wheels / name
    if not path.exists() or (sha and hashlib.sha256(path.read_bytes()).hexdigest() != sha):
        tmp = path.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=300) as r, tmp.open("wb") as fh:
            while chunk := r.read(1 << 20):
                fh.write(chunk)
        tmp.rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if sha and digest != sha:
        sys.exit(f"gpu-bundle: {name}: sha256 {digest} is not the index's {sha}")
    rows.append(f"{name}\t{path.stat().st_size}\t{digest}")
(out / "wheels.tsv").write_text("\n".join(rows) + "\n")
# What gpu-stage.sh installs (--no-deps): every carried wheel, pinned.
(wheels / "requirements.txt").write_text("\n".join(sorted(pins)) + "\n")
total = sum(int(r.split("\t")[1]) for r in rows)
print(f"gpu-bundle: {len(rows)} wheels, {total / 2**20:.0f} MiB")
PY

start=$(date +%s.%N)
# Wheels are compressed already: a plain tar, cut into parts.
tar cf "$OUT/bundle.tar" -C "$OUT" wheels
sha256sum "$OUT/bundle.tar" | cut -d' ' -f1 > "$OUT/bundle.sha"
split -b "${PART_MIB}M" -d -a 2 "$OUT/bundle.tar" "$OUT/part"
rm "$OUT/bundle.tar"
for f in "$OUT"/part[0-9][0-9]; do
    mkdir "$f.d" && mv "$f" "$f.d/" && cp "$OUT/bundle.sha" "$f.d/" && mv "$f.d" "${f}_"
done
split_s=$(echo "$(date +%s.%N) - $start" | bc)
{
    printf '# vllm==%s for cp312 manylinux x86_64 (glibc <= %s), minus %s and LEAVE (%s); scripts/device/gpu-bundle.sh\n' \
        "$VLLM" "$GLIBC" "$DEVICE_PACKAGES" "$LEAVE"
    printf '# wheel\tbytes\tsha256\n'
    cat "$OUT/wheels.tsv"
    printf '# part\tbytes\tsha256 (the tar: %s)\n' "$(cat "$OUT/bundle.sha")"
    for d in "$OUT"/part[0-9][0-9]_; do
        f=$(ls "$d"/part[0-9][0-9])
        printf '%s\t%s\t%s\n' "$(basename "$f")" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
    done
} > "$MANIFEST"
parts=$(ls -d "$OUT"/part[0-9][0-9]_ | wc -l)
echo "gpu-bundle: $parts parts of <= $PART_MIB MiB in $OUT (tar + split ${split_s} s); manifest $MANIFEST"
