"""The import graph of each package has no cycle, and the trainer never imports fleet.

Every ``import`` statement of every module counts, wherever it stands (module level, inside a
function, under ``TYPE_CHECKING``): a lazy import only hides a cycle until the day someone
moves it to the top. Parsed with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("training",)  # fleet/ joins once its status package is split


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``REPO/package``."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names a module's import statements name (``from a import b`` gives a.b and a)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a package's ``__init__`` counts as one)."""
    known = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = {
            dotted
            for dotted in _imported(tree, name, path.name == "__init__.py")
            if dotted in known and dotted != name
        }
        graph[name] = targets
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_graph_sees_lazy_type_only_and_relative_imports(tmp_path: Path) -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.b import B\n"
        "def f():\n    import pkg.c\n"
        "from . import d\nfrom .e import x\n"
    )
    names = set(_imported(tree, "pkg.a", is_package=False))
    assert {"pkg.b", "pkg.c", "pkg.d", "pkg.e"} <= names


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 5, sorted(graph)  # the walk found the package's modules
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_trainer_imports_nothing_of_fleet_or_the_task_layer() -> None:
    """training/ is deployed alone onto targets: fleet, tasks and fabfile are not there."""
    upward = {
        name: sorted(
            dotted
            for dotted in _imported(ast.parse(path.read_text(encoding="utf-8")), name, False)
            if dotted.split(".")[0] in ("fleet", "tasks", "fabfile")
        )
        for name, path in modules("training").items()
    }
    assert {name: found for name, found in upward.items() if found} == {}
