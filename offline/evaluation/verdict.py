"""The report of ``eval --generator-url``: each variant's accuracy, its paired comparisons with
the retriever's order and a shuffle, and the verdict in one sentence, honest when the data
cannot tell (then: how many questions would).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from offline.evaluation.metrics import MetricName, default_metric
from offline.evaluation.orderers import BASELINES, Target
from offline.evaluation.runner import EvalQuestion
from offline.evaluation.stats import bootstrap_mean_ci, paired_comparison
from offline.generator_api import GeneratorEndpoint
from service.templates import PromptTemplate

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOT_FILE = "accuracy.png"
DETECTABLE = 0.05
"""The accuracy difference the verdict sizes a larger evaluation for, when this one cannot tell."""
_Z_LEVEL = 1.959964  # two-sided 95%
_Z_POWER = 0.841621  # 80% power


class ReportFor(Protocol):
    """What the report needs of the evaluation (``DeployedJob``)."""

    @property
    def endpoint(self) -> GeneratorEndpoint: ...
    @property
    def template(self) -> PromptTemplate: ...
    @property
    def data_name(self) -> str: ...
    @property
    def targets(self) -> tuple[Target, ...]: ...
    @property
    def metric(self) -> MetricName | None: ...
    @property
    def resamples(self) -> int: ...


@dataclass(frozen=True)
class Verdict:
    variant: str
    baseline: str
    n: int
    diff: float
    low: float
    high: float
    p_value: float
    questions_needed: int | None
    """Questions that would show a ``DETECTABLE`` difference at the observed variance (95%
    level, 80% power); None when this evaluation already tells, or nothing varied."""
    sentence: str
    short: str
    """The verdict in a table cell: ``helps``, ``hurts``, ``no change``, ``cannot tell``."""


def questions_needed(diffs: Sequence[float], detectable: float = DETECTABLE) -> int | None:
    """The paired sample size that detects ``detectable`` at the variance of ``diffs``."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return None
    var = float(np.var(d, ddof=1))
    if var == 0.0:
        return None
    return math.ceil((_Z_LEVEL + _Z_POWER) ** 2 * var / detectable**2)


def verdict(
    variant: str,
    baseline: str,
    pairs: Sequence[tuple[float, float]],
    *,
    resamples: int,
    metric: str = "accuracy",
) -> Verdict:
    """The paired comparison of ``variant`` against ``baseline``, in words."""
    cmp = paired_comparison(metric, variant, baseline, pairs, resamples=resamples)
    diffs = [a - b for a, b in pairs]
    needed = questions_needed(diffs) if cmp.ci_low <= 0.0 <= cmp.ci_high else None
    against = "your retriever's order" if baseline == "retriever" else f"a {baseline}"
    head = (
        f"On these {cmp.n} questions, `{variant}` changed {metric} by {cmp.mean_diff:+.3f} "
        f"[{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}] against {against}"
    )
    short = "cannot tell" + (f" (~{needed} questions for 0.05)" if needed else "")
    if cmp.ci_low > 0.0:
        short, tail = "helps", ": it helps your generator on this data."
    elif cmp.ci_high < 0.0:
        short, tail = "hurts", ": it hurts your generator on this data; do not deploy it as it is."
    elif needed is None:
        short = "no change"
        tail = ": no question changed its outcome, so there is nothing to tell apart."
    else:
        more = f"about {needed} questions" if needed > cmp.n else "more questions"
        tail = (
            f": too close to tell; {more} would show a difference of {DETECTABLE:.2f} at the "
            "variance seen here (95% level, 80% power)."
        )
    return Verdict(
        variant,
        baseline,
        cmp.n,
        cmp.mean_diff,
        cmp.ci_low,
        cmp.ci_high,
        cmp.p_value,
        needed,
        head + tail,
        short,
    )


