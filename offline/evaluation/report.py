"""The evaluation's summary: per-variant means, paired comparisons, positional profiles.

``build_summary`` turns the per-question records into numbers; ``write_report`` writes them as
``results.json`` (everything, every per-question record included) and ``summary.md`` (the
tables a reader needs). Means are over the questions where a value exists (``n`` says how
many); comparisons pair questions where both the variant and the baseline have a value.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from offline.evaluation.metrics import METRICS, MetricName
from offline.evaluation.records import (
    Cost,
    PositionalRecord,
    Record,
    SlotResult,
    json_safe,
    record_to_json,
)
from offline.evaluation.stats import (
    DEFAULT_RESAMPLES,
    PairedComparison,
    bootstrap_mean_band,
    mean_stderr,
    paired_comparison,
)
from offline.evaluation.variants import GENERATOR_BIAS

BASELINES = ("shuffle", "retriever")
PLACEMENT_PAIR = ("bias_matched", "descending_utility")
"""MoI's two placements of one fit, compared per design: the variant and its baseline."""
GENERATOR_BIAS_BASELINES = ("descending_utility", "bias_matched")
"""What ``moi:<design>:generator_bias`` (the fit placed by the generator's stored profile) is
compared against: the same fit by utility alone, and placed by the bias it fitted on the
scorer."""
COMPARED: tuple[str, ...] = (*METRICS, "gold_logprob_per_token", "gold_rank_best")
"""Metrics compared against the baselines (higher is better, except ``gold_rank_best``)."""
MEANS: tuple[str, ...] = (
    *COMPARED,
    "gold_rank_mean",
    *(f"strategy_answer_{m}" for m in METRICS),
)
COSTS: tuple[str, ...] = tuple(f.name for f in fields(Cost))
LABELS = {
    "accuracy": "accuracy",
    "em": "EM",
    "f1": "F1",
    "rouge_l": "ROUGE-L",
    "gold_logprob_per_token": "gold LL/token",
    "gold_rank_best": "gold rank",
}


@dataclass(frozen=True)
class VariantSummary:
    variant: str
    strategy: str
    design: str | None
    placement: str | None
    questions: int
    ok: int
    errors: int
    skipped: int
    note: str | None  # "skipped: no profile", or the most frequent error
    means: dict[str, float | None]
    counts: dict[str, int]  # questions behind each mean
    cost: dict[str, float | None]  # mean per question of each ``Cost`` field


@dataclass(frozen=True)
class SlotSummary:
    """Positional runs, gold passage in ``slot`` (1-based): means and standard errors."""

    slot: int
    n: int
    metric: float | None
    metric_se: float | None
    gold_logprob_per_token: float | None
    gold_logprob_per_token_se: float | None
    question_logprob_per_token: float | None
    question_logprob_per_token_se: float | None


@dataclass(frozen=True)
class BiasProfile:
    """MoI's fitted position bias for one design: mean over questions, 95% bootstrap band."""

    design: str
    slots: int
    n: int
    mean: list[float]
    low: list[float]
    high: list[float]


@dataclass(frozen=True)
class Summary:
    metric: MetricName
    variants: list[VariantSummary]
    comparisons: list[PairedComparison]
    # bias_matched against descending_utility per MoI design: one fit, two orders, so the
    # difference is the placement's alone (what RAG_REORDER_PLACEMENT's default rests on).
    placements: list[PairedComparison]
    # moi:<design>:generator_bias against the same fit's GENERATOR_BIAS_BASELINES (a run with
    # a generator other than the scorer; empty otherwise).
    generator_placements: list[PairedComparison]
    positional: list[SlotSummary]
    bias_profiles: list[BiasProfile]

    def variant(self, label: str) -> VariantSummary:
        return next(v for v in self.variants if v.variant == label)


