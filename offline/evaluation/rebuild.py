"""An evaluation's report rebuilt from its records alone, without a model: what the repository
keeps of a run is its records (``cache.jsonl.gz``) and its manifest (``run.json``: the
report's header and which records it holds, in order); ``results.json``, ``summary.md`` and
the plots follow from them byte for byte (``rag-reorder eval-report``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from offline.evaluation.metrics import MetricName
from offline.evaluation.records import (
    CACHE_FILE,
    POSITIONAL,
    AnyRecord,
    PositionalRecord,
    Record,
    RecordCache,
    RunKey,
    record_from_json,
    record_to_json,
)
from service.errors import InvalidRequest

MANIFEST_FILE = "run.json"


def write_manifest(
    out_dir: Path,
    meta: Mapping[str, object],
    records: Sequence[Record],
    positional: Sequence[PositionalRecord],
    bootstrap_seed: int,
    cache: RecordCache,
) -> Path:
    """``run.json``: the report's header (``meta``), the bootstrap's seed, and which records the
    report holds, in its order: a question's id alone when it has every variant of
    ``meta["variants"]`` in that order (the common case), else ``[id, [variants]]``. The run's
    settings are in ``meta``, so a record's key needs nothing else. The few records the cache
    does not keep (skipped variants, failures a rerun may not repeat) are written out whole
    (``uncached``)."""
    variants = list(cast(Sequence[str], meta.get("variants", ())))
    every: list[AnyRecord] = [*records, *positional]
    grouped: list[tuple[str, list[str]]] = []
    for r in records:
        if grouped and grouped[-1][0] == r.key.question_id:
            grouped[-1][1].append(r.key.variant)
        else:
            grouped.append((r.key.question_id, [r.key.variant]))
    doc = {
        "meta": dict(meta),
        "bootstrap_seed": bootstrap_seed,
        "records": [qid if these == variants else [qid, these] for qid, these in grouped],
        "positional": [r.key.question_id for r in positional],
        "uncached": [record_to_json(r) for r in every if cache.get_written(r.key) != r],
    }
    path = out_dir / MANIFEST_FILE
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _record_keys(manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
    variants = list(manifest["meta"].get("variants", ()))
    keys: list[tuple[str, str]] = []
    for entry in manifest["records"]:
        qid, these = (entry, variants) if isinstance(entry, str) else entry
        keys += [(qid, v) for v in these]
    return keys


def _key(meta: Mapping[str, Any], question_id: str, variant: str) -> RunKey:
    return RunKey.for_run(
        question_id,
        variant,
        scorer=str(meta["scorer"]),
        generator=str(meta["generator"]),
        max_passages=meta.get("max_passages"),
        template=str(meta["template"]),
        max_answer_tokens=int(meta["max_answer_tokens"]),
        seed=int(meta["seed"]),
        generator_template=meta.get("generator_template"),
    )


def rebuild_report(out_dir: Path, *, pack: bool = False) -> list[Path]:
    """Rewrite ``out_dir``'s report (``results.json``, ``summary.md``, the plots) from its
    manifest and records; with ``pack``, fold its records into ``cache.jsonl.gz`` first.

    Raises:
        InvalidRequest: no manifest, or a record it names is not in the cache.
    """
    from offline.evaluation.plots import write_plots
    from offline.evaluation.report import build_summary, write_report

    manifest_path = out_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise InvalidRequest(
            f"{out_dir} has no {MANIFEST_FILE}: not the output folder of a finished "
            "`rag-reorder eval` run",
            param="out",
        )
    manifest = json.loads(manifest_path.read_text())
    meta: dict[str, Any] = manifest["meta"]
    cache = RecordCache(out_dir / CACHE_FILE)
    uncached = {rec.key: rec for rec in map(record_from_json, manifest.get("uncached", ()))}

    def written(key: RunKey) -> AnyRecord | None:
        return uncached.get(key) or cache.get_written(key)

    records: list[Record] = []
    for question_id, variant in _record_keys(manifest):
        rec = written(_key(meta, question_id, variant))
        if not isinstance(rec, Record):
            raise InvalidRequest(
                f"{out_dir}: the record of question {question_id!r}, variant {variant!r} is "
                f"not in its cache",
                param="out",
            )
        records.append(rec)
    positional: list[PositionalRecord] = []
    for question_id in manifest["positional"]:
        pos = written(_key(meta, question_id, POSITIONAL))
        if not isinstance(pos, PositionalRecord):
            raise InvalidRequest(
                f"{out_dir}: the positional record of question {question_id!r} is not in its cache",
                param="out",
            )
        positional.append(pos)
    if pack:
        cache.pack()
    metric: MetricName = meta["metric"]
    summary = build_summary(
        records,
        positional,
        metric,
        resamples=int(meta["resamples"]),
        seed=int(manifest["bootstrap_seed"]),
    )
    files = write_report(out_dir, meta, records, positional, summary)
    files += write_plots(out_dir, summary)
    return files
