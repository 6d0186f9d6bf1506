"""PNG plots of an evaluation summary (matplotlib, headless Agg backend).

- ``bias_by_slot.png``: MoI's fitted slot weights per design, mean and 95% band.
- ``positional_by_slot.png``: task metric, gold-answer and question log-likelihood by the
  gold passage's slot (controlled positional runs), with standard-error bars.
- ``quality_vs_tokens.png``: each variant's task metric against its mean tokens scored per
  question (symlog x axis: the model-free orders score none).

``write_distill_plot`` draws ``rag-reorder distill-eval``'s summary: ``distill.png``, the
generator's accuracy and gold log-likelihood per scorer's order (95% intervals) and each
scorer's prompt tokens per question. ``write_position_curve`` draws ``rag-reorder
profile-generator``'s accuracy by the gold passage's slot.

A plot with nothing to show still gets written, with a note saying why, so the set of files
is the same for every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display, no GUI toolkit

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from offline.evaluation.report import LABELS, Summary
from solver.answer_profile import AnswerProfileFit

_DPI = 110
_MARKERS = ("o", "s", "^", "D", "v", "P")


def write_plots(out_dir: Path, summary: Summary) -> list[Path]:
    """Write the three PNGs (module docstring) into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("bias_by_slot.png", _bias),
        ("positional_by_slot.png", _positional),
        ("quality_vs_tokens.png", _quality),
    ):
        fig = draw(summary)
        path = out_dir / name
        try:
            fig.savefig(path, dpi=_DPI, bbox_inches="tight")
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def _empty(fig: Figure, message: str) -> Figure:
    fig.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def _bias(summary: Summary) -> Figure:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if not summary.bias_profiles:
        ax.set_axis_off()
        return _empty(fig, "no MoI fit in this run")
    for b in summary.bias_profiles:
        slots = list(range(1, b.slots + 1))
        (line,) = ax.plot(slots, b.mean, marker="o", label=f"{b.design} (n={b.n})")
        ax.fill_between(slots, b.low, b.high, color=line.get_color(), alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prompt slot")
    ax.set_ylabel("fitted weight a_j")
    ax.set_title("MoI position bias (mean, 95% bootstrap band over questions)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def _positional(summary: Summary) -> Figure:
    rows = summary.positional
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 3.8))
    if not rows:
        for ax in axes:
            ax.set_axis_off()
        return _empty(fig, "no positional runs in this run")
    slots = [s.slot for s in rows]
    panels = (
        (LABELS[summary.metric], [s.metric for s in rows], [s.metric_se for s in rows]),
        (
            "gold answer LL/token (generator)",
            [s.gold_logprob_per_token for s in rows],
            [s.gold_logprob_per_token_se for s in rows],
        ),
        (
            "question LL/token (scorer)",
            [s.question_logprob_per_token for s in rows],
            [s.question_logprob_per_token_se for s in rows],
        ),
    )
    for ax, (title, means, ses) in zip(axes, panels, strict=True):
        y = [float("nan") if m is None else m for m in means]
        err = [0.0 if e is None else e for e in ses]
        ax.errorbar(slots, y, yerr=err, marker="o", capsize=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("gold passage slot")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Gold passage rotated through every slot (n={max(s.n for s in rows)})")
    return fig


def _quality(summary: Summary) -> Figure:
    fig, ax = plt.subplots(figsize=(9.0, 5.0))
    pts = []
    for v in summary.variants:
        x, y = v.cost["scored_tokens"], v.means[summary.metric]
        if x is None or y is None:
            continue
        gen = v.cost["generated_tokens"] or 0.0
        label = v.variant if gen == 0 else f"{v.variant} (+{gen:.0f} generated)"
        pts.append((label, x, y))
    if not pts:
        ax.set_axis_off()
        return _empty(fig, "no variant answered")
    cmap = plt.get_cmap("tab10")
    colors = [cmap(i) for i in range(10)]
    for k, (label, x, y) in enumerate(pts):
        ax.scatter(
            [x],
            [y],
            color=colors[k % len(colors)],
            marker=_MARKERS[k // len(colors) % len(_MARKERS)],
            label=label,
        )
    ax.set_xscale("symlog", linthresh=100)
    ax.set_xlabel("tokens scored per question (strategy; generated tokens in the legend)")
    ax.set_ylabel(LABELS[summary.metric])
    ax.set_title("Quality against scoring cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def write_distill_plot(out_dir: Path, summary: Mapping[str, Any]) -> Path:
    """``distill.png`` from a distill-eval summary (module docstring); returns its path."""
    # constrained layout keeps the suptitle clear of the middle panel's title
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    quality = summary.get("quality")
    cost = summary.get("cost_per_question")
    if not isinstance(quality, dict) or not isinstance(cost, dict) or not cost:
        _empty(fig, "no complete question yet")
    else:
        for ax, metric, label in (
            (axes[0], "accuracy", "NQ accuracy"),
            (axes[1], "gold_logprob", "gold answer log-lik. / token"),
        ):
            rows = quality.get(metric, {})
            names = list(rows)
            means = [rows[n]["mean"] for n in names]
            err = [
                [rows[n]["mean"] - rows[n]["low"] for n in names],
                [rows[n]["high"] - rows[n]["mean"] for n in names],
            ]
            ax.bar(names, means, yerr=err, capsize=4, color="#8fb3d9")
            ax.set_title(f"generator: {label}")
        names = list(cost)
        axes[2].bar(names, [cost[n]["prompt_tokens"] for n in names], color="#d9a78f")
        axes[2].set_title("scoring prompt tokens / question")
    fig.suptitle(f"preference distillation, {summary.get('questions', 0)} held-out questions")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "distill.png"
    try:
        fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def write_position_curve(path: Path, fit: AnswerProfileFit, *, title: str) -> Path:
    """``rag-reorder profile-generator``'s curve: accuracy by the gold passage's slot with its
    95% bootstrap interval, the smoothed curve the placement weights follow, and the flatness
    test in the title."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    slots = list(range(1, fit.slots + 1))
    err = [
        [a - lo for a, lo in zip(fit.accuracy, fit.low, strict=True)],
        [hi - a for a, hi in zip(fit.accuracy, fit.high, strict=True)],
    ]
    ax.errorbar(slots, fit.accuracy, yerr=err, fmt="o", capsize=3, label="accuracy (95% CI)")
    ax.plot(slots, fit.smoothed, "-", label="smoothed (placement weights)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("slot of the gold passage")
    ax.set_ylabel("answered correctly")
    verdict = "differs from flat" if fit.distinguishable else "not distinguishable from flat"
    ax.set_title(
        f"{title}: {fit.questions} questions, Cochran's Q p = {fit.p_flat:.2g} ({verdict})",
        fontsize="small",
    )
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    try:
        fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def write_comparison_plot(path: Path, report: Mapping[str, Any]) -> Path:
    """``rag-reorder eval --generator-url``'s verdict: each variant's accuracy with its 95%
    interval (left), and each paired difference against the retriever's order and a shuffle
    with its 95% interval (right), zero marked."""
    metric = report["metric"]
    rows = [v for v in report["variants"] if v[metric]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 0.5 * max(3, len(rows)) + 1.4))
    if not rows:
        _empty(fig, "no variant answered yet")
    else:
        names = [v["variant"] for v in rows]
        means = [v[metric]["mean"] for v in rows]
        err = [
            [v[metric]["mean"] - v[metric]["low"] for v in rows],
            [v[metric]["high"] - v[metric]["mean"] for v in rows],
        ]
        left.errorbar(means, range(len(rows)), xerr=err, fmt="o", capsize=3)
        left.set_yticks(range(len(rows)), names)
        left.set_xlabel(f"{metric} (95% CI)")
        left.grid(alpha=0.3)
        comps = list(report["comparisons"])
        labels = [f"{c['variant']} - {c['baseline']}" for c in comps]
        right.errorbar(
            [c["diff"] for c in comps],
            range(len(comps)),
            xerr=[[c["diff"] - c["low"] for c in comps], [c["high"] - c["diff"] for c in comps]],
            fmt="s",
            capsize=3,
            color="tab:orange",
        )
        right.axvline(0.0, color="grey", lw=1)
        right.set_yticks(range(len(comps)), labels)
        right.set_xlabel(f"paired difference in {metric} (95% CI)")
        right.grid(alpha=0.3)
    fig.suptitle(
        f"{report['generator']['model']} on {report['data']} ({report['questions']} questions)",
        fontsize="small",
    )
    try:
        fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
