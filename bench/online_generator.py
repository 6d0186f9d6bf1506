"""``auto`` learning a generator's profile online, from its answers to sampled live requests
(``RAG_REORDER_GENERATOR_URL``; docs/generator-profile.md, "Online, from live traffic").

The real app in process (lifespan, routes, ``auto``, the background sampler), scoring on the
known-truth fake engine (the scorer is not what is measured here), the generator a running
OpenAI-compatible server (vLLM's, for instance). NQ-Open questions go to ``/v1/reorder`` one at
a time with ``RAG_REORDER_GENERATOR_SAMPLE_RATE`` 1; after each, the script waits until the
sampler has asked the generator, and appends ``/info``'s online profile to
``<work>/progress.jsonl``. The answers are pooled in ``<work>/cache`` (the state store's
folder), so a rerun continues with the next question; ``--out`` gets the final report.

    .venv/bin/python -m bench.online_generator --generator-url http://127.0.0.1:8791/v1 \\
        --generator-model HuggingFaceTB/SmolLM2-135M-Instruct --questions 40 --passages 10 \\
        --work results/bench/online_generator/smollm2 \\
        --out results/bench/online_generator/smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from app.main import create_app
from bench import report as bench_report
from service.backends.fakes.fake import FakeBackend
from service.batch.dataset import load_examples
from service.config.settings import Settings


async def run(args: argparse.Namespace) -> dict[str, Any]:
    examples = [
        ex
        for ex in load_examples(Path(args.data), limit=args.questions * 2)
        if len(ex.passages) >= args.passages
    ][: args.questions]
    texts = [[p.text for p in ex.passages[: args.passages]] for ex in examples]
    # The fake scorer needs a utility for every passage; its values only decide MoI's order.
    truth = {t: float(i % 5) for row in texts for i, t in enumerate(row)}
    args.work.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        cache_dir=args.work / "cache",
        canary_interval_s=0,
        rate_canary=False,
        open_writes=True,
        model="fake/known-truth",
        generator_url=args.generator_url,
        generator_model=args.generator_model,
        generator_api=args.api,
        generator_template=args.template,
        generator_sample_rate=1.0,
        generator_max_calls_per_hour=args.max_calls_per_hour,
        generator_timeout_s=args.timeout,
        generator_top_slots=args.top_slots,
    )
    app = create_app(settings, backend=FakeBackend(truth))
    progress = args.work / "progress.jsonl"
    done = len(progress.read_text().splitlines()) if progress.exists() else 0
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client,
    ):
        while (await client.get("/ready")).status_code != 200:
            await asyncio.sleep(0.05)
        sampler = app.state.ctx.engine.learner.generator
        for i in range(done, len(examples)):
            started = time.monotonic()
            r = await client.post(
                "/v1/reorder", json={"query": examples[i].question, "passages": texts[i]}
            )
            r.raise_for_status()
            while sampler.queued or sampler.busy:
                await asyncio.sleep(0.05)
            info = (await client.get("/info")).json()["auto"]["generator_online"]
            row = {
                "question": i + 1,
                "seconds": round(time.monotonic() - started, 2),
                "auto_path": r.json()["auto"]["path"],
                **{k: info[k] for k in ("calls", "failures", "answers")},
                "profile": info["profiles"][0] if info["profiles"] else None,
            }
            with progress.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            prof = row["profile"] or {}
            print(
                f"{i + 1}/{len(examples)} {row['seconds']} s: {prof.get('answers')} answers, "
                f"{prof.get('attributed')} attributed, {prof.get('verdict')} "
                f"(p {prof.get('flat_p')})",
                flush=True,
            )
        final = (await client.get("/info")).json()["auto"]["generator_online"]
    rows = [json.loads(x) for x in progress.read_text().splitlines()]
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds_per_question": [r["seconds"] for r in rows],
        "final": final,
    }


def main() -> int:
    ap = bench_report.parser("online_generator", __doc__, data=True)
    ap.add_argument("--generator-url", required=True, help="the generator's API, up to /v1")
    ap.add_argument("--generator-model", required=True, help="the model name it serves")
    ap.add_argument("--api", choices=("chat", "completions"), default="chat")
    ap.add_argument("--template", default="qa_default", help="the generator's prompt template")
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--max-calls-per-hour", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per generator call")
    ap.add_argument(
        "--top-slots", type=int, default=2, help="RAG_REORDER_GENERATOR_TOP_SLOTS (1 or 2)"
    )
    ap.add_argument(
        "--work", type=Path, default=Path("results/bench/online_generator"),
        help="pooled answers and progress.jsonl (a rerun continues)",
    )  # fmt: skip
    return bench_report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
