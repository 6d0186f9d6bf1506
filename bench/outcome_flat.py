"""A generator where placement does not help, through the real app: the uplift must end "no
difference" and, with ``outcome_policy act``, the key must be served the retriever's order
(issue 92, docs/outcomes.md "A generator where placement does not help").

The app in process (``create_app``: routes, ``auto``, the holdout, the outcomes' spool in its
state folder), the scoring engine the known-truth fake (nothing is scored: ``auto`` places by
an operator's named 4-slot profile, the ``profile`` path), and a **simulated** order-agnostic
generator: each served request's outcome is drawn Bernoulli(``--accuracy``) whatever its order
or arm (a flat generator: what placement cannot change). Each request is served, its outcome
reported on its ``feedback_id``; the run stops ``--after`` requests past the first request
served ``pass_through``. ``--holdout-rate`` 0.5 and ``--margin`` 0.05 (not the defaults: at 0.1
and 0.02 "no difference" needs tens of thousands of outcomes, docs/outcomes.md) keep it to a
few thousand requests. Checkpoints of the uplift are written to ``--out``.

Usage: python -m bench.outcome_flat [--holdout-rate 0.5] [--margin 0.05] [--max-requests 30000]
           [--out results/bench/outcome_flat.json]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from app.main import create_app
from bench import report
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.state.profile_store import ProfileStore

PASSAGES = [f"passage {i} about the question's topic, and more words" for i in range(4)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="outcome-flat-") as name:
        tmp = Path(name)
        prof = ProfileStore(tmp / "profiles").put(
            model="big/generator", template="qa_default", coefficients=[0.1, 0.2, 0.3, 0.4],
            identification="full", runs=1, prompts=4, r2=1.0, source="bench",
        )  # fmt: skip
        settings = Settings(
            cache_dir=tmp,
            bias_profile_dir=tmp / "profiles",
            placement_profile=prof.id,
            generator_model="flat-generator",
            feedback_max_requests=100_000,
            holdout_rate=args.holdout_rate,
            outcome_margin=args.margin,
            outcome_policy="act",
            canary_interval_s=0,
            rate_canary=False,
            open_writes=True,
            access_log=False,
        )
        app = create_app(settings, backend=FakeBackend({p: 1.0 for p in PASSAGES}))
        transport = httpx.ASGITransport(app=app)
        checkpoints: list[dict[str, Any]] = []
        paths_after: dict[str, int] = {}
        orders_after: dict[str, int] = {}
        switched_at = None
        started = time.time()
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
        ):
            while (await client.get("/ready")).status_code != 200:
                await anyio.sleep(0.05)
            body = {"query": "which passage answers it?", "passages": PASSAGES}
            for k in range(1, args.max_requests + 1):
                resp = await client.post("/v1/reorder", json=body)
                assert resp.status_code == 200, resp.text
                r = resp.json()
                auto = r["auto"]
                if switched_at is not None:
                    paths_after[auto["path"]] = paths_after.get(auto["path"], 0) + 1
                    shown = "retriever" if r["order"] == [0, 1, 2, 3] else "placed"
                    orders_after[shown] = orders_after.get(shown, 0) + 1
                    if k - switched_at >= args.after:
                        break
                elif auto["path"] == "pass_through":
                    switched_at = k
                outcome = 1.0 if rng.random() < args.accuracy else 0.0
                fb = await client.post(
                    "/v1/feedback", json={"id": r["feedback_id"], "outcome": outcome}
                )
                up = fb.json()["outcome"]["uplift"]
                if k % args.every == 0 or (switched_at == k):
                    row = {"requests": k, **{f: up[f] for f in ("estimate", "lower", "upper",
                           "verdict", "outcomes", "needed", "pass_through")}}  # fmt: skip
                    checkpoints.append(row)
                    print(row, flush=True)
            info = (await client.get("/info")).json()["auto"]["outcomes"]
    return {
        **report.provenance(),
        "settings": {k: getattr(args, k) for k in ("holdout_rate", "margin", "accuracy", "seed")},
        "switched_to_pass_through_at_request": switched_at,
        "paths_after_the_switch": paths_after,
        "orders_after_the_switch": orders_after,
        "final": info,
        "checkpoints": checkpoints,
        "wall_s": round(time.time() - started, 1),
    }


def main() -> int:
    ap = report.parser("outcome_flat", __doc__)
    ap.add_argument("--holdout-rate", type=float, default=0.5)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--accuracy", type=float, default=0.4)
    ap.add_argument("--max-requests", type=int, default=30_000)
    ap.add_argument("--after", type=int, default=500)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=92)
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
