"""The strategy port: the ``Strategy`` protocol every reordering method implements, its row in
the strategies reference (``Reference``), and the option registry that lets a refusal name an
option's users.

A strategy reaches the model only through ``Work`` (``service/strategies/work.py``); the
request, cost and result types are in ``service/strategies/request.py``. Each is imported from
where it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from service.config.settings import Settings
from service.errors import InvalidRequest
from service.strategies.request import Cost, Outcome, ReorderRequest
from service.strategies.work import Work


@dataclass(frozen=True)
class Reference:
    """A strategy's row in the strategies table of docs/strategies.md (generated from the
    registry by ``scripts/gen_strategies_reference.py``), as Markdown; the options column is
    derived from ``options``, ``uses_design`` and ``ranks``."""

    rule: str
    """How it orders the passages."""
    calls: str
    """The model calls it makes for N passages ("0" for none)."""
    returns: str = ""
    """What the response carries besides the order."""
    source: str = ""
    """The paper or method it implements, beside its name."""
    options_note: str = ""
    """What its options mean where their names do not say (defaults, restrictions)."""


class Strategy(Protocol):
    """One reordering method. Implementations are stateless; one instance serves all requests."""

    name: str
    """Its wire name, typed only here: the registry (``service.strategies``) lists it under
    this name, and the schema, ``/info`` and the docs take it from there."""
    options: frozenset[str]
    """The ``StrategyOptions`` fields it reads."""
    uses_design: bool
    """Whether it reads ``design`` and ``joint`` (MoI only)."""
    ranks: bool
    """Whether it ranks the passages, so that ``placement`` and ``bias_profile`` apply (the
    pure placements and the strategies that place by their own measured profile do not)."""
    reference: Reference
    """Its row in the strategies reference."""

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        """The model calls (scored prompts and generations) the request will need, stated
        before any call: the request limits count them, admission estimates the request's
        seconds from them (issue 62).

        Raises:
            InvalidRequest: the request cannot be run by this strategy.
        """
        ...

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        """Order ``request.passages``.

        Raises:
            ReorderError: a client error (bad options), or too many prompts failed.
        """
        ...


def check_options(strategy: Strategy, request: ReorderRequest) -> None:
    """Reject options the strategy does not read (never ignore a caller's setting).

    Raises:
        InvalidRequest: naming the first option the strategy does not use.
    """
    for name in sorted(request.options.set_names() - strategy.options):
        users = ", ".join(sorted(_option_users(name))) or "no strategy"
        raise InvalidRequest(
            f"{name} does not apply to strategy {strategy.name!r} (used by: {users})",
            param=name,
        )
    default = ReorderRequest(query="", passages=())
    if not strategy.uses_design:
        for name in ("design", "joint"):
            if getattr(request, name) != getattr(default, name):
                raise InvalidRequest(
                    f"{name} applies to strategy 'moi' only, not {strategy.name!r}", param=name
                )
    if not strategy.ranks:
        for name in ("placement", "bias_profile"):
            if getattr(request, name) != getattr(default, name):
                users = ", ".join(sorted(_RANKERS))
                raise InvalidRequest(
                    f"{name} applies to strategies that rank ({users}), not {strategy.name!r}, "
                    "which places the passages itself",
                    param=name,
                )


_USERS: dict[str, set[str]] = {}
_RANKERS: set[str] = set()


def register_option_users(strategy: Strategy) -> None:
    """Record which options ``strategy`` reads, so a refusal can name their users."""
    for name in strategy.options:
        _USERS.setdefault(name, set()).add(strategy.name)
    if strategy.ranks:
        _RANKERS.add(strategy.name)


def _option_users(name: str) -> set[str]:
    return _USERS.get(name, set())
