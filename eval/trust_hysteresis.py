"""How often the online sampler's trust decision flips, replayed on recorded answers (JSON).

The sampler refits the generator's label-free profile after every answer and judges it by
``auto``'s rule (``solver.trust.verdict``); a trusted profile whose refit is undecided is kept
while it still ``holds`` (``solver.trust.holds``: the same top slots in ``keep_stability`` of
the resampled fits). This replays a ``profile-generator --no-labels`` run's answers
(``blind-answers.jsonl``) one by one, in the order they were answered, as the sampler pools
them, and counts the decisions for each keep bar (``--keeps``; the trust bar itself means no
hysteresis):

- **answer by answer**: when the profile was first trusted, and every later withdrawal and
  re-trust;
- **a changed generator**: the first ``--before`` answers, then the rest mirrored (the passage
  shown in slot k moved to slot L-1-k, so a recency profile becomes a primacy one): after how
  many of the mirrored answers the profile stops being placed by.

    python eval/trust_hysteresis.py --blind results/eval/blind_profile/smollm2 --top-slots 1 \\
        --out results/eval/blind_profile/trust_hysteresis_smollm2_top1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.blind_profile import fit_records
from solver.blind_profile import BlindProfile
from solver.trust import TrustRules, holds


def decisions(fits: list[BlindProfile], rules: TrustRules, start: int) -> list[dict[str, Any]]:
    """The sampler's decisions over successive refits (``fits[i]``: after answer
    ``start + i``): trusted, replaced (other top slots), withdrawn."""
    held: BlindProfile | None = None
    out: list[dict[str, Any]] = []
    for i, fit in enumerate(fits):
        n = start + i
        if fit.trusted:
            if held is None or held.top_slots != fit.top_slots:
                what = "trusted" if held is None else "replaced"
                out.append({"answers": n, "event": what, "top_slots": list(fit.top_slots)})
            held = fit
            continue
        if held is None:
            continue
        kept, why = holds(
            held.verdict, held.top_slots, flat_p=fit.flat_p, stability=fit.stability,
            top=fit.top_slots, rules=rules,
        )  # fmt: skip
        if not kept:
            out.append({"answers": n, "event": "withdrawn", "why": why})
            held = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blind", type=Path, required=True, help="a --no-labels run's folder")
    ap.add_argument("--top-slots", type=int, default=2, help="strongest slots compared (1, 2)")
    ap.add_argument("--keeps", default="0.9,0.85,0.8,0.75", help="keep bars to compare")
    ap.add_argument("--before", type=int, default=300, help="answers before the change")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    lines = (args.blind / "blind-answers.jsonl").read_text().splitlines()
    recs = [{**r, "passages": list(r["attributed"])} for r in map(json.loads, lines)]
    slots = len(recs[0]["order"])
    rules = TrustRules(top_slots=args.top_slots)
    changed = recs[: args.before] + [
        {**r, "order": list(reversed(r["order"]))} for r in recs[args.before :]
    ]

    def fits(seq: list[dict[str, Any]], start: int) -> list[BlindProfile]:
        out = []
        for n in range(start, len(seq) + 1):
            fit = fit_records(seq[:n], slots=slots, rules=rules, seed=args.seed)
            assert fit is not None
            out.append(fit)
        return out

    along = fits(recs, 1)
    # The change: the refits from the last 50 answers before it (trusted by then, or never).
    start = max(1, args.before - 50)
    after = fits(changed, start)
    rows = []
    for keep in (float(k) for k in args.keeps.split(",")):
        r = dataclasses.replace(rules, keep_stability=min(keep, rules.min_stability))
        events = decisions(along, r, 1)
        moved = [
            e for e in decisions(after, r, start) if e["answers"] > args.before
            and e["event"] in ("withdrawn", "replaced")
        ]  # fmt: skip
        rows.append(
            {
                "keep_stability": keep,
                "answers": len(recs),
                "first_trusted": next(
                    (e["answers"] for e in events if e["event"] == "trusted"), None
                ),
                "flips": sum(e["event"] == "withdrawn" for e in events),
                "events": events,
                "changed_after": args.before,
                "mirrored_answers_to_stop": moved[0]["answers"] - args.before if moved else None,
            }
        )
    out = {
        "command": " ".join(["python", "eval/trust_hysteresis.py", *sys.argv[1:]]),
        "folder": str(args.blind),
        "slots": slots,
        "top_slots": args.top_slots,
        "trust_stability": rules.min_stability,
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
