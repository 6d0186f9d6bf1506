"""Every reordering method behind one port (``Strategy``), by its wire name: the registry.

A strategy's name is typed once, on its class (``name``); this registry is the one list of
them. To add one: implement ``service.strategies.protocol.Strategy`` in a module here (its
``name``, ``options``, ``ranks`` and its ``reference`` row) and ``register`` an instance below.
Everything else is derived from the registry: the HTTP schema's accepted values
(``app.schemas.base.Strategy``) and so the OpenAPI document, ``/info``'s ``strategies`` and
``ranking_strategies``, the CLI's choices, the metrics, the strategies table of
docs/strategies.md (``scripts/gen_strategies_reference.py``) and the tests that run every
strategy. tests/repository/test_strategy_names.py fails if a list of the names is typed
anywhere else.
"""

from __future__ import annotations

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

STRATEGIES: dict[str, Strategy] = {}
"""The registry: every strategy by its name, in the order the schema and ``/info`` list them."""


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry under its ``name``.

    Before the app is imported: the wire schema takes its accepted values from the registry
    when ``app.schemas`` is first imported.

    Raises:
        ValueError: another strategy has that name.
    """
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is registered twice")
    STRATEGIES[strategy.name] = strategy
    register_option_users(strategy)
    return strategy


for _s in (
    MoI(),
    Auto(),
    QueryLikelihood(),
    ConvexScore(),
    Lore(),
    MinDistraction(),
    MaxRelevance(),
    Retriever(),
    Inverse(),
    Shuffle(),
    Litm(),
    BayesSaliency(),
    QueryGeneration(),
    LongLLMLingua(),
    SelfConsistency(),
    Bm25(),
    Dense(),
):
    register(_s)


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


def strategy_names() -> tuple[str, ...]:
    """Every strategy's wire name, ``moi`` first, then ``auto`` (the default)."""
    return tuple(STRATEGIES)


def ranking_strategy_names() -> tuple[str, ...]:
    """The strategies that rank: ``placement`` and ``bias_profile`` apply to them."""
    return tuple(name for name, s in STRATEGIES.items() if s.ranks)
