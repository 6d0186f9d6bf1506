# Sourced on the device: the carried packages, the offline model cache, CUDA in float32 (the
# committed results' settings). SITE: the carried packages' folder (stage.sh's /tmp/site; the
# CPU check of gpu-engines.sh gives its own, to see that every process it starts reaches it).
export PYTHONPATH=${SITE:-/tmp/site}:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# The cache defaults to /tmp/rr there; the CPU check of gpu-engines.sh points it at its own.
export RAG_REORDER_CACHE_DIR=${RAG_REORDER_CACHE_DIR:-/tmp/rr} OPENBLAS_NUM_THREADS=1
export RAG_REORDER_DEVICE=cuda RAG_REORDER_DTYPE=float32 RAG_REORDER_BATCH_TOKEN_BUDGET=${RAG_REORDER_BATCH_TOKEN_BUDGET:-65536}