def build_summary(
    records: Sequence[Record],
    positional: Sequence[PositionalRecord],
    metric: MetricName,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Summary:
    """Summarise the records (module docstring)."""
    by_variant: dict[str, list[Record]] = {}
    for r in records:
        by_variant.setdefault(r.variant, []).append(r)
    variants = [_variant_summary(label, recs) for label, recs in by_variant.items()]
    compared = (metric, *(m for m in COMPARED if m != metric))
    comparisons = [
        paired_comparison(m, label, base, pairs, resamples=resamples, seed=seed)
        for base in BASELINES
        if base in by_variant
        for label, recs in by_variant.items()
        if label != base
        for m in compared
        if (pairs := _pairs(recs, by_variant[base], m))
    ]
    placed, against = PLACEMENT_PAIR
    placements = _same_fit(by_variant, placed, (against,), compared, resamples, seed)
    generator_placements = _same_fit(
        by_variant, GENERATOR_BIAS, GENERATOR_BIAS_BASELINES, compared, resamples, seed
    )
    return Summary(
        metric=metric,
        variants=variants,
        comparisons=comparisons,
        placements=placements,
        generator_placements=generator_placements,
        positional=_slot_summaries(positional, metric),
        bias_profiles=_bias_profiles(records, resamples=resamples, seed=seed),
    )


def _same_fit(
    by_variant: Mapping[str, Sequence[Record]],
    placed: str,
    baselines: Sequence[str],
    metrics: Sequence[str],
    resamples: int,
    seed: int,
) -> list[PairedComparison]:
    """Each MoI variant ``moi:<design>:<placed>`` against the same design's
    ``moi:<design>:<baseline>`` variants: one fit placed two ways, so each difference is the
    placement's alone."""
    return [
        paired_comparison(m, label, twin, pairs, resamples=resamples, seed=seed)
        for label, recs in by_variant.items()
        if recs[0].strategy == "moi" and label.endswith(f":{placed}")
        for base in baselines
        if (twin := label.removesuffix(placed) + base) in by_variant
        for m in metrics
        if (pairs := _pairs(recs, by_variant[twin], m))
    ]


def _variant_summary(label: str, recs: Sequence[Record]) -> VariantSummary:
    ok = [r for r in recs if r.status == "ok"]
    skipped = [r for r in recs if r.status == "skipped"]
    errors = [r for r in recs if r.status == "error"]
    note = None
    if skipped:
        reason = Counter(r.error or "" for r in skipped).most_common(1)[0][0]
        note = "skipped: no profile" if "profile" in reason.lower() else f"skipped: {reason}"
    elif errors:
        reason = Counter(r.error or "" for r in errors).most_common(1)[0][0]
        note = f"{len(errors)} error(s): {reason}"
    means: dict[str, float | None] = {}
    counts: dict[str, int] = {}
    for m in MEANS:
        vals = [v for r in ok if (v := r.value(m)) is not None]
        means[m] = float(np.mean(vals)) if vals else None
        counts[m] = len(vals)
    cost: dict[str, float | None] = {}
    for c in COSTS:
        vals = [float(getattr(r.cost, c)) for r in ok if r.cost is not None]
        cost[c] = float(np.mean(vals)) if vals else None
    first = recs[0]
    return VariantSummary(
        variant=label,
        strategy=first.strategy,
        design=first.design,
        placement=first.placement,
        questions=len(recs),
        ok=len(ok),
        errors=len(errors),
        skipped=len(skipped),
        note=note,
        means=means,
        counts=counts,
        cost=cost,
    )


def _pairs(
    variant: Sequence[Record], baseline: Sequence[Record], metric: str
) -> list[tuple[float, float]]:
    base = {r.question_id: r.value(metric) for r in baseline if r.status == "ok"}
    out = []
    for r in variant:
        a = r.value(metric) if r.status == "ok" else None
        b = base.get(r.question_id)
        if a is not None and b is not None:
            out.append((a, b))
    return out


def _slot_summaries(
    positional: Sequence[PositionalRecord], metric: MetricName
) -> list[SlotSummary]:
    per_slot: dict[int, list[SlotResult]] = {}
    for rec in positional:
        if rec.status != "ok":
            continue
        for s in rec.slots:
            per_slot.setdefault(s.slot, []).append(s)
    out = []
    for slot in sorted(per_slot):
        rows = per_slot[slot]
        stats = {}
        for name, field_name in (
            ("metric", metric),
            ("gold_logprob_per_token", "gold_logprob_per_token"),
            ("question_logprob_per_token", "question_logprob_per_token"),
        ):
            vals = [v for s in rows if (v := s.value(field_name)) is not None]
            mean, se = mean_stderr(vals)
            stats[name] = _opt(mean)
            stats[f"{name}_se"] = _opt(se)
        out.append(SlotSummary(slot=slot, n=len(rows), **stats))
    return out


def _bias_profiles(records: Sequence[Record], *, resamples: int, seed: int) -> list[BiasProfile]:
    """One profile per MoI design, one row per question (placements share the fit)."""
    rows: dict[str, dict[str, tuple[float, ...]]] = {}
    for r in records:
        if r.strategy == "moi" and r.status == "ok" and r.position_bias and r.design:
            rows.setdefault(r.design, {}).setdefault(r.question_id, r.position_bias)
    out = []
    for design, per_q in rows.items():
        # Questions with fewer passages have fewer slots: keep the commonest slot count.
        slots = Counter(len(v) for v in per_q.values()).most_common(1)[0][0]
        mat = np.asarray([v for v in per_q.values() if len(v) == slots], dtype=np.float64)
        mat = mat[np.all(np.isfinite(mat), axis=1)]
        if mat.shape[0] == 0:
            continue
        mean, low, high = bootstrap_mean_band(mat, resamples=resamples, seed=seed)
        out.append(
            BiasProfile(
                design=design,
                slots=slots,
                n=int(mat.shape[0]),
                mean=[float(x) for x in mean],
                low=[float(x) for x in low],
                high=[float(x) for x in high],
            )
        )
    return out


def _opt(x: float) -> float | None:
    return x if math.isfinite(x) else None


# --- files ---------------------------------------------------------------------------------


def write_report(
    out_dir: Path,
    meta: Mapping[str, object],
    records: Sequence[Record],
    positional: Sequence[PositionalRecord],
    summary: Summary,
) -> list[Path]:
    """Write ``results.json`` and ``summary.md`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": dict(meta),
        "summary": asdict(summary),
        "records": [record_to_json(r) for r in records],
        "positional_records": [record_to_json(r) for r in positional],
    }
    results = out_dir / "results.json"
    results.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    md = out_dir / "summary.md"
    md.write_text(markdown(meta, summary))
    return [results, md]


def _f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _p(p: float) -> str:
    return f"{p:.3g}" if p >= 1e-3 else f"{p:.1e}"


def markdown(meta: Mapping[str, object], summary: Summary) -> str:
    """The Markdown summary: strategies, paired comparisons, positional runs, bias profiles."""
    metric = summary.metric
    template = f"template `{meta.get('template')}`"
    generator_template = meta.get("generator_template")
    if generator_template is not None and generator_template != meta.get("template"):
        template = (
            f"templates `{meta.get('template')}` (scorer) and `{generator_template}` (generator)"
        )
    out = [
        f"# Evaluation: {meta.get('data') or 'QA set'}",
        "",
        f"Scorer `{meta.get('scorer')}`, generator `{meta.get('generator')}`, {template}, "
        f"{meta.get('questions')} questions, max passages "
        f"{meta.get('max_passages') or 'all'}. Task metric: **{LABELS[metric]}**.",
        "",
        "## Strategies",
        "",
        "Means over the questions each variant answered; cost is per question (the strategy "
        "only, not the generator's answer). Gold rank: 1-based slot of the best-placed gold "
        "passage (lower is nearer the start).",
        "",
        "| variant | ok | "
        + " | ".join(LABELS[m] for m in (metric, *(m for m in COMPARED if m != metric)))
        + " | prompts | tokens scored | tokens generated | wall s | note |",
        "|---|---:|" + "---:|" * (len(COMPARED) + 4) + "---|",
    ]
    order = (metric, *(m for m in COMPARED if m != metric))
    for v in summary.variants:
        digits = {"gold_rank_best": 2, "gold_logprob_per_token": 3}
        cells = [_f(v.means[m], digits.get(m, 3)) for m in order]
        c = v.cost
        out.append(
            f"| {v.variant} | {v.ok}/{v.questions} | "
            + " | ".join(cells)
            + f" | {_f(c['prompts'], 1)} | {_f(c['scored_tokens'], 0)} | "
            f"{_f(c['generated_tokens'], 0)} | {_f(c['wall_s'], 2)} | {v.note or ''} |"
        )
    answered = [v for v in summary.variants if v.counts.get(f"strategy_answer_{metric}")]
    if answered:
        out += [
            "",
            "Strategies that return their own answer, scored like the generator's:",
            "",
            "| variant | " + " | ".join(LABELS[m] for m in METRICS) + " |",
            "|---|" + "---:|" * len(METRICS),
        ]
        for v in answered:
            cells = [_f(v.means[f"strategy_answer_{m}"]) for m in METRICS]
            out.append(f"| {v.variant} | " + " | ".join(cells) + " |")
    paired = (
        "Mean difference (variant - baseline) with a 95% paired bootstrap interval "
        f"({meta.get('resamples')} resamples) and the two-sided Wilcoxon signed-rank "
        "p-value (zero differences dropped; p = 1 when all are zero); n: questions "
        f"paired on {LABELS[metric]}. For gold rank, negative is better."
    )
    for base in BASELINES:
        comps = [c for c in summary.comparisons if c.baseline == base]
        if comps:
            out += ["", f"## Paired against `{base}`", "", paired, ""]
            out += _paired_table(comps, order, metric, lambda label, _: label)
    if summary.placements:
        placed, against = PLACEMENT_PAIR
        out += [
            "",
            f"## MoI placement: `{placed}` against `{against}`",
            "",
            f"The same fit placed two ways, per design (variant `moi:<design>:{placed}`, "
            f"baseline `moi:<design>:{against}`), so each difference is the placement's "
            "alone. " + paired,
            "",
        ]
        out += _paired_table(
            summary.placements, order, metric, lambda label, _: label.split(":")[1], "design"
        )
    if summary.generator_placements:
        out += [
            "",
            f"## MoI placed by the generator's bias: `{GENERATOR_BIAS}`",
            "",
            "The scorer's fit placed `bias_matched` by the generator's stored bias profile "
            f"(variant `moi:<design>:{GENERATOR_BIAS}`) against the same fit placed by "
            "utility alone (`descending_utility`) and by the bias it fitted on the scorer "
            "(`bias_matched`): each difference is the bias profile's alone. " + paired,
            "",
        ]
        out += _paired_table(
            summary.generator_placements,
            order,
            metric,
            lambda label, base: f"{label.split(':')[1]} against `{base.split(':')[2]}`",
            "design",
        )
    if summary.positional:
        out += [
            "",
            "## Gold passage rotated through every slot",
            "",
            "Same distractors in a fixed order; mean ± standard error over questions. Gold LL: "
            "the gold answer's log-likelihood per token under the generator; question LL: the "
            "question's log-likelihood per token under the scoring model.",
            "",
            f"| gold slot | n | {LABELS[metric]} | gold LL/token | question LL/token |",
            "|---:|---:|---:|---:|---:|",
        ]
        for s in summary.positional:
            out.append(
                f"| {s.slot} | {s.n} | {_pm(s.metric, s.metric_se)} | "
                f"{_pm(s.gold_logprob_per_token, s.gold_logprob_per_token_se)} | "
                f"{_pm(s.question_logprob_per_token, s.question_logprob_per_token_se)} |"
            )
    if summary.bias_profiles:
        out += [
            "",
            "## MoI position bias by slot",
            "",
            "Fitted slot weights, mean over questions with a 95% bootstrap band (resampling "
            "questions).",
            "",
            "| design | slots | n | weights: mean [low, high] per slot |",
            "|---|---:|---:|---|",
        ]
        for b in summary.bias_profiles:
            weights = ", ".join(
                f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
                for m, lo, hi in zip(b.mean, b.low, b.high, strict=True)
            )
            out.append(f"| {b.design} | {b.slots} | {b.n} | {weights} |")
    return "\n".join(out) + "\n"


def _paired_table(
    comps: Sequence[PairedComparison],
    order: Sequence[str],
    metric: str,
    name: Callable[[str, str], str],
    head: str = "variant",
) -> list[str]:
    """One row per (variant, baseline), named by ``name(variant, baseline)``: each metric's
    difference, interval and p-value."""
    out = [
        f"| {head} | n | " + " | ".join(LABELS[m] for m in order) + " |",
        "|---|---:|" + "---|" * len(order),
    ]
    for label, base in dict.fromkeys((c.variant, c.baseline) for c in comps):
        row = {c.metric: c for c in comps if (c.variant, c.baseline) == (label, base)}
        cells = []
        for m in order:
            comp = row.get(m)
            cells.append(
                "–"
                if comp is None
                else f"{comp.mean_diff:+.3f} [{comp.ci_low:+.3f}, {comp.ci_high:+.3f}] "
                f"p={_p(comp.p_value)}"
            )
        n = row[metric].n if metric in row else 0
        out.append(f"| {name(label, base)} | {n} | " + " | ".join(cells) + " |")
    return out


def _pm(mean: float | None, se: float | None) -> str:
    if mean is None:
        return "–"
    return f"{mean:.3f}" if se is None else f"{mean:.3f} ± {se:.3f}"
