"""Drop cached evaluation records that Gemma-3-270m computed with a broken tokenizer.

On the lent H100 (2026-11-25) the models were converted with the machine's transformers 5.17,
whose GGUF conversion gives Gemma-3 a tokenizer without merges: about 4.5 times the tokens for
the same text, and prompts the model never saw. Those records carry no error; their token
counts give them away. A generator prompt of 10 NQ-Open passages takes 0.2-0.4 tokens per
character of the question and passages with the right tokenizer (every record computed on the
CPU, and every SmolLM2 record anywhere), 0.9-1.2 with the broken one; nothing falls between.
This drops each record whose generator prompts take more than ``--max-ratio`` (default 0.6)
tokens per character, so that the evaluation computes it again, and prints what it dropped.
``service.model_assets`` now refuses such a conversion, so no new record can be like these.

Usage: python eval/purge_tokenizer_records.py --data ../shared/data FOLDER [FOLDER ...]
       (FOLDER: an results/eval/<set>__<scorer>__<generator>/ holding cache.jsonl)
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def prompt_chars(data: Path) -> dict[tuple[str, int], int]:
    """(question id, passages) -> characters of the question and its first passages."""
    chars: dict[tuple[str, int], int] = {}
    for path in sorted(data.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            ex = json.loads(line)
            if "passages" not in ex:
                continue
            total = len(ex["question"])
            for n, p in enumerate(ex["passages"], start=1):
                total += len(p["title"]) + len(p["text"])
                chars[(ex["id"], n)] = total
    return chars


def tokens_per_char(record: dict, chars: dict[tuple[str, int], int]) -> float | None:
    """The record's generator prompt tokens per character (None: no generator prompt)."""
    cost = record.get("generator_cost") or {}
    if not cost.get("prompts"):
        return None
    key = record["key"]
    return (
        float(cost["prompt_tokens"])
        / cost["prompts"]
        / chars[(key["question_id"], key["max_passages"])]
    )


def purge(folder: Path, chars: dict[tuple[str, int], int], max_ratio: float) -> Counter[str]:
    """Rewrite ``folder/cache.jsonl`` without the records over ``max_ratio``; count them."""
    cache = folder / "cache.jsonl"
    kept: list[str] = []
    dropped: Counter[str] = Counter()
    for line in cache.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        ratio = tokens_per_char(record, chars)
        if ratio is not None and ratio > max_ratio:
            dropped[record["key"]["question_id"]] += 1
        else:
            kept.append(line)
    cache.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="folder of the data sets (JSONL)")
    ap.add_argument("--max-ratio", type=float, default=0.6)
    ap.add_argument("folders", type=Path, nargs="+")
    args = ap.parse_args()
    chars = prompt_chars(args.data)
    for folder in args.folders:
        dropped = purge(folder, chars, args.max_ratio)
        print(f"{folder}: dropped {sum(dropped.values())} records of {len(dropped)} questions")


if __name__ == "__main__":
    main()
