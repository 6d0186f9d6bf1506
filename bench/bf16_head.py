"""Where does bfloat16's scoring error come from? One question's prompts scored three ways on
the same weights: float32 throughout, bfloat16 throughout, and a bfloat16 body with only the
LM head (and log-softmax) in float32.

If the head were the culprit (logits rounded to bf16's 8-bit mantissa), computing just the
scored rows' head in float32 would be a cheap fix, since the backend only runs the head on
the scored rows. This shows whether it is.

Usage: python -m bench.bf16_head [--prompts 6] [--passages 6] [--out results/bench/bf16_head.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import solver
from bench import report
from bench.report import provenance, write
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.batch.dataset import load_examples
from service.config.settings import Settings
from service.model_assets import resolve_model
from service.prompting.prompts import build_prompts


def query_logprob(
    model: Any, ids: tuple[int, ...], span: tuple[int, int], *, head_float32: bool
) -> float:
    start, end = span
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([ids[:end]])).last_hidden_state
        rows = hidden[0, start - 1 : end - 1]
        if head_float32:
            logits = torch.nn.functional.linear(rows.float(), model.lm_head.weight.float())
        else:
            logits = model.lm_head(rows).float()
        logp = torch.log_softmax(logits, dim=-1)
        return float(logp[torch.arange(end - start), torch.tensor(ids[start:end])].sum())


def main() -> int:
    ap = report.parser("bf16_head", __doc__, data=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--passages", type=int, default=6)
    args = ap.parse_args()
    folder = str(resolve_model(Settings()))
    tok = HFPromptTokenizer(AutoTokenizer.from_pretrained(folder))
    f32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    b16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ex = load_examples(Path(args.data), limit=2)[1]
    passages = ex.passages[: args.passages]
    perms = solver.plan("pruned_random", len(passages), seed=1)
    orders = [tuple(int(p) for p in row) for row in perms][: args.prompts]
    prompts = build_prompts(tok, "qa_default", ex.question, passages, orders)
    rows = []
    for p in prompts:
        ref = query_logprob(f32, p.token_ids, p.query_span, head_float32=False)
        bf = query_logprob(b16, p.token_ids, p.query_span, head_float32=False)
        mixed = query_logprob(b16, p.token_ids, p.query_span, head_float32=True)
        rows.append({"float32": ref, "bfloat16": bf, "bf16_body_fp32_head": mixed})
    shift = {
        k: float(np.median([abs(r[k] - r["float32"]) for r in rows]))
        for k in ("bfloat16", "bf16_body_fp32_head")
    }
    print(
        f"{len(rows)} prompts: median |shift| from float32: bfloat16 {shift['bfloat16']:.3f} "
        f"nats, bf16 body + float32 head {shift['bf16_body_fp32_head']:.3f} nats"
    )
    write({**provenance(), "median_abs_shift": shift, "prompts": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
