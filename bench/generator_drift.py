"""How many answers the online generator profile takes to notice a generator whose slot
preference reversed (issue 90, item 3): the real sampler (``GeneratorSampler``: its spool,
refits, hysteresis, drift test and store), fed simulated answers as ``_learn`` pools them.

A generator of ``--slots`` slots answers from slot k with probability proportional to
``theta_k`` (recency: the last slots strongest), ``--attributed`` of its answers attributed
(one passage each), the rest unattributed. ``--before`` answers fill the pool (the default,
2,000, is ``generator_max_answers``: a profile trusted long ago) and the profile is stored
trusted; then its slots are mirrored (primacy) and the answers arrive one at a time. Reported:
the answers after the reversal until the old profile is no longer placed by (``withdrawn``),
until a profile placing the reversed generator's top slots is (``replaced``), and every
change of the top slots placed by in between (``placed_by``).

``--old`` runs the sampler as it was before the drift test and the refit pacing: no drift test
(a drift window larger than the pool) and a refit after every answer, or every ``--every``
answers (the figures are then rounded up to a multiple of it: a refit of 2,000 answers takes
seconds on a loaded CPU).

    PYTHONPATH=. .venv/bin/python -m bench.generator_drift \\
        --out results/bench/generator_drift/new.json
    PYTHONPATH=. .venv/bin/python -m bench.generator_drift --old \\
        --out results/bench/generator_drift/old.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.config.settings import Settings
from service.learning.generator_online import GeneratorSampler
from service.learning.learner import generator_rules_of
from service.state.state_store import FolderState
from solver.trust import top_slots

THETA = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0)


def answers(theta: np.ndarray, n: int, attributed: float, rng: np.random.Generator) -> np.ndarray:
    w = np.zeros((n, theta.size))
    slots = rng.choice(theta.size, size=n, p=theta / theta.sum())
    keep = rng.random(n) < attributed
    w[np.arange(n)[keep], slots[keep]] = 1.0
    return w


async def run(args: argparse.Namespace) -> dict[str, Any]:
    theta = np.asarray(THETA)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        extra: dict[str, Any] = (
            {"generator_refit_growth": 0.0, "generator_drift_window": 10_000} if args.old else {}
        )
        every = args.every if args.old else 1
        settings = Settings(
            cache_dir=Path(tmp),
            generator_url="http://127.0.0.1:9/v1",
            generator_model="simulated",
            **extra,
        )
        state = FolderState(settings.profiles_path)
        spool = state.spool("auto/generator", settings.generator_max_answers, "bench")
        assert spool is not None
        sampler = GeneratorSampler(settings, state.profiles, spool, generator_rules_of(settings))
        n = theta.size
        key = sampler._key(n)
        shown = np.asarray([list(range(n))], dtype=np.int64)
        for row in answers(theta, args.before, args.attributed, rng):
            spool.append(key, (shown, row), time.time())
        await sampler._refit(n)
        st = sampler.status()[0]
        assert st.placing is not None and st.placing.trust is not None, st.fit
        old_top = st.placing.trust.top_slots
        true_top = top_slots(theta[::-1], n, min(2, n))
        withdrawn = replaced = None
        placed: list[tuple[int, list[int] | None]] = []  # (answer, top slots placed by) on change
        top: tuple[int, ...] | None = old_top
        t0 = time.perf_counter()
        after = answers(theta[::-1], args.after, args.attributed, rng)
        for i, row in enumerate(after, 1):
            spool.append(key, (shown, row), time.time())
            st.unfitted += 1  # as _learn counts it
            if i % every == 0:
                await sampler._refit(n, force=False)
            if i % 100 == 0:
                print(f"{i} answers after the reversal", file=sys.stderr, flush=True)
            placing = st.placing
            now = placing.trust.top_slots if placing and placing.trust else None
            if now != top:
                placed.append((i, list(now) if now is not None else None))
            top = now
            if withdrawn is None and top != old_top:
                withdrawn = i
            if top == true_top:
                replaced = i
                break
        seconds = time.perf_counter() - t0
        await sampler.aclose()
    return {
        "mode": "old (refit every answer, no drift test)" if args.old else "new",
        "slots": n,
        "theta": list(THETA),
        "attributed": args.attributed,
        "before": args.before,
        "old_top": list(old_top),
        "new_top": list(true_top),
        "placed_by": placed,
        "withdrawn_after": withdrawn,
        "replaced_after": replaced,
        "drift_events": sampler.counters.drift_events,
        "refit_every": every if args.old else "generator_refit_growth",
        "seconds": round(seconds, 1),
        "seed": args.seed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.generator_drift", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--old", action="store_true")
    ap.add_argument("--before", type=int, default=2000)
    ap.add_argument("--after", type=int, default=3000)
    ap.add_argument("--attributed", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=1, help="--old: refit every this many answers")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
