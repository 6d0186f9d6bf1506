"""The deployed evaluation (a generator behind vLLM's OpenAI server, orders from a rag-reorder
server) paired against the in-process one on the same questions, to show the two paths agree
(eval/deployed.sh runs it; writes agreement.json and agreement.md, prints the Markdown).

    python eval/compare_deployed.py --deployed results/eval/deployed \\
        --in-process results/eval/nq_open_dev --auto-stream results/bench/auto_stream_smollm2 \\
        --out results/eval/deployed/agreement

- ``retriever`` and ``shuffle``: the same orders (both paths cut the passages alike and the
  server's shuffle is seeded by the question), so any difference is the generator's serving
  path: vLLM's OpenAI server (chat template applied by the server, float32 CPU) against the
  in-process transformers generator (the committed run: CUDA float32 for most questions).
- ``default`` (``auto`` on a cold server) against ``bench/auto_stream.py``'s cold in-process
  stream: each stream learns its own profile from its own first requests, so orders differ
  where the two learned profiles or paths differ; what must agree is the accuracy.
- The effects a team acts on (each variant against the retriever's order and a shuffle),
  estimated on either path, and the paired difference of the two estimates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.evaluation.deployed import ANSWERS_FILE
from offline.evaluation.records import CACHE_FILE, Record, RecordCache
from offline.evaluation.stats import paired_comparison
from service.prompting.answers import first_line, normalize

RESAMPLES = 10_000


def deployed(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for line in (folder / ANSWERS_FILE).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("answer") is not None:
            out[(rec["question_id"], rec["variant"])] = rec
    return out


def in_process(folder: Path, stream: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The committed in-process records as the deployed ones are keyed (``default``: the
    cold auto stream's order and its in-process answer)."""
    meta = json.loads((folder / "run.json").read_text())["meta"]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in RecordCache(folder / CACHE_FILE).written():
        if (
            isinstance(rec, Record)
            and rec.key.max_passages == meta["max_passages"]
            and rec.key.variant in ("retriever", "shuffle")
            and rec.answer is not None
        ):
            out[(rec.key.question_id, rec.key.variant)] = {
                "order": list(rec.order or []),
                "answer": rec.answer,
                "accuracy": rec.accuracy,
            }
    answers = {}
    for line in (stream / "answers.jsonl").read_text().splitlines():
        a = json.loads(line)
        answers[(a["question"], tuple(a["order"]))] = a
    for line in (stream / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        a = answers.get((r["question"], tuple(r["order"])))
        if r["pass"] == 0 and a is not None and a.get("error") is None:
            out[(r["question"], "default")] = {
                "order": r["order"],
                "answer": a["answer"],
                "accuracy": a["accuracy"],
                "auto_path": r["path"],
            }
    return out


def _cmp(name: str, base: str, pairs: list[tuple[float, float]]) -> dict[str, Any]:
    c = paired_comparison("accuracy", name, base, pairs, resamples=RESAMPLES)
    return {
        "n": c.n,
        "diff": round(c.mean_diff, 4),
        "low": round(c.ci_low, 4),
        "high": round(c.ci_high, 4),
        "p": c.p_value,
    }


def compare(dep: dict[Any, Any], inp: dict[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}, "effects": {}}
    questions = sorted({q for q, _ in dep})
    for v in ("retriever", "shuffle", "default"):
        both = [q for q in questions if (q, v) in dep and (q, v) in inp]
        if not both:
            continue
        d = [dep[(q, v)] for q in both]
        i = [inp[(q, v)] for q in both]
        same_order = sum(a["order"] == b["order"] for a, b in zip(d, i, strict=True))
        same_answer = sum(
            normalize(first_line(a["answer"])) == normalize(first_line(b["answer"]))
            for a, b in zip(d, i, strict=True)
        )
        pairs = [(float(a["accuracy"]), float(b["accuracy"])) for a, b in zip(d, i, strict=True)]
        out["variants"][v] = {
            "questions": len(both),
            "same_order": same_order,
            "same_answer_first_line": same_answer,
            "accuracy_deployed": round(sum(p[0] for p in pairs) / len(pairs), 4),
            "accuracy_in_process": round(sum(p[1] for p in pairs) / len(pairs), 4),
            "deployed_minus_in_process": _cmp(v, "in-process", pairs),
        }
    for v, base in (("default", "retriever"), ("default", "shuffle"), ("retriever", "shuffle")):
        keys = [(q) for q in questions if all((q, x) in s for x in (v, base) for s in (dep, inp))]
        if not keys:
            continue
        dd = [(float(dep[(q, v)]["accuracy"]), float(dep[(q, base)]["accuracy"])) for q in keys]
        ii = [(float(inp[(q, v)]["accuracy"]), float(inp[(q, base)]["accuracy"])) for q in keys]
        twice = [(a - b, c - e) for (a, b), (c, e) in zip(dd, ii, strict=True)]
        out["effects"][f"{v} - {base}"] = {
            "deployed": _cmp(v, base, dd),
            "in_process": _cmp(v, base, ii),
            "deployed_minus_in_process": _cmp("deployed", "in-process", twice),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    def ci(c: dict[str, Any]) -> str:
        return f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"

    lines = [
        "| variant | n | same order | same answer | accuracy deployed | in-process "
        "| deployed - in-process |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for v, r in result["variants"].items():
        lines.append(
            f"| `{v}` | {r['questions']} | {r['same_order']} | {r['same_answer_first_line']} "
            f"| {r['accuracy_deployed']:.3f} | {r['accuracy_in_process']:.3f} "
            f"| {ci(r['deployed_minus_in_process'])} |"
        )
    lines += [
        "",
        "| effect | n | deployed | in-process | difference of the two (paired) |",
        "|---|---:|---|---|---|",
    ]
    for name, e in result["effects"].items():
        lines.append(
            f"| {name} | {e['deployed']['n']} | {ci(e['deployed'])} | {ci(e['in_process'])} "
            f"| {ci(e['deployed_minus_in_process'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployed", type=Path, required=True)
    ap.add_argument("--in-process", type=Path, required=True)
    ap.add_argument("--auto-stream", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.md")
    args = ap.parse_args()
    result = compare(deployed(args.deployed), in_process(args.in_process, args.auto_stream))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
