"""The table across scorer/generator pairings (issue 20): one variant against named baselines.

Reads each evaluation folder's ``cache.jsonl`` (every finished record of ``rag-reorder eval``),
keeps the questions on which the variant and every baseline finished, and pairs them per
question: mean difference, 95% paired bootstrap interval and Wilcoxon signed-rank p, for
the answer's accuracy and the gold answer's log-likelihood per token under the generator. No
model is loaded, so it runs in seconds on whatever part of a run has finished.

    .venv/bin/python eval/pairings.py results/eval/nq_open_dev \
        results/eval/nq_open_dev__smollm2-135m__gemma-3-270m \
        --variant moi:pruned_random:bias_matched \
        --baselines shuffle,retriever,dense:litm,query_likelihood
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.stats import PairedComparison, paired_comparison

METRICS = ("accuracy", "gold_logprob_per_token")
LABELS = {"accuracy": "accuracy", "gold_logprob_per_token": "gold LL/token"}


@dataclass(frozen=True)
class Pairing:
    """One folder's comparisons: who scored, who answered, on how many questions."""

    folder: str
    scorer: str
    generator: str
    questions: int
    means: dict[str, dict[str, float]]  # variant -> metric -> mean over the paired questions
    comparisons: list[PairedComparison]


def load(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """``cache.jsonl``'s finished (``ok``) records as question id -> variant -> record."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with (folder / "cache.jsonl").open() as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("status") == "ok" and rec.get("key", {}).get("variant"):
                out.setdefault(rec["key"]["question_id"], {})[rec["key"]["variant"]] = rec
    return out


def compare(
    folder: Path, variant: str, baselines: Sequence[str], *, resamples: int, seed: int = 0
) -> Pairing:
    """``variant`` against each baseline on the questions where all of them finished.

    A baseline the folder's run never had (no question holds it: a variant added after the
    run) is left out of the pairing and shows as "not run", rather than emptying the row."""
    by_question = load(folder)
    ran = {v for recs in by_question.values() for v in recs}
    if variant not in ran:
        raise SystemExit(f"{folder}: no question has {variant} finished")
    wanted = (variant, *(b for b in baselines if b in ran))
    rows = [recs for recs in by_question.values() if all(v in recs for v in wanted)]
    if not rows:
        raise SystemExit(f"{folder}: no question has {', '.join(wanted)} finished")
    key = rows[0][variant]["key"]
    means = {v: {m: sum(float(r[v][m]) for r in rows) / len(rows) for m in METRICS} for v in wanted}
    comparisons = [
        paired_comparison(
            m,
            variant,
            base,
            [(float(r[variant][m]), float(r[base][m])) for r in rows],
            resamples=resamples,
            seed=seed,
        )
        for base in wanted[1:]
        for m in METRICS
    ]
    return Pairing(folder.name, key["scorer"], key["generator"], len(rows), means, comparisons)


def markdown(pairings: Sequence[Pairing], variant: str, baselines: Sequence[str]) -> str:
    """One row per pairing and metric: the variant's mean, then its difference to each
    baseline with interval and p."""
    head = f"| scorer → generator | n | metric | `{variant}` | " + " | ".join(
        f"vs `{b}`" for b in baselines
    )
    lines = [head + " |", "|---|---:|---|---:|" + "---|" * len(baselines)]
    for p in pairings:
        pair = f"{_short(p.scorer)} → {_short(p.generator)}"
        for m in METRICS:
            cells = []
            for b in baselines:
                c = next((c for c in p.comparisons if c.baseline == b and c.metric == m), None)
                cells.append(
                    "not run"
                    if c is None
                    else f"{c.mean_diff:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] p={_p(c.p_value)}"
                )
            lines.append(
                f"| {pair} | {p.questions} | {LABELS[m]} | {p.means[variant][m]:.3f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def _short(model: str) -> str:
    return model.rsplit("/", 1)[-1]


def _p(p: float) -> str:
    return f"{p:.0e}" if p < 1e-3 else f"{p:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="evaluation folders (cache.jsonl)")
    ap.add_argument("--variant", default="moi:pruned_random:bias_matched")
    ap.add_argument("--baselines", default="shuffle,retriever,dense:litm,query_likelihood")
    ap.add_argument("--resamples", type=int, default=10_000)
    args = ap.parse_args(argv)
    baselines = [b for b in args.baselines.split(",") if b]
    pairings = [compare(f, args.variant, baselines, resamples=args.resamples) for f in args.folders]
    print(markdown(pairings, args.variant, baselines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
