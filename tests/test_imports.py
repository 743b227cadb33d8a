"""The import graph: no cycles, no module importing upward into the task layer, the layers apart.

The graph is read from the source (``ast``), not by importing: every ``import`` statement of a
module counts, at module level or inside a function (a lazy import still couples the two), except
under ``if TYPE_CHECKING:`` (never runs). Only edges between the modules of ``PACKAGES`` and the
task layer are followed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "training")  # walked for cycles and upward imports; add a package name to cover it too
TASK_LAYER = ("tasks", "fabfile")  # the Fabric tasks: they import fleet, never the other way round
STDLIB_ONLY = ("training.contract", "training")  # shipped to targets and imported by the controller
# The trainer's layers, lowest first: a module imports its own layer or lower ones, never higher
# (a module is in the layer of its longest listed prefix).
TRAINING_LAYERS: tuple[tuple[str, ...], ...] = (
    ("training", "training.contract"),  # stdlib only, shared with the controller
    ("training.config", "training.events", "training.progress"),
    (
        "training.data",
        "training.compile",
        "training.wandb_logger",
        "training.topology",
        "training.launch",
        "training.engines.llamacpp",  # llama.cpp: its build, GGUF conversion and server (stdlib)
        "training.engines.gguf",
        "training.engines.server",
    ),
    ("training.model",),  # what is trained, against what
    # kernel_warmup: the target cut to one layer of each kind, its kernels warmed in a child process
    ("training.run.checkpoint", "training.run.pipeline", "training.run.eval", "training.run.kernel_warmup"),
    ("training.run.core",),  # what every driver runs
    # what prepares or checks a run, or prices its drafter's DDTree budgets
    (
        "training.run.warm",
        "training.run.resume_check",
        "training.run.tree_cost",
        "training.run.tree_calibration",
    ),
    ("training.export",),
    # the drivers (serve_bench: a trained run's drafter in llama.cpp)
    ("training.run.single", "training.run.distributed", "training.run.plan", "training.engines.serve_bench"),
    ("training.__main__", "training.selftest", "training.assets"),  # entry points
)
# (importer, module it must not reach, directly or through others)
MUST_NOT_REACH = (
    ("fleet.status.model", "fleet.status.render"),  # the model never imports its view
    ("fleet.status.model", "fleet.status.fetch"),  # nor the I/O
    ("fleet.status.diagnose", "fleet.status.model"),
)


def module_files(package: str) -> dict[str, Path]:
    """Every module of ``package`` (a directory under the repo, or a top-level ``<name>.py``)."""
    root = REPO / package
    if not root.is_dir():
        return {package: REPO / f"{package}.py"}
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(ast.Module([child], []))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from _import_nodes(node)


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules ``name`` imports: a ``from pkg import sub`` of a known submodule is ``pkg.sub``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in known else base)
    return found


def graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` + the task layer it imports (others are left out)."""
    files: dict[str, Path] = {}
    for package in (*packages, *TASK_LAYER):
        files.update(module_files(package))
    known = set(files)

    def resolve(imported: str) -> str | None:  # the module itself, or its nearest known package
        parts = imported.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in known), None)

    edges = {}
    for name, path in files.items():
        targets = {resolve(imported) for imported in imported_names(name, path, known)}
        edges[name] = {t for t in targets if t is not None and t != name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    edges = graph((package,))
    assert len(edges) > len(TASK_LAYER), f"no modules found for {package}"
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_the_task_layer(package: str) -> None:
    edges = graph((package,))
    upward = sorted(
        f"{name} imports {target}"
        for name, targets in edges.items()
        if name.split(".")[0] == package
        for target in targets
        if target in TASK_LAYER
    )
    assert upward == []


def test_the_trainer_never_imports_the_controller() -> None:
    """training/ is deployed alone to targets: it must not need fleet/ or the tasks."""
    edges = graph(("fleet", "training"))
    upward = sorted(
        f"{name} imports {target}"
        for name, targets in edges.items()
        if name.split(".")[0] == "training"
        for target in targets
        if target.split(".")[0] in ("fleet", *TASK_LAYER)
    )
    assert upward == []


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = TRAINING_LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def upward_imports(edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import of a higher layer by a module of the layers."""
    found = []
    for name, targets in sorted(edges.items()):
        mine = layer_of(name, layers)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > mine:
                found.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    return found


def test_the_trainer_imports_only_downward() -> None:
    assert upward_imports(graph(("training",)), TRAINING_LAYERS) == []


def test_the_layer_check_can_fail() -> None:
    edges = {
        "training.run.core": {"training.run.warm", "training.model.drafter"},
        "training.data.x": {"training"},
    }
    assert upward_imports(edges, TRAINING_LAYERS) == [
        "training.run.core (layer 5) imports training.run.warm (layer 6)"
    ]


@pytest.mark.parametrize(("importer", "forbidden"), MUST_NOT_REACH)
def test_layers_stay_apart(importer: str, forbidden: str) -> None:
    edges = graph(PACKAGES)
    assert importer in edges and forbidden in edges
    assert forbidden not in reachable(edges, importer)


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_contract_imports_only_the_standard_library(module: str) -> None:
    """training.contract is imported by the controller, where torch may be absent."""
    path = module_files("training")[module]
    tops = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            tops.add("training")
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            tops.update(n.split(".")[0] for n in names)
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    assert sorted(tops - allowed) == []


def test_the_graph_sees_a_cycle_and_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a made-up package with a cycle and an import of tasks."""
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n    import tasks\n")
    (tmp_path / "tasks.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import demo.a\n")
    (tmp_path / "fabfile.py").write_text("from tasks import ns\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    edges = graph(("demo",))
    assert edges["demo.a"] == {"demo.sub.b"} and edges["demo.sub.b"] == {"demo.a", "tasks"}
    assert edges["tasks"] == set() and edges["fabfile"] == {"tasks"}
    assert find_cycle(edges) == ["demo.a", "demo.sub.b", "demo.a"]
