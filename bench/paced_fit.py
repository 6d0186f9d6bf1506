"""The paced engine's cost model from the committed GPU measurements (issue 57).

For each profile of ``service.backends.fakes.paced.PROFILES``: the engine's streaming rate
(``tokens_per_s``, from a load ceiling where one was measured, else from the per-query calls)
and its fixed cost per call (``overhead_s``: the median over the measured queries of
``direct_s - tokens / tokens_per_s``, at least 0), then the model's error on every measured
query (one call of 20 prompts each, ``bench/scoring.py --warm-each``). Prints the figures the
module holds beside the ones recomputed here; they must agree.

    python -m bench.paced_fit [--out results/bench/paced_fit.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from service.backends.fakes.paced import PROFILES

R = ROOT / "results/bench"
# profile -> (per-query scoring JSON, load JSON with a ceiling or None)
SOURCES: dict[str, tuple[Path, Path | None]] = {
    "h200-transformers-bf16": (R / "gpu_h200_20261127_2/scoring_transformers.json", None),
    "h100-transformers-bf16": (
        R / "gpu_h100_20261127/scoring_transformers.json",
        R / "gpu_h100_20261127/load_transformers.json",
    ),
    "h100-vllm-16384": (
        R / "gpu_h100_20261127/scoring_vllm.json",
        R / "gpu_h100_20261127/load_vllm_16384.json",
    ),
    "h100-transformers-float32": (R / "scoring_cuda_float32.json", None),
}


def fit(scoring: Path, load: Path | None) -> dict[str, Any]:
    rows = json.loads(scoring.read_text())["rows"]
    tokens = sum(r["prompt_tokens"] for r in rows)
    direct = sum(r["direct_s"] for r in rows)
    if load is not None:
        ceiling = json.loads(load.read_text())["ceiling"]
        rate = ceiling["prompt_tokens_per_s"]
        overhead = max(
            0.0, statistics.median(r["direct_s"] - r["prompt_tokens"] / rate for r in rows)
        )
    else:
        rate, overhead = tokens / direct, 0.0
    errors = [(overhead + r["prompt_tokens"] / rate) / r["direct_s"] - 1 for r in rows]
    return {
        "tokens_per_s": rate,
        "overhead_s": overhead,
        "queries": len(rows),
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "max_abs_error": max(abs(e) for e in errors),
        "modelled_over_measured_total": sum(overhead + r["prompt_tokens"] / rate for r in rows)
        / direct,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.paced_fit", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    ok = True
    for name, (scoring, load) in SOURCES.items():
        got = fit(scoring, load)
        held = PROFILES[name]
        agree = (
            abs(held.tokens_per_s / got["tokens_per_s"] - 1) < 0.01
            and abs(held.overhead_s - got["overhead_s"]) < 0.001
        )
        ok &= agree
        out[name] = got | {
            "held_tokens_per_s": held.tokens_per_s,
            "held_overhead_s": held.overhead_s,
            "agree": agree,
        }
        rate, extra = got["tokens_per_s"], got["overhead_s"] * 1e3
        print(
            f"{name}: {rate:,.0f} tok/s + {extra:.1f} ms/call "
            f"(held {held.tokens_per_s:,.0f} + {held.overhead_s * 1e3:.1f}); per-query error "
            f"median {got['median_abs_error']:.0%}, max {got['max_abs_error']:.0%}; total "
            f"modelled/measured {got['modelled_over_measured_total']:.2f}"
            + ("" if agree else "  <- differs from the module")
        )
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
