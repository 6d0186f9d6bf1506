"""The report of ``eval --generator-url``: each variant's accuracy, its paired comparisons with
the retriever's order and a shuffle, and the verdict in one sentence, honest when the data
cannot tell (then: how many questions would, or that the difference is probably below
``DETECTABLE``).

Rules decided here (docs/evaluation.md, "Your generator, your questions"):

- **Evidence on both counts**: "helps" (or "hurts") needs the paired bootstrap interval to
  exclude 0 *and* the paired test (``stats.paired_test``: the exact sign test on a binary
  metric) to reject at 0.05; when they disagree the verdict says so, with the wins and losses.
- **One set of questions**: every comparison is on the questions that every compared variant
  (one with at least one answer) answered; the report says how many were left out and why
  (a variant's order refused or failed, or not asked yet).
- **Planning**: the questions a difference of ``DETECTABLE`` needs (95% level, 80% power) use
  the variance of the paired differences under that effect, from their observed second moment
  m2 = mean(d^2) (the discordant share, for a binary metric): n = (z_a sqrt(m2) + z_b sqrt(m2 -
  DETECTABLE^2))^2 / DETECTABLE^2 (Connor's McNemar sample size), m2 at least DETECTABLE^2.
  When that n is no more than the questions answered, more questions would not help: the
  difference is probably below ``DETECTABLE``, and the verdict says that instead.
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
from offline.evaluation.stats import bootstrap_mean_ci, paired_comparison, paired_test
from offline.generator_api import GeneratorEndpoint, public_url
from service.prompting.templates import PromptTemplate

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOT_FILE = "accuracy.png"
DETECTABLE = 0.05
"""The accuracy difference the verdict sizes a larger evaluation for, when this one cannot tell."""
ALPHA = 0.05
"""The level the paired test must reach for "helps" or "hurts"."""
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
    test: str
    """The test ``p_value`` comes from (``stats.paired_test``)."""
    wins: int
    losses: int
    questions_needed: int | None
    """Questions that would show a ``DETECTABLE`` difference (module rules: always more than
    ``n``); None when this evaluation tells, nothing varied, or the difference is probably
    below ``DETECTABLE``."""
    sentence: str
    short: str
    """The verdict in a table cell: ``helps``, ``hurts``, ``no change``, ``cannot tell``,
    ``probably below 0.05``."""


def questions_needed(diffs: Sequence[float], detectable: float = DETECTABLE) -> int | None:
    """The paired sample size that detects ``detectable`` (module rules); None when no
    difference is non-zero."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0 or not np.any(d != 0):
        return None
    m2 = max(float(np.mean(d**2)), detectable**2)
    root = _Z_LEVEL * math.sqrt(m2) + _Z_POWER * math.sqrt(m2 - detectable**2)
    return math.ceil(root**2 / detectable**2)


def verdict(
    variant: str,
    baseline: str,
    pairs: Sequence[tuple[float, float]],
    *,
    resamples: int,
    metric: str = "accuracy",
) -> Verdict:
    """The paired comparison of ``variant`` against ``baseline``, in words (module rules)."""
    cmp = paired_comparison(metric, variant, baseline, pairs, resamples=resamples)
    diffs = [a - b for a, b in pairs]
    p, test = paired_test(diffs)
    against = "your retriever's order" if baseline == "retriever" else f"a {baseline}"
    head = (
        f"On these {cmp.n} questions, `{variant}` changed {metric} by {cmp.mean_diff:+.3f} "
        f"[{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}] against {against}"
    )
    counts = f"{cmp.wins} wins, {cmp.losses} losses"
    evidence = f"{counts}; {test} p = {p:.2g}"
    interval_says = cmp.ci_low > 0.0 or cmp.ci_high < 0.0
    test_says = p < ALPHA
    needed = None
    if interval_says and test_says:
        if cmp.ci_low > 0.0:
            short, tail = "helps", ": it helps your generator on this data"
        else:
            short = "hurts"
            tail = ": it hurts your generator on this data; do not deploy it as it is"
        tail += f" ({evidence})."
    elif cmp.wins + cmp.losses == 0:
        short = "no change"
        tail = ": no question changed its outcome, so there is nothing to tell apart."
    else:
        name = test.split(",")[0]
        if interval_says:
            why = f"the interval excludes 0 but the {name} does not ({counts}, p = {p:.2g}),"
            why += " so too few questions changed to tell"
        elif test_says:
            why = f"the {name} rejects no difference ({counts}, p = {p:.2g}) but the interval"
            why += " holds 0, so too close to tell"
        else:
            why = f"too close to tell ({evidence})"
        planned = questions_needed(diffs)
        if planned is not None and planned > cmp.n:
            needed = planned
            short = f"cannot tell (~{needed} questions for {DETECTABLE:.2f})"
            tail = (
                f": {why}; about {needed} questions would show a difference of "
                f"{DETECTABLE:.2f} (95% level, 80% power)."
            )
        else:
            short = f"probably below {DETECTABLE:.2f}"
            tail = (
                f": {why}; {planned or 1} questions would show a difference of "
                f"{DETECTABLE:.2f} (95% level, 80% power) and {cmp.n} were answered, so the "
                f"difference is probably below {DETECTABLE:.2f}."
            )
    return Verdict(
        variant,
        baseline,
        cmp.n,
        cmp.mean_diff,
        cmp.ci_low,
        cmp.ci_high,
        p,
        test,
        cmp.wins,
        cmp.losses,
        needed,
        head + tail,
        short,
    )


