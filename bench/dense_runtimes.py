"""The ``dense`` encoder (all-MiniLM-L6-v2) on the CPU under several runtimes, side by side:
eager PyTorch (what ``service/backends/encoders/embedding.py`` runs), ONNX Runtime (the same module,
mean pooling and normalisation included, exported with ``torch.onnx.export``, opset 17),
``torch.compile(dynamic=True)``, and dynamic int8 quantisation of the linear layers
(``torch.ao.quantization.quantize_dynamic``; ``--runtimes`` picks which beside eager).

The batch is ``--questions`` NQ-Open dev questions' query and first 10 passages, tokenised
once, run as the encoder runs a cross-request batch (rows sorted by length, 8 a forward, each
padded to its own longest), one thread (``torch.set_num_threads(1)``, ONNX Runtime's intra-op
and inter-op threads 1): the CPU time of the calling thread per 10-passage request, for
``--rounds`` rounds alternating the runtimes (the machine is shared; the rounds show its
noise). Each runtime's embeddings against eager's: the largest absolute difference, the
lowest cosine, and how many questions' passage rankings are identical. A runtime that computes
the same function (ONNX Runtime, the compile) is worth keeping only if it is faster by more
than the noise and matches within 1e-5 (the encoder test's tolerance); int8 computes another
one, so its lowest cosine and its identical rankings are the figures to weigh against its speed.

ONNX Runtime and onnx are not dependencies of the service: install them beside it first
(``pip install --target /tmp/ort-site onnxruntime onnx``; ``--ort-site`` is appended to the
path, after the virtualenv's packages). The compile needs a C++ compiler (inductor).

Usage: python -m bench.dense_runtimes [--questions 16] [--rounds 2] [--ort-site /tmp/ort-site]
           [--out results/bench/dense_runtimes.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import report
from service.backends.encoders.embedding import (
    DIM,
    MAX_TOKENS,
    EncoderConfig,
    MiniLMEncoder,
    model_dir,
)

CHUNK = 8


class _Pooled(torch.nn.Module):
    """The encoder's forward as one module: the model, mean pooling, L2 normalisation."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(attention_mask),
        ).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def chunked(batch: list[list[int]], run: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Any:
    """``run`` over the rows sorted by length, ``CHUNK`` at a time, as the encoder does."""
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
    out = np.empty((len(batch), DIM), dtype=np.float32)
    for start in range(0, len(order), CHUNK):
        rows = order[start : start + CHUNK]
        width = max(len(batch[i]) for i in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for k, i in enumerate(rows):
            ids[k, : len(batch[i])] = batch[i]
            mask[k, : len(batch[i])] = 1
        out[rows] = run(ids, mask)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.questions]]
    texts = [
        t
        for r in rows
        for t in [r["question"], *[f"{p['title']}: {p['text']}" for p in r["passages"][:10]]]
    ]
    enc = MiniLMEncoder(model_dir(), EncoderConfig(device="cpu", cache_entries=0))
    ids = enc._tok(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]
    module = _Pooled(enc._model).eval()

    def torch_run(m: torch.nn.Module) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def go(i: np.ndarray, a: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return np.asarray(m(torch.from_numpy(i), torch.from_numpy(a)).numpy())

        return go

    runtimes: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
        "eager": torch_run(module)
    }
    extra: dict[str, Any] = {}
    if "onnxruntime" in args.runtimes:
        sys.path.append(args.ort_site)
        import onnxruntime as ort

        onnx_path = Path(tempfile.mkdtemp()) / "minilm.onnx"
        x = torch.ones((2, 16), dtype=torch.long)
        torch.onnx.export(
            module, (x, x), str(onnx_path), input_names=["input_ids", "attention_mask"],
            output_names=["embedding"], opset_version=17, dynamo=False,
            dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}},
        )  # fmt: skip
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        runtimes["onnxruntime"] = lambda i, a: np.asarray(
            sess.run(None, {"input_ids": i, "attention_mask": a})[0]
        )
        extra["onnxruntime"] = ort.__version__
    if "torch.compile" in args.runtimes:
        t0 = time.perf_counter()
        compiled = torch.compile(module, dynamic=True)
        chunked(ids, torch_run(compiled))
        extra["compile_first_call_s"] = time.perf_counter() - t0
        runtimes["torch.compile"] = torch_run(compiled)
    if "int8" in args.runtimes:
        # Dynamic int8 quantisation of the linear layers (weights int8, activations quantised
        # per batch): the usual CPU serving recipe for BERT-size encoders.
        quantized = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(module), {torch.nn.Linear}, dtype=torch.qint8
        )
        runtimes["int8"] = torch_run(quantized)
    ref = chunked(ids, runtimes["eager"])
    out: dict[str, Any] = {
        **report.provenance(),
        "questions": args.questions,
        **extra,
        "torch": torch.__version__,
        "load_average_before": os.getloadavg(),
        "runtimes": {},
    }
    for name, fn in runtimes.items():
        emb = chunked(ids, fn)
        same = 0
        for q in range(args.questions):
            a, b = ref[q * 11 : (q + 1) * 11], emb[q * 11 : (q + 1) * 11]
            same += list(np.argsort(-(a[1:] @ a[0]))) == list(np.argsort(-(b[1:] @ b[0])))
        out["runtimes"][name] = {
            "max_abs_diff": float(np.abs(ref - emb).max()),
            "min_cosine": float((ref * emb).sum(1).min()),
            "identical_rankings": same,
            "cpu_ms_per_request": [],
        }
    for _ in range(args.rounds):
        for name, fn in runtimes.items():
            c0 = time.thread_time()
            chunked(ids, fn)
            ms = 1000 * (time.thread_time() - c0) / args.questions
            out["runtimes"][name]["cpu_ms_per_request"].append(round(ms, 1))
            print(f"{name}: {ms:.0f} CPU ms a 10-passage request", flush=True)
    out["load_average_after"] = os.getloadavg()
    return out


def main() -> int:
    ap = report.parser("dense_runtimes", __doc__, data=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ort-site", default="/tmp/ort-site", help="where onnxruntime is installed")
    ap.add_argument("--runtimes", type=lambda v: v.split(","),
                    default=["onnxruntime", "torch.compile", "int8"],
                    help="beside eager: onnxruntime, torch.compile, int8")  # fmt: skip
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
