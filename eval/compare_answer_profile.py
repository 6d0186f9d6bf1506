"""The answer-calibrated profile against the log-prob one, and `dense` placed by it on NQ-Open
dev paired against the committed variants (eval/answer_profile.sh runs it; Markdown on stdout).

    python eval/compare_answer_profile.py --answers results/eval/answer_profile \\
        --logprob-profiles results/eval/profiles/nq_open_dev \\
        --control results/eval/answer_profile/nq_open_dev_logprob \\
        --committed results/eval/nq_open_dev

The committed variants were run on an H100 (CUDA, float32) for most questions, the answer
profile's on this CPU; the control (`dense` placed by the log-prob profile, re-run here) pairs
the two profiles on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.records import CACHE_FILE, Record, RecordCache
from offline.evaluation.stats import paired_comparison

NEW = "dense:bias_matched"
BASELINES = (
    ("dense:bias_matched", "`dense` placed by the log-prob profile"),
    ("moi:pruned_random:bias_matched", "MoI default"),
    ("dense:litm", "`dense` + `litm`"),
    ("shuffle", "shuffle"),
)
METRICS = (("accuracy", "accuracy"), ("gold_logprob_per_token", "gold answer log p / token"))


def records(folder: Path) -> dict[tuple[str, str], Record]:
    cache = RecordCache(folder / CACHE_FILE)
    run = json.loads((folder / "run.json").read_text())
    meta = run["meta"]
    return {
        (rec.key.question_id, rec.key.variant): rec
        for rec in cache.written()
        if isinstance(rec, Record) and rec.key.max_passages == meta["max_passages"]
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--answers", type=Path, required=True)
    ap.add_argument(
        "--logprob-profiles",
        type=Path,
        required=True,
        help="the profile store holding the generator's log-prob profile under the id the "
        "answer profile was stored with (same model, template and slots)",
    )
    ap.add_argument("--committed", type=Path, required=True)
    ap.add_argument("--control", type=Path, help="dense:bias_matched by the log-prob profile, here")
    ap.add_argument("--name", default="smollm2", help="the run's folders: NAME/ and EVAL")
    ap.add_argument("--eval", default="nq_open_dev", help="the eval folder under --answers")
    args = ap.parse_args()
    report = json.loads((args.answers / args.name / "profile.json").read_text())
    fit = report["fit"]
    if not report["stored"]:
        sys.exit(f"no answer profile stored in {args.answers / args.name}: {report['refused']}")
    logprob_file = args.logprob_profiles / f"{report['stored']}.json"
    logprob = json.loads(logprob_file.read_text())["coefficients"]
    answers = fit["coefficients"]
    rho, rho_p = stats.spearmanr(answers, logprob)
    verdict = "distinguishable" if report["distinguishable"] else "not distinguishable"
    print(f"# Answer-calibrated profile of {report['model'].split('/')[-1]}\n")
    print(
        f"{report['questions_measured']} NQ-Open training questions x {report['slots']} slots, "
        f"{report['calls']} calls, {report['prompt_tokens']} prompt tokens, "
        f"{report['completion_tokens']} answer tokens; Cochran's Q = {fit['cochran_q']:.2f}, "
        f"p = {fit['p_flat']:.3g} ({verdict} from flat); stored: {report['stored']}.\n"
    )
    print("| slot | accuracy | 95% CI | smoothed | weight (answers) | weight (log-probs) |")
    print("|---:|---:|---|---:|---:|---:|")
    for k in range(report["slots"]):
        print(
            f"| {k + 1} | {fit['accuracy'][k]:.2f} | [{fit['low'][k]:.2f}, {fit['high'][k]:.2f}] "
            f"| {fit['smoothed'][k]:.3f} | {answers[k]:.3f} | {logprob[k]:.3f} |"
        )
    top_a, top_l = int(np.argmax(answers)) + 1, int(np.argmax(logprob)) + 1
    print(
        f"\nSlot-rank agreement with the log-prob profile: Spearman rho = {rho:.2f} (p = "
        f"{rho_p:.2g}); best slot {top_a} (answers) and {top_l} (log-probs).\n"
    )
    new = records(args.answers / args.eval)
    old = records(args.committed)
    sources: list[tuple[dict[tuple[str, str], Record], str, str]] = []
    if args.control is not None:
        sources.append(
            (records(args.control), NEW, "`dense` placed by the log-prob profile (this CPU)")
        )
    sources += [(old, variant, f"{label} (committed)") for variant, label in BASELINES]
    print("## NQ-Open dev (200 questions, 10 passages): `dense` placed by the answer profile\n")
    print("| against | metric | n | mean difference [95% CI] | Wilcoxon p | wins / losses |")
    print("|---|---|---:|---|---:|---:|")
    ids = sorted({q for q, v in new if v == NEW})
    for base, variant, label in sources:
        for metric, mlabel in METRICS:
            pairs = []
            for q in ids:
                a, b = new.get((q, NEW)), base.get((q, variant))
                va = a.value(metric) if a else None
                vb = b.value(metric) if b else None
                if va is not None and vb is not None:
                    pairs.append((va, vb))
            c = paired_comparison(mlabel, NEW, variant, pairs)
            print(
                f"| {label} | {mlabel} | {c.n} | {c.mean_diff:+.3f} [{c.ci_low:+.3f}, "
                f"{c.ci_high:+.3f}] | {c.p_value:.2g} | {c.wins} / {c.losses} |"
            )
    print("\nAccuracy over the same questions:\n")
    for base, variant, label in [
        (new, NEW, "`dense` placed by the answer profile (this CPU)"),
        *sources,
    ]:
        acc = [r.value("accuracy") for q in ids if (r := base.get((q, variant))) is not None]
        found = [a for a in acc if a is not None]
        print(f"- {label}: {np.mean(found):.3f} ({len(found)} questions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
