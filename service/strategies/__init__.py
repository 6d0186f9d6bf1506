"""Every reordering method behind one port (``Strategy``), by its wire name.

To add one: implement ``service.strategies.protocol.Strategy`` in a module here, add an instance
to ``_ALL`` below and its name to ``StrategyName``; the HTTP schema, the CLI, the metrics and
the tests that run every strategy pick it up from the registry.
"""

from __future__ import annotations

from service.config.strategy_names import StrategyName
from service.errors import InvalidRequest
from service.strategies.auto import Auto
from service.strategies.distraction import MaxRelevance, MinDistraction
from service.strategies.likelihood import ConvexScore, QueryLikelihood
from service.strategies.lore import Lore
from service.strategies.model_free import Inverse, Litm, Retriever, Shuffle
from service.strategies.moi import MoI
from service.strategies.pointwise import BayesSaliency, LongLLMLingua, QueryGeneration
from service.strategies.protocol import Strategy, register_option_users
from service.strategies.retrieval import Bm25, Dense
from service.strategies.self_consistency import SelfConsistency

_ALL: tuple[Strategy, ...] = (
    MoI(),
    Auto(),
    Retriever(),
    Inverse(),
    Shuffle(),
    Litm(),
    QueryLikelihood(),
    ConvexScore(),
    QueryGeneration(),
    BayesSaliency(),
    LongLLMLingua(),
    Lore(),
    SelfConsistency(),
    MaxRelevance(),
    MinDistraction(),
    Bm25(),
    Dense(),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
for _s in _ALL:
    register_option_users(_s)


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``.

    Raises:
        InvalidRequest: no such strategy (the message lists the known ones).
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join(STRATEGIES)
        raise InvalidRequest(
            f"unknown strategy {name!r}; known: {known}", param="strategy"
        ) from None


def strategy_names() -> tuple[StrategyName, ...]:
    """Every strategy's wire name, ``moi`` first, then ``auto`` (the default)."""
    return tuple(s.name for s in _ALL)


def ranking_strategy_names() -> tuple[StrategyName, ...]:
    """The strategies that rank: ``placement`` and ``bias_profile`` apply to them."""
    return tuple(s.name for s in _ALL if s.ranks)