def build_report(
    job: ReportFor,
    questions: Sequence[EvalQuestion],
    done: Mapping[tuple[str, str], Mapping[str, Any]],
    orderer: str,
) -> dict[str, Any]:
    """The report of what the folder holds for these questions."""
    metric = job.metric or default_metric([len(q.gold) for q in questions])
    key = metric  # accuracy, em or f1: what each record holds (rouge_l is refused earlier)
    ids = [q.id for q in questions]
    value: dict[str, dict[str, float]] = {}
    variants: list[dict[str, Any]] = []
    for t in job.targets:
        recs = [done[(i, t.label)] for i in ids if (i, t.label) in done]
        ok = [r for r in recs if r.get("answer") is not None]
        value[t.label] = {r["question_id"]: float(r[key]) for r in ok}
        acc = (
            bootstrap_mean_ci(list(value[t.label].values()), resamples=job.resamples)
            if ok
            else None
        )
        slots = [s for r in ok for s in r.get("gold_slots", [])]
        paths: dict[str, int] = {}
        for r in ok:
            if r.get("auto_path"):
                paths[r["auto_path"]] = paths.get(r["auto_path"], 0) + 1
        variants.append(
            {
                "variant": t.label,
                "request": t.body,
                "answered": len(ok),
                "errors": len(recs) - len(ok),
                "error_example": next((r["error"] for r in recs if r.get("error")), None),
                metric: _interval(acc),
                "gold_mean_slot": round(float(np.mean(slots)), 3) if slots else None,
                "reorder_s_mean": _mean([r["reorder_s"] for r in ok]),
                "model_prompts_mean": _mean([r["reorder_prompts"] for r in ok]),
                "model_prompt_tokens_mean": _mean([r["reorder_prompt_tokens"] for r in ok]),
                "generator_prompt_tokens_mean": _mean(
                    [r["generator_prompt_tokens"] for r in ok if r.get("generator_prompt_tokens")]
                ),
                "auto_paths": paths,
            }
        )
    verdicts: list[Verdict] = []
    for t in job.targets:
        for base in BASELINES:
            if t.label == base or (t.label in BASELINES and base == "retriever"):
                continue
            shared = [i for i in ids if i in value[t.label] and i in value[base]]
            if shared:
                pairs = [(value[t.label][i], value[base][i]) for i in shared]
                verdicts.append(
                    verdict(t.label, base, pairs, resamples=job.resamples, metric=metric)
                )
    headline = next((v.sentence for v in verdicts if v.baseline == "retriever"), None)
    return {
        "data": job.data_name,
        "questions": len(questions),
        "generator": {"url": job.endpoint.base_url, "model": job.endpoint.model},
        "template": job.template.name,
        "orders_from": orderer,
        "metric": metric,
        "variants": variants,
        "comparisons": [vars(x) for x in verdicts],
        "verdict": headline,
    }


def _interval(ci: Any) -> dict[str, float] | None:
    if ci is None:
        return None
    return {"mean": round(ci.mean, 4), "low": round(ci.low, 4), "high": round(ci.high, 4)}


def _mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def write_report(out: Path, report: dict[str, Any]) -> tuple[Path, ...]:
    """``report.json``, ``report.md`` and the plot."""
    from offline.evaluation.plots import write_comparison_plot

    metric = report["metric"]
    lines = [
        f"# Does it help? {report['generator']['model']} on {report['data']}",
        "",
        f"Generator: `{report['generator']['model']}` at {report['generator']['url']} "
        f"(template `{report['template']}`); orders from {report['orders_from']}; "
        f"{report['questions']} questions; metric: {metric}.",
        "",
    ]
    if report["verdict"]:
        lines += [f"**{report['verdict']}**", ""]
    lines += [
        f"| variant | answered | {metric} [95%] | gold passage's mean slot | s / order "
        "| model prompts / order | model prompt tokens / order |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for v in report["variants"]:
        a = v[metric]
        acc = f"{a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}]" if a else "-"
        lines.append(
            f"| `{v['variant']}` | {v['answered']}"
            + (f" ({v['errors']} refused)" if v["errors"] else "")
            + f" | {acc} | {_fmt(v['gold_mean_slot'])} | {_fmt(v['reorder_s_mean'])} "
            f"| {_fmt(v['model_prompts_mean'])} | {_fmt(v['model_prompt_tokens_mean'])} |"
        )
    lines += ["", "| variant | against | n | difference [95%, paired] | p | verdict |"]
    lines += ["|---|---|---:|---|---:|---|"]
    for c in report["comparisons"]:
        lines.append(
            f"| `{c['variant']}` | {c['baseline']} | {c['n']} | {c['diff']:+.3f} "
            f"[{c['low']:+.3f}, {c['high']:+.3f}] | {c['p_value']:.2g} | {c['short']} |"
        )
    refused = [v for v in report["variants"] if v["errors"]]
    for v in refused:
        why = f"e.g. {v['error_example']}"
        lines += ["", f"`{v['variant']}` was refused {v['errors']} times, {why}"]
    out.mkdir(parents=True, exist_ok=True)
    md = out / REPORT_MD
    md.write_text("\n".join(lines) + "\n")
    js = out / REPORT_JSON
    js.write_text(json.dumps(report, indent=1) + "\n")
    return (js, md, write_comparison_plot(out / PLOT_FILE, report))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"
