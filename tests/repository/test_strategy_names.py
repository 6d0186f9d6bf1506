"""The strategies' names are listed once, in the registry (``service.strategies``): no list of
them is typed anywhere else in the repository's code, where it would go stale the day a
strategy is added (there were three: the wire type, the registry and a benchmark's).

A *list of the names* is a tuple, list, set, dict or ``Literal[...]`` literal holding more
than half of the registered names: a copy of the registry, whatever it is called. A few names
chosen for a purpose (a study's baselines, ``auto``'s rankers, "``moi`` and ``auto`` place by
themselves") are not a copy and are not flagged; a single name (a class's ``name``, a
comparison) never is.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from service.strategies import strategy_names

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {
    "tests",
    # The client is its own distribution and imports nothing of the server; its names are
    # compared with a running server's OpenAPI document (clients/python/tests/test_wire_names.py).
    "clients",
}


def typed_lists(source: str, names: set[str]) -> Iterator[tuple[int, list[str]]]:
    """``(line, names)`` of every collection literal in ``source`` holding more than half of
    ``names``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        found = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
        if len(set(found)) > len(names) / 2:
            yield node.lineno, found


def code_files() -> Iterator[Path]:
    for top in sorted(ROOT.iterdir()):
        if top.name.startswith(".") or top.name in SKIPPED:
            continue
        if top.suffix == ".py":
            yield top
        elif top.is_dir():
            yield from (p for p in sorted(top.rglob("*.py")) if ".venv" not in p.parts)


def test_no_list_of_the_strategy_names_is_typed_outside_the_registry() -> None:
    names = set(strategy_names())
    found = [
        f"{path.relative_to(ROOT)}:{line}: {hits}"
        for path in code_files()
        for line, hits in typed_lists(path.read_text(), names)
    ]
    assert not found, "derive these from service.strategies (the registry):\n" + "\n".join(found)


def test_the_check_finds_a_copy_and_leaves_a_purposeful_few() -> None:
    names = {"a", "b", "c", "d", "e"}
    source = (
        'Name = Literal["a", "b", "c", "d", "e"]\n'  # the wire type, typed again
        'SOME = ("a", "b", "c")\n'  # more than half: a copy
        'PAIR = ("a", "b")\n'  # a purpose of its own
        'name = "a"\n'
        'if x in {"a": 1, "b": 2, "d": 3}: pass\n'
    )
    assert sorted(line for line, _ in typed_lists(source, names)) == [1, 2, 5]
    assert list(code_files())  # it reads the repository's code
    assert ROOT / "service" / "strategies" / "__init__.py" in set(code_files())
