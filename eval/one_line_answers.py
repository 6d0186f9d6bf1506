"""Bring cached evaluation records of a completion-template generator to one-line answers.

Until 2026-11-26 a base model prompted with a completion template (Gemma-3-270m with
``qa_completion``) generated all ``max_answer_tokens`` tokens: its answer line, then run-on
text (the next "Question:", the documents again). Generation now stops at the first line
break (``service.strategies.work.Work``). Accuracy, EM and F1 always read the first line, so
they do not change; the stored ``answer`` and ROUGE-L (scored on the whole response) do. This
rewrites each such record's answer to its first line and recomputes its answer metrics from it,
checking that accuracy, EM and F1 come out as stored, so that old and new records of one
report mean the same. Greedy decoding makes the new answer the old one's first line. Records of
chat-template generators (which stop at their end-of-turn token) are left as they are, and so
is the generator's recorded cost (the tokens and time it really took). Running it again
changes nothing.

Usage: python eval/one_line_answers.py --data ../shared/data FOLDER [FOLDER ...]
       (FOLDER: an results/eval/<set>[__<scorer>__<generator>]/ holding cache.jsonl)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.metrics import score_answer
from service.batch.dataset import load_examples
from service.config.settings import DEFAULT_TEMPLATE, MODEL_TEMPLATES
from service.prompting.answers import first_line
from service.prompting.templates import get_template

# The metrics that read the first line only: a rewrite that changed one is a bug, not a fix.
UNCHANGED = ("accuracy", "em", "f1")


def gold_answers(data: Path) -> dict[str, tuple[str, ...]]:
    """Question id -> its gold answers, over every JSONL data set in ``data``."""
    return {
        ex.id: ex.answers for path in sorted(data.glob("*.jsonl")) for ex in load_examples(path)
    }


def is_completion(model: str, template: str | None) -> bool:
    """Whether ``model`` generated with a completion template (``template``: as recorded)."""
    return get_template(template or MODEL_TEMPLATES.get(model, DEFAULT_TEMPLATE)).completion


def rewrite(record: dict, golds: tuple[str, ...]) -> bool:
    """Bring ``record``'s answers to their first line, in place; whether anything changed.

    Raises:
        ValueError: a first-line metric would change (the record was not what it seems).
    """
    key = record["key"]
    fields = []
    if is_completion(key["generator"], key.get("generator_template")):
        fields.append("")  # the generator's answer: answer, accuracy, ...
    if is_completion(key["scorer"], key.get("template")):
        fields.append("strategy_answer_")  # an answering strategy's own answer (the scorer's)
    changed = False
    for prefix in fields:
        name = "strategy_answer" if prefix else "answer"
        answer = record.get(name)
        if answer is None or not golds:
            continue
        line = first_line(answer).strip()
        if line == answer:
            continue
        scores = score_answer(line, golds).as_dict()
        for metric in UNCHANGED:
            old = record.get(prefix + metric)
            if old is not None and not math.isclose(old, scores[metric]):
                raise ValueError(
                    f"{key['question_id']} {key['variant']}: {prefix}{metric} would change "
                    f"from {old} to {scores[metric]}"
                )
        record[name] = line
        for metric, value in scores.items():
            record[prefix + metric] = value
        changed = True
    return changed


def migrate(folder: Path, golds: dict[str, tuple[str, ...]]) -> tuple[int, int]:
    """Rewrite ``folder/cache.jsonl`` in place; (records rewritten, records)."""
    cache = folder / "cache.jsonl"
    out: list[str] = []
    rewritten = 0
    for line in cache.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        strategy = "key" in record and record.get("kind", "strategy") == "strategy"
        if strategy and rewrite(record, golds.get(record["key"]["question_id"], ())):
            rewritten += 1
            out.append(json.dumps(record))
        else:
            out.append(line)
    cache.write_text("".join(line + "\n" for line in out), encoding="utf-8")
    return rewritten, len(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="folder of the data sets (JSONL)")
    ap.add_argument("folders", type=Path, nargs="+")
    args = ap.parse_args()
    golds = gold_answers(args.data)
    for folder in args.folders:
        rewritten, total = migrate(folder, golds)
        print(f"{folder}: {rewritten} of {total} records brought to one-line answers")


if __name__ == "__main__":
    main()
