"""Scored designs of sampled live MoI requests, kept to calibrate a bias profile from traffic.

API.md lets a profile be calibrated "from sampled live traffic": the permutations a request
already scored for its own fit are exactly the runs ``solver.calibrate`` pools, so a sampled
request costs nothing extra. With ``traffic_sample_rate`` > 0, each MoI request whose design
can identify the bias on its own (``random``, ``hybrid``: the shape at N slots;
``pruned_random``: everything at L slots) and scored every prompt is kept with that
probability, as numbers only (permutation indices and per-prompt scores, never query or
passage text), in a ring of the latest ``traffic_sample_max_runs`` per (model, template,
design group, slot count). Cyclic designs are not kept (they identify no bias), nor are
variable-pruned ones (ragged prompts), runs that cannot identify a bias on their own (too few
prompts, served with a stored profile) or requests where a prompt failed.

The sample lives in the process: each replica keeps its own and a restart empties it.
Everything here runs on the event loop thread: no locks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

import solver

DesignGroup = Literal["random", "pruned_random"]
"""``random`` pools the full-length designs (``random`` and ``hybrid``, N slots);
``pruned_random`` the pruned-random ones (L slots)."""

_GROUP_OF: dict[str, DesignGroup] = {
    "random": "random",
    "hybrid": "random",
    "pruned_random": "pruned_random",
}


@dataclass(frozen=True)
class SampleKey:
    model: str
    template: str
    design: DesignGroup
    slots: int


@dataclass(frozen=True)
class SampleCount:
    key: SampleKey
    runs: int


Run = tuple[np.ndarray, np.ndarray]


class TrafficSampler:
    """Keeps a random share of live MoI runs (module docstring)."""

    def __init__(self, rate: float, max_runs: int, *, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.rate = rate
        self.max_runs = max_runs
        self._rng = np.random.default_rng(seed)
        self._runs: dict[SampleKey, deque[Run]] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    def offer(
        self, *, model: str, template: str, kind: str, perms: np.ndarray, scores: np.ndarray
    ) -> DesignGroup | None:
        """Keep this run with probability ``rate`` if it can serve a calibration.

        Returns:
            The design group it was kept under, or ``None`` (not drawn, or not usable).
        """
        group = _GROUP_OF.get(kind)
        if group is None or not self.enabled or perms.ndim != 2 or perms.shape[0] < 2:
            return None
        if (perms < 0).any() or not np.isfinite(scores).all():
            return None  # ragged (variable pruning) or a failed prompt
        # A request can run a design that identifies no bias on its own when a stored profile
        # supplies it; one such run would make every later calibration from this key fail.
        design, _ = solver.as_design(perms).compact()
        if solver.identifiability(design).level == "none":
            return None
        if self.rate < 1.0 and self._rng.random() >= self.rate:
            return None
        key = SampleKey(model, template, group, int(perms.shape[1]))
        ring = self._runs.get(key)
        if ring is None:
            ring = self._runs[key] = deque(maxlen=self.max_runs)
        ring.append((perms.copy(), np.asarray(scores, dtype=np.float64).copy()))
        return group

    def runs(self, model: str, template: str, design: DesignGroup, slots: int) -> list[Run]:
        """The kept runs of this key, oldest first (a copy of the list)."""
        return list(self._runs.get(SampleKey(model, template, design, slots), ()))

    def counts(self) -> list[SampleCount]:
        """How many runs each key holds, sorted by model, template, design and slots."""
        keys = sorted(self._runs, key=lambda k: (k.model, k.template, k.design, k.slots))
        return [SampleCount(k, len(self._runs[k])) for k in keys if self._runs[k]]
