"""The strategy variants an evaluation runs, and how ``--strategies`` names them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.errors import InvalidRequest
from service.strategies import strategy_names
from service.strategies.request import DesignKind, Placement

MOI_DESIGNS: tuple[DesignKind, ...] = (
    "pruned_random",
    "random",
    "hybrid",
    "cyclic",
    "pruned_cyclic",
    "adaptive",
)
PLACEMENTS: tuple[Placement, ...] = ("descending_utility", "bias_matched")
# The cheap rankers evaluated also under the placements a request can ask for (issue 20):
# each alone (its own order, best first), then as LangChain's LongContextReorder places a
# reranker's output (`litm`), then by the generator's calibrated bias (`bias_matched`).
PLACED_RANKERS: tuple[str, ...] = ("query_generation", "bm25", "dense")
RANKER_PLACEMENTS: tuple[Placement, ...] = ("litm", "bias_matched")
GENERATOR_BIAS = "generator_bias"
"""The label suffix of MoI's fit placed ``bias_matched`` by the *generator's* stored profile
instead of the bias it fitted on the scorer (issue 20: a small scorer for another generator).
Only a run whose generator is not the scorer has these variants: with one model the two are
the same model's bias."""


STATEFUL = "auto"
"""Not a variant: what ``auto`` does depends on the requests before it (it learns a profile
from them), so it is measured on a stream (``bench/auto_stream.py``), not per question."""


@dataclass(frozen=True)
class Variant:
    """One strategy configuration under evaluation."""

    label: str
    strategy: str
    design: DesignKind | None = None
    placement: Placement | None = None
    by_generator: bool = False
    """MoI: placed by the generator's stored bias profile, not the fit's (``GENERATOR_BIAS``)."""


def all_variants(*, cross_model: bool = False) -> list[Variant]:
    """Every registered strategy but ``auto`` (``STATEFUL``); ``moi`` once per design kind and
    placement (and, with ``cross_model``, ``moi:<design>:generator_bias``); each of
    ``PLACED_RANKERS`` alone and once per ``RANKER_PLACEMENTS`` (``<strategy>:<placement>``)."""
    out: list[Variant] = []
    for name in strategy_names():
        if name == STATEFUL:
            continue
        if name == "moi":
            for d in MOI_DESIGNS:
                out.extend(Variant(f"moi:{d}:{p}", "moi", d, p) for p in PLACEMENTS)
                if cross_model:
                    out.append(Variant(f"moi:{d}:{GENERATOR_BIAS}", "moi", d, "bias_matched", True))
        else:
            out.append(Variant(name, name))
            if name in PLACED_RANKERS:
                out.extend(Variant(f"{name}:{p}", name, None, p) for p in RANKER_PLACEMENTS)
    return out


def select_variants(spec: Sequence[str] | None, *, cross_model: bool = False) -> list[Variant]:
    """The variants named in ``spec``: a strategy name (all its variants), ``moi:<design>``
    (every placement), or a full label (``moi:<design>:<placement>``, ``bm25:litm``;
    ``bm25:descending_utility`` is the ranker's own order alone, the variant labelled
    ``bm25``); ``None`` or empty for all. ``cross_model``: the generator is not the scorer, so the
    ``generator_bias`` MoI variants exist.

    Raises:
        InvalidRequest: a name that matches no variant.
    """
    every = all_variants(cross_model=cross_model)
    if not spec:
        return every
    chosen: list[Variant] = []
    for raw in spec:
        name = raw.strip()
        if not cross_model and name.endswith(f":{GENERATOR_BIAS}"):
            raise InvalidRequest(
                f"variant {name!r} places by the generator's bias profile, so it needs a "
                "generator other than the scorer (--generator)",
                param="strategies",
            )
        hits = [
            v
            for v in every
            if name in (v.label, v.strategy, _own_order(v))
            or (":" in name and v.label.startswith(name + ":"))
        ]
        if not hits:
            known = ", ".join(dict.fromkeys(v.strategy for v in every))
            raise InvalidRequest(
                f"unknown strategy or variant {name!r}; strategies: {known}; MoI variants are "
                "moi:<design>[:<placement>], ranker variants <strategy>:<placement> for "
                f"{', '.join(PLACED_RANKERS)}",
                param="strategies",
            )
        chosen.extend(v for v in hits if v not in chosen)
    return chosen


def _own_order(v: Variant) -> str | None:
    """``<ranker>:descending_utility`` names a placed ranker's unplaced variant (its own order is
    best first), so it can be chosen without the ranker's placed variants."""
    if v.strategy in PLACED_RANKERS and v.placement is None:
        return f"{v.strategy}:descending_utility"
    return None
