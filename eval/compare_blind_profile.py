"""The label-free generator profile against the gold-based one (JSON on stdout).

Two sources of label-free answers:

- ``--blind FOLDER``: a ``profile-generator --no-labels`` run (``blind-answers.jsonl``), one
  call per question with its passages in a random order;
- ``--replay FOLDER``: a labelled ``profile-generator`` run (``answers.jsonl``) replayed without
  its labels: one of each question's calls drawn at random (seeded). The gold passage moves
  through every slot among distractors shuffled once per question, so the drawn call's order is
  a uniformly random placement of the question's passages; its answer is attributed as
  ``--no-labels`` would attribute it, from the passages' text, and ``correct`` is never read.

For the first 50, 100, 200 ... questions (in the data file's order) the label-free estimate is
fitted and compared with the gold-based profile (``--gold``, a labelled run's ``profile.json``):
Spearman's rank correlation of the slot shares with the per-slot accuracy, whether both put the
same two slots first, the intervals; and the number of questions after which the trust rule
first said ``shaped`` and kept saying it. The data's gold labels are read only to report how
often the attributed passage is the gold one (the attribution's precision).

    python eval/compare_blind_profile.py --blind results/eval/blind_profile/smollm2 \\
        --data ../shared/data/nq_open_train.jsonl \\
        --gold results/eval/answer_profile/smollm2/profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.blind_profile import fit_records
from service.batch.dataset import load_examples
from solver.blind_profile import DEFAULT_THRESHOLD, attribute
from solver.trust import TrustRules, top_slots


def _replayed(folder: Path, data: Path, seed: int, threshold: float) -> list[dict[str, Any]]:
    by_q: dict[str, list[dict[str, Any]]] = {}
    for line in (folder / "answers.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_q.setdefault(rec["question_id"], []).append(rec)
    examples = {ex.id: ex for ex in load_examples(data)}
    out = []
    for q, recs in by_q.items():
        recs.sort(key=lambda r: r["slot"])
        pick = recs[random.Random(zlib.crc32(f"{seed}:{q}".encode())).randrange(len(recs))]
        ex = examples[q]
        order = pick["order"]
        # Only the passages shown: the attribution cannot see the others.
        texts = [f"{ex.passages[p].title or ''} {ex.passages[p].text}" for p in order]
        found = attribute(pick["answer"], texts, question=ex.question, threshold=threshold)
        out.append(
            {
                "question_id": q,
                "order": list(range(len(order))),
                "attributed": list(found.passages),
                "passages": [order[i] for i in found.passages],
                "kind": found.kind,
            }
        )
    return out


def _blind(folder: Path) -> list[dict[str, Any]]:
    recs = [json.loads(x) for x in (folder / "blind-answers.jsonl").read_text().splitlines()]
    for r in recs:
        r["passages"] = list(r["attributed"])
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--blind", type=Path)
    src.add_argument("--replay", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--gold", type=Path, required=True, help="a labelled run's profile.json")
    ap.add_argument("--steps", default="50,100,200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    ap.add_argument(
        "--top-slots", type=int, default=2, help="strongest slots the trust rule compares (1, 2)"
    )
    args = ap.parse_args()

    recs = (
        _replayed(args.replay, args.data, args.seed, args.threshold)
        if args.replay
        else _blind(args.blind)
    )
    examples = load_examples(args.data)
    rank = {ex.id: i for i, ex in enumerate(examples)}
    gold_of = {ex.id: set(ex.gold) for ex in examples}
    recs = [r for r in recs if r["question_id"] in rank]
    recs.sort(key=lambda r: rank[r["question_id"]])
    gold = json.loads(args.gold.read_text())["fit"]
    acc = np.asarray(gold["accuracy"])
    slots = len(acc)
    rules = TrustRules(top_slots=args.top_slots)
    gold_top = top_slots(acc, slots, 2)

    def compare(n: int) -> dict[str, Any]:
        fit = fit_records(recs[:n], slots=slots, rules=rules, seed=args.seed)
        assert fit is not None
        rho, p = stats.spearmanr(fit.share, acc)
        return {
            "questions": n,
            "attributed": fit.attributed,
            "single": fit.single,
            "multiple": fit.multiple,
            "share": [round(s, 4) for s in fit.share],
            "low": [round(s, 4) for s in fit.low],
            "high": [round(s, 4) for s in fit.high],
            "top_slots": list(fit.top_slots),
            "gold_top_slots": list(gold_top),
            "same_top_2": fit.top_slots == gold_top,
            "same_top_1": fit.top_slots[0] == gold_top[0],
            "spearman": round(float(rho), 3),
            "spearman_p": float(p),
            "verdict": fit.verdict,
            "reason": fit.reason,
        }

    steps = [int(s) for s in args.steps.split(",") if int(s) <= len(recs)]
    if len(recs) not in steps:
        steps.append(len(recs))
    first_shaped = None
    for n in range(10, len(recs) + 1, 10):
        fit = fit_records(recs[:n], slots=slots, rules=rules, seed=args.seed)
        shaped = fit is not None and fit.verdict == "shaped"
        if shaped and first_shaped is None:
            first_shaped = n
        elif not shaped:
            first_shaped = None
    hits = [r for r in recs if r["passages"]]
    on_gold = [
        len(set(r["passages"]) & gold_of[r["question_id"]]) / len(r["passages"]) for r in hits
    ]
    kinds = [r.get("kind") for r in recs]
    print(
        json.dumps(
            {
                "source": str(args.blind or args.replay),
                "mode": "blind" if args.blind else "replay",
                "questions": len(recs),
                "attribution": {
                    "contained": kinds.count("contained"),
                    "overlap": kinds.count("overlap"),
                    "none": kinds.count("none"),
                    "multiple": sum(len(r["passages"]) > 1 for r in hits),
                    "on_gold_passage": round(float(np.mean(on_gold)), 3) if on_gold else None,
                },
                "gold_accuracy_by_slot": gold["accuracy"],
                "gold_questions": gold["questions"],
                "questions_to_shaped": first_shaped,
                "steps": [compare(n) for n in steps],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
