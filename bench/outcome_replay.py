"""The holdout's uplift on recorded deployed-path outcomes: SmolLM2's answers through vLLM's
OpenAI server, replayed as the outcome of each arm (issue 92, docs/outcomes.md "A stream
through the deployed path", the replay).

``results/eval/deployed/answers.jsonl`` holds, for each of the 200 NQ-Open dev questions, the
NQ-Open accuracy of SmolLM2's answer (vLLM's OpenAI server, float32, this 2-core CPU) to the
order of the shipped defaults (``default``: ``auto``) and to the retriever's order. Here the
real app runs in process at its defaults with outcome feedback on (the holdout at 0.1, the
retriever's order as control, margin 0.02, alpha 0.05), placing by a named profile (the
``profile`` path; nothing is scored); a stream of ``--requests`` requests cycles through the
questions in a fixed shuffled order, and each request's outcome is the recorded accuracy of
the answer to its arm's kind of order (``placed``: ``default``'s answer; ``holdout``: the
retriever's), reported on its ``feedback_id``. The uplift (estimate, interval, verdict,
outcomes needed) at 100, 200, 400 and 1,000 requests, beside the offline paired difference
of the same recorded answers on the same questions. The placed order served here is not the
recorded one: the outcome is the recorded answer to ``default``'s order for that question.

Usage: python -m bench.outcome_replay [--requests 1000] [--out results/bench/outcome_replay.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

from app.main import create_app
from bench import report
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.state.profile_store import ProfileStore

CHECKPOINTS = (100, 200, 400, 1000)
FIELDS = ("estimate", "lower", "upper", "verdict", "outcomes", "needed")


def recorded(path: Path) -> dict[str, dict[str, float]]:
    by: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["variant"] in ("default", "retriever") and row.get("accuracy") is not None:
            by.setdefault(row["question_id"], {})[row["variant"]] = float(row["accuracy"])
    return {q: v for q, v in by.items() if len(v) == 2}


def paired(acc: dict[str, dict[str, float]], ids: list[str]) -> dict[str, Any]:
    d = np.asarray([acc[q]["default"] - acc[q]["retriever"] for q in ids])
    boot = np.random.default_rng(0).choice(d, size=(10_000, d.size)).mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return {"questions": len(ids), "difference": float(d.mean()), "interval_95": [lo, hi]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    acc = recorded(Path(args.answers))
    ids = sorted(acc)
    random.Random(args.seed).shuffle(ids)
    with tempfile.TemporaryDirectory(prefix="outcome-replay-") as name:
        tmp = Path(name)
        passages = [f"passage {i}" for i in range(10)]
        prof = ProfileStore(tmp / "profiles").put(
            model="smollm2", template="qa_default", coefficients=[0.1] * 9 + [0.1],
            identification="full", runs=1, prompts=10, r2=1.0, source="bench",
        )  # fmt: skip
        settings = Settings(
            cache_dir=tmp,
            bias_profile_dir=tmp / "profiles",
            placement_profile=prof.id,
            generator_model="smollm2-generator",
            feedback_max_requests=100_000,
            canary_interval_s=0,
            rate_canary=False,
            open_writes=True,
            access_log=False,
        )
        app = create_app(settings, backend=FakeBackend({p: 1.0 for p in passages}))
        points: list[dict[str, Any]] = []
        arms: dict[str, list[float]] = {"placed": [], "holdout": []}
        seen: list[str] = []
        started = time.time()
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c,
        ):
            while (await c.get("/ready")).status_code != 200:
                await anyio.sleep(0.05)
            for k in range(1, args.requests + 1):
                q = ids[(k - 1) % len(ids)]
                seen.append(q)
                r = await c.post("/v1/reorder", json={"query": q, "passages": passages})
                assert r.status_code == 200, r.text
                arm = r.json()["auto"]["arm"]
                y = acc[q]["default" if arm == "placed" else "retriever"]
                arms[arm].append(y)
                fb = await c.post(
                    "/v1/feedback", json={"id": r.json()["feedback_id"], "outcome": y}
                )
                up = fb.json()["outcome"]["uplift"]
                if k in CHECKPOINTS or k == args.requests:
                    distinct = sorted(set(seen))
                    points.append(
                        {
                            "requests": k,
                            "uplift": {f: up[f] for f in FIELDS},
                            "arm_means": {a: float(np.mean(v)) for a, v in arms.items() if v},
                            "offline_paired_same_questions": paired(acc, distinct),
                        }
                    )
                    print(points[-1], flush=True)
    return {
        **report.provenance(),
        "answers": args.answers,
        "questions": len(ids),
        "checkpoints": points,
        "wall_s": round(time.time() - started, 1),
    }


def main() -> int:
    ap = report.parser("outcome_replay", __doc__)
    ap.add_argument("--answers", default="results/eval/deployed/answers.jsonl")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=92)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
