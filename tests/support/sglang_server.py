"""An HTTP server that answers as SGLang's does, on a real model, for the SGLang dialect's tests.

SGLang itself does not run on this project's CPU machines (its wheel pins CUDA 13 kernels;
docs/remote-engine.md#sglang), so ``tests/service/test_remote_sglang.py`` runs against this
process instead: a real FastAPI/uvicorn server whose routes take and answer what SGLang's own
definitions say (``sgl-project/sglang`` 0.5.23), with log-probs computed by transformers on
the model folder given (the tests' tiny random Llama):

- ``POST /generate`` (``http_server.py``; ``io_struct.py`` ``GenerateReqInput``): ``text`` or
  ``input_ids``, each one prompt or a batch (a batch is answered with a JSON array);
  ``sampling_params`` (``max_new_tokens`` >= 0, ``temperature`` 0 when it generates,
  ``stop_token_ids``), ``return_logprob``, ``logprob_start_len`` (-1: output log-probs only;
  above the prompt's length: refused), ``return_text_in_logprobs``. Text is encoded with the
  tokenizer's special tokens (``tokenizer.encode``). An item is ``{"text", "output_ids",
  "meta_info"}``; ``meta_info.input_token_logprobs`` holds ``[logprob, token_id, text|null]``
  for positions ``logprob_start_len..n-1``, the first log-prob ``null``, and ids from the
  vocabulary's last on clipped to 0 (``scheduler_components/logprob_result_processor.py``);
  ``output_token_logprobs`` the same for generated tokens; ``finish_reason``
  ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``;
  ``cached_tokens``: the longest prefix shared with an earlier prompt, at most
  ``min(logprob_start_len, n - 1)`` when log-probs are asked (``schedule_batch.py``
  ``_compute_max_prefix_len``), so the radix cache's reuse can be counted;
- a prompt of ``context_length`` tokens or more is refused with 400, as SGLang's tokenizer
  manager does;
- ``GET /v1/models`` (``id``, ``max_model_len``), ``GET /model_info`` and ``/get_model_info``
  (``model_path``, ``served_model_name``, ``is_generation``), ``GET /health``.

Beside them, one route that is not SGLang's: ``POST /_test/quirk`` with ``{"quirk": name}``
makes every later scoring answer misbehave as a real deployment has (``none``: as SGLang;
``legacy``: no null first row, as releases whose tests say ``prompt_tokens ==
logprob_start_len + 1 + len(rows)``; ``cache_partial``: the first two rows missing, as a
client reported on cache hits; ``short``: the last row missing; ``wrong_token``: one row
names another token).

    python -m tests.support.sglang_server --model DIR --port 30000 [--served-model-name NAME]
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from transformers import AutoModelForCausalLM, AutoTokenizer

QUIRKS = frozenset({"none", "legacy", "cache_partial", "short", "wrong_token"})
_HISTORY = 512  # earlier prompts remembered for cached_tokens


class Engine:
    """The model and the per-server state (quirk, earlier prompts) behind the routes."""

    def __init__(self, model_dir: str, served: str, context: int) -> None:
        self.model_dir = model_dir
        self.served = served
        self.context = context
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.quirk = "none"
        self.history: list[list[int]] = []
        self.lock = threading.Lock()  # one forward at a time, as one GPU would

    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]`` next-token log-probs after each prefix of ``ids``."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def cached(self, ids: list[int], limit: int) -> int:
        best = 0
        for old in self.history:
            k = 0
            for a, b in zip(old, ids, strict=False):
                if a != b:
                    break
                k += 1
            best = max(best, k)
        self.history = [*self.history[-(_HISTORY - 1) :], list(ids)]
        return min(best, limit)

    def row(self, value: float | None, token: int, text: bool) -> list[Any]:
        token = token if token < self.vocab_size - 1 else 0
        return [value, token, self.tokenizer.decode([token]) if text else None]

    def one(
        self, ids: list[int], params: dict[str, Any], logprob: bool, start: int, text: bool
    ) -> dict[str, Any]:
        n = len(ids)
        steps = int(params.get("max_new_tokens", 128))
        if steps < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {steps}.")
        if steps and float(params.get("temperature", 1.0)) != 0.0:
            raise ValueError("this test server decodes greedily only (temperature 0)")
        if n >= self.context:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context} tokens)."
            )
        if logprob and start > n:
            raise ValueError(
                f"logprob_start_len={start} is higher than the number of input tokens {n}."
            )
        stops = {int(t) for t in params.get("stop_token_ids") or []}
        if self.tokenizer.eos_token_id is not None and not params.get("ignore_eos"):
            stops.add(int(self.tokenizer.eos_token_id))
        with self.lock:
            lsm = self.log_softmax(ids)
            cached = self.cached(ids, min(start, n - 1) if logprob and start >= 0 else n - 1)
            out: list[int] = []
            out_lp: list[float] = []
            finish: dict[str, Any] = {"type": "length", "length": steps}
            last = lsm[-1]
            while len(out) < steps:
                token = int(torch.argmax(last))
                out.append(token)
                out_lp.append(float(last[token]))
                if token in stops:
                    finish = {"type": "stop", "matched": token}
                    break
                last = self.log_softmax(ids + out)[-1]
        meta: dict[str, Any] = {
            "id": f"{threading.get_ident()}-{len(self.history)}",
            "finish_reason": finish,
            "prompt_tokens": n,
            "completion_tokens": len(out),
            "cached_tokens": cached,
        }
        if logprob:
            rows: list[list[Any]] = []
            if start >= 0:
                rows = [
                    self.row(None if p == start else float(lsm[p - 1, ids[p]]), ids[p], text)
                    for p in range(start, n)
                ]
                rows = self.misbehave(rows)
            meta["input_token_logprobs"] = rows
            meta["output_token_logprobs"] = [
                self.row(v, t, text) for v, t in zip(out_lp, out, strict=True)
            ]
        return {
            "text": self.tokenizer.decode(out, skip_special_tokens=False),
            "output_ids": out,
            "meta_info": meta,
        }

    def misbehave(self, rows: list[list[Any]]) -> list[list[Any]]:
        if self.quirk == "legacy":
            return rows[1:]
        if self.quirk == "cache_partial":
            return rows[2:]
        if self.quirk == "short":
            return rows[:-1]
        if self.quirk == "wrong_token" and len(rows) > 1:
            k = len(rows) // 2
            rows[k] = [rows[k][0], (int(rows[k][1]) + 1) % (self.vocab_size - 1), rows[k][2]]
        return rows


def _per_prompt(value: Any, count: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"expected {count} values, got {len(value)}")
        return value
    return [value] * count


def _answer(engine: Engine, body: dict[str, Any], prompts: list[Any]) -> list[dict[str, Any]]:
    """Each prompt's item, in order (off the event loop: the forwards block)."""
    count = len(prompts)
    params = _per_prompt(body.get("sampling_params"), count, {})
    logprob = _per_prompt(body.get("return_logprob"), count, False)
    starts = _per_prompt(body.get("logprob_start_len"), count, -1)
    text_rows = bool(body.get("return_text_in_logprobs", False))
    return [
        engine.one([int(t) for t in p], sp, bool(lp), int(s), text_rows)
        for p, sp, lp, s in zip(prompts, params, logprob, starts, strict=True)
    ]


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI()

    def error(message: str) -> JSONResponse:
        # SGLang's _create_error_response: an OpenAI-style error object, 400.
        body = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
        return JSONResponse(body, status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(None)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_dir,
            "served_model_name": engine.served,
            "tokenizer_path": engine.model_dir,
            "is_generation": True,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.served,
            "object": "model",
            "owned_by": "sglang",
            "root": engine.served,
            "max_model_len": engine.context,
        }
        return {"object": "list", "data": [card]}

    @app.post("/_test/quirk")
    async def quirk(request: Request) -> dict[str, str]:
        name = (await request.json()).get("quirk")
        if name not in QUIRKS:
            return {"error": f"unknown quirk {name!r}"}
        engine.quirk = name
        return {"quirk": name}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            return error("Either text or input_ids should be provided.")
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else list(text)
            prompts = [engine.tokenizer.encode(t) for t in texts]
        else:
            single = bool(input_ids) and not isinstance(input_ids[0], list)
            prompts = [input_ids] if single else list(input_ids)
        try:
            out = await run_in_threadpool(_answer, engine, body, prompts)
        except ValueError as exc:
            return error(str(exc))
        return JSONResponse(out[0] if single else out)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--context-length", type=int, default=2048)
    args = parser.parse_args()
    engine = Engine(args.model, args.served_model_name or args.model, args.context_length)
    uvicorn.run(build_app(engine), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
