"""Does the scorer's likelihood pick the right passage when an answer's attribution ties?

``profile-generator --no-labels`` attributes an answer to the passages that hold it
(``solver.blind_profile.attribute``); when several hold it equally, each takes an equal share of
its weight. A tie-break would give the whole weight to the passage under which the scoring
model finds the answer most likely: ``log P(answer | passage, question)``, summed over the
answer's tokens, the prompt ``Document: <passage>\\nQuestion: <question>\\nAnswer:``.

Measured on the labelled runs' answers (every call of ``eval/results/answer_profile/<name>/
answers.jsonl``, each a uniformly random placement with the answer text kept), the gold labels
read only to judge: among the answers attributed to several passages, the gold passage's share
of the weight when split, against how often the tie-break's pick is a gold passage; per answer
the difference, its mean with a bootstrap 95% interval over answers. The scorer is the
service's embedded SmolLM2-135M-Instruct (transformers, float32, CPU), whichever generator
answered.

    python eval/attribution_tiebreak.py --out bench/results/blind_profile/tiebreak.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.batch.dataset import load_examples
from service.config.settings import EMBEDDED_MODEL, Settings
from service.model_assets import resolve_model
from solver.blind_profile import attribute

RUNS = ("smollm2", "gemma-3-270m")


class Scorer:
    """``log P(answer | passage, question)`` under a causal LM, summed over the answer."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        folder = resolve_model(Settings(model=model))
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def loglik(self, passage: str, question: str, answer: str) -> float:
        torch = self.torch
        prefix = self.tok(f"Document: {passage}\nQuestion: {question}\nAnswer:")["input_ids"]
        ans = self.tok(" " + answer.strip())["input_ids"]
        ids = torch.tensor([prefix + ans])
        with torch.no_grad():
            lp = torch.log_softmax(self.model(ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        return float(lp[torch.arange(target.shape[0]), target][len(prefix) - 1 :].sum())


def measure(name: str, answers: Path, data: Path, scorer: Scorer, seed: int) -> dict[str, Any]:
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
        ll = [scorer.loglik(texts[i], ex.question, rec["answer"]) for i in found.passages]
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
    ap.add_argument("--runs", type=Path, default=Path("eval/results/answer_profile"))
    ap.add_argument("--scorer", default=EMBEDDED_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/blind_profile/tiebreak.json"))
    args = ap.parse_args()
    scorer = Scorer(args.scorer)
    rows = []
    for name in RUNS:
        row = measure(name, args.runs / name / "answers.jsonl", args.data, scorer, args.seed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(
        json.dumps({"command": " ".join(sys.argv), "scorer": args.scorer, "runs": rows}, indent=1)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
