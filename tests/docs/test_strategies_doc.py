"""docs/strategies.md's table of strategies is generated from the registry: one row per
registered strategy, its options derived from what the strategy reads."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from service.strategies import STRATEGIES, get_strategy
from service.strategies.protocol import Reference
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _gen() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_strategies_reference.py", "gen_strategies_ref")


def test_the_strategies_table_is_current() -> None:
    gen = _gen()
    page = (ROOT / "docs" / "strategies.md").read_text()
    block = page[page.index(gen.BEGIN) : page.index(gen.END) + len(gen.END)]
    assert block == gen.render(), (
        "docs/strategies.md is stale: run scripts/gen_strategies_reference.py"
    )
    for name in STRATEGIES:
        assert block.count(f"\n| `{name}`") == 1, name


def test_a_registered_strategy_gets_its_row_with_the_options_it_reads() -> None:
    class Toy:
        name = "toy"
        reference = Reference(
            rule="best | worst", calls="0", source="a paper", options_note="`seed`: any"
        )
        options = frozenset({"seed"})
        uses_design = False
        ranks = True

    gen = _gen()
    block = gen.render([get_strategy("moi"), Toy()], default="toy")
    rows = block.splitlines()
    (toy,) = [r for r in rows if r.startswith("| `toy`")]
    assert toy == (
        "| `toy` (a paper) (default) | best \\| worst | 0 | "
        "`bias_profile`, `placement`, `seed` (`seed`: any) |  |"
    )
    (moi,) = [r for r in rows if r.startswith("| `moi`")]
    assert "`design`, `joint`" in moi and "(default)" not in moi