def build_report(
    job: ReportFor,
    questions: Sequence[EvalQuestion],
    done: Mapping[tuple[str, str], Mapping[str, Any]],
    orderer: str,
    errors: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
    bound: str = "",
) -> dict[str, Any]:
    """The report of what the folder holds for these questions: ``done`` the answered
    (question, variant) pairs, ``errors`` the last refusal or failure of those not answered
    (module rules)."""
    errors = errors or {}
    metric = job.metric or default_metric([len(q.gold) for q in questions])
    key = metric  # accuracy, em or f1: what each record holds (rouge_l is refused earlier)
    ids = [q.id for q in questions]
    value: dict[str, dict[str, float]] = {}
    variants: list[dict[str, Any]] = []
    for t in job.targets:
        ok = [done[(i, t.label)] for i in ids if (i, t.label) in done]
        ok = [r for r in ok if r.get("answer") is not None]
        value[t.label] = {r["question_id"]: float(r[key]) for r in ok}
        bad = [errors[(i, t.label)] for i in ids if (i, t.label) in errors]
        bad = [r for r in bad if r["question_id"] not in value[t.label]]
        refused = [r for r in bad if r.get("error_kind", "refused") == "refused"]
        failed = [r for r in bad if r.get("error_kind") == "failed"]
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
                "refused": len(refused),
                "failed": len(failed),
                "not_asked": len(ids) - len(ok) - len(bad),
                "errors": len(bad),
                "error_example": next((r["error"] for r in refused), None),
                "failure_example": next((r["error"] for r in failed), None),
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
    compared = [t.label for t in job.targets if value[t.label]]
    common = [i for i in ids if all(i in value[label] for label in compared)]
    left_out = _left_out(ids, common, compared, value, errors)
    verdicts: list[Verdict] = []
    for t in job.targets:
        for base in BASELINES:
            if t.label == base or (t.label in BASELINES and base == "retriever"):
                continue
            if common and t.label in compared and base in compared:
                pairs = [(value[t.label][i], value[base][i]) for i in common]
                verdicts.append(
                    verdict(t.label, base, pairs, resamples=job.resamples, metric=metric)
                )
    headline = next((v.sentence for v in verdicts if v.baseline == "retriever"), None)
    if headline is not None and left_out["questions"]:
        headline += f" {left_out['sentence']}"
    return {
        "data": job.data_name,
        "questions": len(questions),
        "generator": {"url": public_url(job.endpoint.base_url), "model": job.endpoint.model},
        "template": job.template.name,
        "orders_from": orderer,
        "orders_bound": bound or None,
        "metric": metric,
        "variants": variants,
        "compared_on": len(common),
        "left_out": left_out,
        "comparisons": [vars(x) for x in verdicts],
        "verdict": headline,
    }


def _left_out(
    ids: Sequence[str],
    common: Sequence[str],
    compared: Sequence[str],
    value: Mapping[str, Mapping[str, float]],
    errors: Mapping[tuple[str, str], Mapping[str, Any]],
) -> dict[str, Any]:
    """The questions outside the comparisons and why: per variant, how many it failed,
    was refused, or has not been asked yet (a budget or an interruption stopped the run)."""
    kept = set(common)
    why: dict[str, dict[str, int]] = {}
    for i in ids:
        if i in kept:
            continue
        for label in compared:
            if i in value[label]:
                continue
            rec = errors.get((i, label))
            kind = "not asked" if rec is None else str(rec.get("error_kind", "refused"))
            counts = why.setdefault(label, {})
            counts[kind] = counts.get(kind, 0) + 1
    n = len(ids) - len(common)
    parts = [
        f"`{label}` {kind} on {count}"
        for label, counts in why.items()
        for kind, count in sorted(counts.items())
    ]
    sentence = (
        f"{n} of {len(ids)} questions are left out of the comparisons ({'; '.join(parts)}): "
        "a rerun asks them again."
        if n
        else ""
    )
    return {"questions": n, "why": why, "sentence": sentence}


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
    if report.get("orders_bound"):
        lines += [f"Reorder calls: {report['orders_bound']}.", ""]
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
            + "".join(f" ({v[k]} {k})" for k in ("failed", "refused") if v.get(k))
            + f" | {acc} | {_fmt(v['gold_mean_slot'])} | {_fmt(v['reorder_s_mean'])} "
            f"| {_fmt(v['model_prompts_mean'])} | {_fmt(v['model_prompt_tokens_mean'])} |"
        )
    lines += [
        "",
        f"Compared on the {report['compared_on']} questions every compared variant answered.",
        "",
        "| variant | against | n | difference [95%, paired] | wins / losses | p (test) | verdict |",
        "|---|---|---:|---|---:|---|---|",
    ]
    for c in report["comparisons"]:
        lines.append(
            f"| `{c['variant']}` | {c['baseline']} | {c['n']} | {c['diff']:+.3f} "
            f"[{c['low']:+.3f}, {c['high']:+.3f}] | {c['wins']} / {c['losses']} "
            f"| {c['p_value']:.2g} ({c['test']}) | {c['short']} |"
        )
    if report["left_out"]["questions"]:
        lines += ["", report["left_out"]["sentence"]]
    for v in report["variants"]:
        name = f"`{v['variant']}`"
        if v.get("failed"):
            lines += ["", f"{name} failed {v['failed']} times, e.g. {v['failure_example']}"]
        if v.get("refused"):
            lines += ["", f"{name} was refused {v['refused']} times, e.g. {v['error_example']}"]
    out.mkdir(parents=True, exist_ok=True)
    md = out / REPORT_MD
    md.write_text("\n".join(lines) + "\n")
    js = out / REPORT_JSON
    js.write_text(json.dumps(report, indent=1) + "\n")
    return (js, md, write_comparison_plot(out / PLOT_FILE, report))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"
