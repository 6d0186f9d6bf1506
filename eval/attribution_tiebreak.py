"""Does the scorer's likelihood pick the right passage when an answer's attribution ties?

``profile-generator --no-labels`` attributes an answer to the passages that hold it
(``solver.blind_profile.attribute``); when several hold it equally, each takes an equal share of
its weight. A tie-break would give the whole weight to the passage under which the scoring
model finds the answer most likely: ``log P(answer | passage, question)``, summed over the
answer's tokens (``service.learning.answer_likelihood``, the code the service runs).

Measured on the labelled runs' answers (every call of ``results/eval/answer_profile/<name>/
answers.jsonl``, each a uniformly random placement with the answer text kept), the gold labels
read only to judge: among the answers attributed to several passages, the gold passage's share
of the weight when split, against how often the tie-break's pick is a gold passage; per answer
the difference, its mean with a bootstrap 95% interval over answers. The scorer is the
service's embedded SmolLM2-135M-Instruct (transformers, float32, CPU), whichever generator
answered.

    python eval/attribution_tiebreak.py --out results/eval/blind_profile/tiebreak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.batch.dataset import load_examples
from service.config.settings import EMBEDDED_MODEL, Settings
from service.learning.answer_likelihood import AnswerLikelihood
from service.model_assets import resolve_model
from solver.blind_profile import attribute

RUNS = ("smollm2", "gemma-3-270m")


def likelihood(model: str) -> AnswerLikelihood:
    """The product's tie-break scorer (``service.learning.answer_likelihood``) over ``model``
    in process (transformers, float32, CPU)."""
    from service.backends.engines.transformers_backend import TransformersBackend

    folder = resolve_model(Settings(model=model))
    return AnswerLikelihood(TransformersBackend.load(folder, model_id=model, device="cpu"))


async def measure(
    name: str, answers: Path, data: Path, scorer: AnswerLikelihood, seed: int
) -> dict[str, Any]:
    examples = {ex.id: ex for ex in load_examples(data)}
    split: list[float] = []
    picked: list[float] = []
    attributed = calls = 0
    for line in answers.read_text().splitlines():
        rec = json.loads(line)
        ex = examples[rec["question_id"]]
        texts = [f"{ex.passages[p].title or ''} {ex.passages[p].text}" for p in rec["order"]]
        found = attribute(rec["answer"], texts, question=ex.question)
        calls += 1
        attributed += bool(found.passages)
        if len(found.passages) < 2:
            continue
        shown = [rec["order"][i] for i in found.passages]
        gold = set(ex.gold)
        ll = await scorer(ex.question, [texts[i] for i in found.passages], rec["answer"])
        split.append(len(gold & set(shown)) / len(shown))
        picked.append(float(shown[int(np.argmax(ll))] in gold))
    diff = np.asarray(picked) - np.asarray(split)
    rng = np.random.default_rng(seed)
    boot = [float(rng.choice(diff, diff.size).mean()) for _ in range(2000)] if diff.size else [0.0]
    return {
        "generator": name,
        "calls": calls,
        "attributed": attributed,
        "several_passages": len(split),
        "gold_share_split": float(np.mean(split)) if split else None,
        "gold_share_tiebreak": float(np.mean(picked)) if picked else None,
        "difference": float(diff.mean()) if diff.size else None,
        "difference_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "tiebreak_better": int((diff > 0).sum()),
        "tiebreak_worse": int((diff < 0).sum()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data/nq_open_train.jsonl"))
    ap.add_argument("--runs", type=Path, default=Path("results/eval/answer_profile"))
    ap.add_argument("--scorer", default=EMBEDDED_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/eval/blind_profile/tiebreak.json"))
    args = ap.parse_args()
    scorer = likelihood(args.scorer)

    async def every_run() -> list[dict[str, Any]]:
        rows = []
        for name in RUNS:
            answers = args.runs / name / "answers.jsonl"
            rows.append(await measure(name, answers, args.data, scorer, args.seed))
            print(json.dumps(rows[-1]), flush=True)
        await scorer.backend.aclose()
        return rows

    rows = asyncio.run(every_run())
    args.out.write_text(
        json.dumps({"command": " ".join(sys.argv), "scorer": args.scorer, "runs": rows}, indent=1)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
