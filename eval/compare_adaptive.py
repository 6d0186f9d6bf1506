"""MoI's adaptive design paired against its default design on the same questions
(eval/adaptive.sh makes the adaptive records; the default design's are the committed ones).

    python eval/compare_adaptive.py --out results/eval/adaptive/comparison

Per set (NQ-Open dev, HotpotQA dev; SmolLM2 scoring and answering; 10 passages; both placed
``bias_matched``), the questions both have:

- accuracy of each, and the paired difference (adaptive - default) with its 95% paired
  bootstrap interval and the issue's bar: the interval's low end above -0.03;
- prompt tokens and prompts per request, and their ratio (target: tokens <= 0.5x);
- how the adaptive design stopped (settled in round k, or the budget), the confidence it
  reached, and the stop rule's error checked on data: among requests it stopped as settled,
  how often its top passage is a gold passage, against the default design's top passage
  (its ``descending_utility`` order's first) on the same questions.

Writes ``<out>.json`` and ``<out>.md`` and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.records import CACHE_FILE, Record, RecordCache
from offline.evaluation.stats import bootstrap_mean_ci, paired_comparison

RESAMPLES = 10_000
ADAPTIVE = "moi:adaptive:bias_matched"
DEFAULT = "moi:pruned_random:bias_matched"
DEFAULT_RANKING = "moi:pruned_random:descending_utility"
SHUFFLE = "shuffle"
BAR = -0.03


def records(folder: Path, variants: set[str]) -> dict[tuple[str, str], Record]:
    out: dict[tuple[str, str], Record] = {}
    caches = [folder] if (folder / "run.json").is_file() else sorted(folder.glob("shard-*"))
    for f in caches:
        for rec in RecordCache(f / CACHE_FILE).written():
            if (
                isinstance(rec, Record)
                and rec.key.max_passages == 10
                and rec.key.variant in variants
                and rec.status == "ok"
            ):
                out[(rec.key.question_id, rec.key.variant)] = rec
    return out


def top_is_gold(rec: Record, first: int) -> float:
    return float(first in rec.gold)


def compare(name: str, adaptive_dir: Path, default_dir: Path) -> dict[str, Any]:
    ad = records(adaptive_dir, {ADAPTIVE})
    base = records(default_dir, {DEFAULT, DEFAULT_RANKING, SHUFFLE})
    qs = sorted(
        q
        for (q, _) in ad
        if (q, DEFAULT) in base
        and ad[(q, ADAPTIVE)].accuracy is not None
        and base[(q, DEFAULT)].accuracy is not None
    )
    a = [ad[(q, ADAPTIVE)] for q in qs]
    d = [base[(q, DEFAULT)] for q in qs]
    acc = paired_comparison(
        "accuracy",
        ADAPTIVE,
        DEFAULT,
        [(float(x.accuracy or 0.0), float(y.accuracy or 0.0)) for x, y in zip(a, d, strict=True)],
        resamples=RESAMPLES,
    )

    shuffled = [q for q in qs if (q, SHUFFLE) in base]
    vs_shuffle = paired_comparison(
        "accuracy",
        ADAPTIVE,
        SHUFFLE,
        [
            (float(ad[(q, ADAPTIVE)].accuracy or 0.0), float(base[(q, SHUFFLE)].accuracy or 0.0))
            for q in shuffled
        ],
        resamples=RESAMPLES,
    )

    def slot(rs: list[Record]) -> float:
        ranks = [r.gold_rank_best for r in rs if r.gold_rank_best is not None]
        return sum(ranks) / len(ranks) if ranks else float("nan")

    def cost(rs: list[Record], field: str) -> float:
        return sum(float(getattr(r.cost, field)) for r in rs if r.cost is not None) / len(rs)

    tok_a, tok_d = cost(a, "prompt_tokens"), cost(d, "prompt_tokens")
    ratio = bootstrap_mean_ci(
        [
            float(x.cost.prompt_tokens) / float(y.cost.prompt_tokens)
            for x, y in zip(a, d, strict=True)
            if x.cost is not None and y.cost is not None
        ],
        resamples=RESAMPLES,
    )
    stops = Counter(
        f"{r.adaptive['stopped']} (round {r.adaptive['rounds']})" if r.adaptive else "unknown"
        for r in a
    )
    # The stop rule on data: the settled leader is a gold passage how often, against the
    # default design's top passage on the same questions.
    settled = [
        (r, q)
        for r, q in zip(a, qs, strict=True)
        if r.adaptive and r.adaptive["stopped"] == "settled"
    ]
    def_top = {
        q: base[(q, DEFAULT_RANKING)].order[0]  # type: ignore[index]
        for q in qs
        if (q, DEFAULT_RANKING) in base and base[(q, DEFAULT_RANKING)].order
    }
    gold_q = [q for q, r in zip(qs, a, strict=True) if r.gold and r.ranking and q in def_top]
    top_gold_a = [top_is_gold(ad[(q, ADAPTIVE)], ad[(q, ADAPTIVE)].ranking[0]) for q in gold_q]  # type: ignore[index]
    top_gold_d = [top_is_gold(ad[(q, ADAPTIVE)], def_top[q]) for q in gold_q]
    settled_gold = [
        top_is_gold(r, r.ranking[0])
        for r, q in settled
        if r.gold and r.ranking  # type: ignore[index]
    ]
    settled_gold_d = [top_is_gold(r, def_top[q]) for r, q in settled if r.gold and q in def_top]
    conf = [float(r.adaptive["confidence"]) for r in a if r.adaptive]
    return {
        "set": name,
        "questions": len(qs),
        "accuracy_adaptive": sum(float(r.accuracy or 0.0) for r in a) / len(a),
        "accuracy_default": sum(float(r.accuracy or 0.0) for r in d) / len(d),
        "paired": {
            "mean": acc.mean_diff,
            "low": acc.ci_low,
            "high": acc.ci_high,
            "p": acc.p_value,
            "wins": acc.wins,
            "losses": acc.losses,
            "meets_bar": acc.ci_low > BAR,
        },
        "against_shuffle": {
            "n": vs_shuffle.n,
            "mean": vs_shuffle.mean_diff,
            "low": vs_shuffle.ci_low,
            "high": vs_shuffle.ci_high,
            "p": vs_shuffle.p_value,
        },
        "gold_slot_adaptive": slot(a),
        "gold_slot_default": slot(d),
        "prompt_tokens_adaptive": tok_a,
        "prompt_tokens_default": tok_d,
        "prompt_tokens_ratio": {"mean": ratio.mean, "low": ratio.low, "high": ratio.high},
        "prompts_adaptive": cost(a, "prompts_scored"),
        "prompts_default": cost(d, "prompts_scored"),
        "stops": dict(sorted(stops.items())),
        "confidence_mean": sum(conf) / len(conf) if conf else None,
        "top_is_gold": {
            "questions": len(gold_q),
            "adaptive": sum(top_gold_a) / len(gold_q) if gold_q else None,
            "default": sum(top_gold_d) / len(gold_q) if gold_q else None,
            "settled_requests": len(settled_gold),
            "settled_adaptive": sum(settled_gold) / len(settled_gold) if settled_gold else None,
            "settled_default": (
                sum(settled_gold_d) / len(settled_gold_d) if settled_gold_d else None
            ),
        },
    }


def pooled_pairs(adaptive_dir: Path, default_dir: Path) -> dict[str, Any]:
    """Every question of both sets, paired: the bar applied to the whole evaluation."""
    pairs = []
    for s in ("nq_open_dev", "hotpot_dev"):
        if not (adaptive_dir / s).is_dir():
            continue
        ad = records(adaptive_dir / s, {ADAPTIVE})
        base = records(default_dir / s, {DEFAULT})
        for q, _ in ad:
            a, d = ad[(q, ADAPTIVE)], base.get((q, DEFAULT))
            if d is not None and a.accuracy is not None and d.accuracy is not None:
                pairs.append((float(a.accuracy), float(d.accuracy)))
    c = paired_comparison("accuracy", ADAPTIVE, DEFAULT, pairs, resamples=RESAMPLES)
    return {
        "n": c.n,
        "mean": c.mean_diff,
        "low": c.ci_low,
        "high": c.ci_high,
        "p": c.p_value,
        "wins": c.wins,
        "losses": c.losses,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| set | questions | accuracy adaptive | accuracy default | paired difference [95%] "
        "| above -0.03? | prompt tokens adaptive / default | ratio [95%] | prompts |",
        "|---|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for r in rows:
        p, t = r["paired"], r["prompt_tokens_ratio"]
        out.append(
            f"| {r['set']} | {r['questions']} | {r['accuracy_adaptive']:.3f} "
            f"| {r['accuracy_default']:.3f} | {p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] "
            f"(wins {p['wins']}, losses {p['losses']}) | {'yes' if p['meets_bar'] else 'no'} "
            f"| {r['prompt_tokens_adaptive']:.0f} / {r['prompt_tokens_default']:.0f} "
            f"| {t['mean']:.3f} [{t['low']:.3f}, {t['high']:.3f}] "
            f"| {r['prompts_adaptive']:.1f} / {r['prompts_default']:.1f} |"
        )
    out += [
        "",
        "| set | adaptive against shuffle [95%] | gold passage's mean slot: adaptive / default |",
        "|---|---|---|",
    ]
    for r in rows:
        v = r["against_shuffle"]
        out.append(
            f"| {r['set']} | {v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}], "
            f"p = {v['p']:.2g} (n {v['n']}) "
            f"| {r['gold_slot_adaptive']:.2f} / {r['gold_slot_default']:.2f} |"
        )
    out += [
        "",
        "| set | how it stopped | mean confidence reached | top passage is gold: adaptive "
        "/ default (all) | settled requests: adaptive / default |",
        "|---|---|---:|---|---|",
    ]
    for r in rows:
        g = r["top_is_gold"]
        stops = ", ".join(f"{k}: {v}" for k, v in r["stops"].items())

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}"

        out.append(
            f"| {r['set']} | {stops} | {f(r['confidence_mean'])} "
            f"| {f(g['adaptive'])} / {f(g['default'])} ({g['questions']}) "
            f"| {f(g['settled_adaptive'])} / {f(g['settled_default'])} ({g['settled_requests']}) |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adaptive", default="results/eval/adaptive", type=Path)
    ap.add_argument("--default", default="results/eval", type=Path)
    ap.add_argument("--out", default="results/eval/adaptive/comparison", type=Path)
    args = ap.parse_args()
    rows = [
        compare(s, args.adaptive / s, args.default / s)
        for s in ("nq_open_dev", "hotpot_dev")
        if (args.adaptive / s).is_dir()
    ]
    pooled = pooled_pairs(args.adaptive, args.default)
    result = {"sets": rows, "pooled": pooled}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(rows) + (
        f"\nBoth sets pooled ({pooled['n']} questions): {pooled['mean']:+.3f} "
        f"[{pooled['low']:+.3f}, {pooled['high']:+.3f}] (wins {pooled['wins']}, losses "
        f"{pooled['losses']}); above -0.03: {'yes' if pooled['low'] > BAR else 'no'}.\n"
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
