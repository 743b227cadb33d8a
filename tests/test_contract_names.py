"""The run dir's contract is spelled once, in training/contract.py: no other module of fleet/ or
training/ (or tasks.py) builds a path to a run-dir file by its literal name, nor names a ``FLEET_*``
variable of the run's environment. Read from the source (``ast``), so comments and docstrings may
mention them; code must use the contract's constants.

Left out: the controller's own settings (``FLEET_TARGET``, ``FLEET_CONFIG``, ``FLEET_WHEELS``: read
by fab on the controller, never passed to a run) and ``fleet/remote/``: stdlib scripts that run
isolated (``python -I``) on the target, told what they need by their caller.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from training import contract

REPO = Path(__file__).resolve().parent.parent
CONTROLLER_SETTINGS = frozenset({"FLEET_TARGET", "FLEET_CONFIG", "FLEET_WHEELS"})
FLEET_VAR = re.compile(r"\bFLEET_[A-Z0-9_]*[A-Z0-9]\b")


def modules(root: Path = REPO) -> list[Path]:
    found = [root / "tasks.py"] if (root / "tasks.py").exists() else []
    for package in ("fleet", "training"):
        found += [
            p for p in sorted((root / package).rglob("*.py")) if "remote" not in p.relative_to(root).parts
        ]
    return [p for p in found if p.name != "contract.py" or p.parent.name != "training"]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value


def _path_parts(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """String literals used as a path's component: ``x / "name"``, ``join(x, "name")``,
    ``x.joinpath("name")``, ``x.with_name("name")``, and ``/name`` inside any string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    yield side.lineno, side.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("join", "joinpath", "with_name") and not (
                isinstance(node.func.value, ast.Constant)  # "sep".join(...) is not a path
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        yield arg.lineno, arg.value
    for line, text in _strings(tree):
        for name in contract.RUN_DIR_FILES:
            if f"/{name}" in text:
                yield line, name


def offenders(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []
    names = set(contract.RUN_DIR_FILES)
    for line, part in _path_parts(tree):
        if part in names or contract.CHECKPOINT_RE.fullmatch(part):
            found.append(f"{rel}:{line}: run-dir file {part!r}")
    for line, text in _strings(tree):
        for var in FLEET_VAR.findall(text):
            if var not in CONTROLLER_SETTINGS:
                found.append(f"{rel}:{line}: {var}")
    return found


def test_the_contract_lists_every_run_dir_file_and_variable() -> None:
    assert {"events.jsonl", "train.log", "exit_code", "pid", "pgid", "run.json", "attempts.jsonl"} <= set(
        contract.RUN_DIR_FILES
    )
    assert contract.checkpoint_name(7) == "step-00000007.pt" and contract.CHECKPOINT_RE.fullmatch(
        "step-00000007.pt"
    )
    assert all(FLEET_VAR.fullmatch(v) for v in contract.RUN_ENV)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_spells_the_run_dirs_contract(path: Path) -> None:
    assert offenders(path) == []


def test_the_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Docstrings may say events.jsonl and FLEET_DATA_CACHE."""\n'
        "import os\n"
        "def f(run_dir):\n"
        '    a = run_dir / "train.log"\n'
        '    b = os.path.join(run_dir, "exit_code")\n'
        '    c = f"{run_dir}/events.jsonl"\n'
        '    d = os.environ.get("FLEET_DATA_CACHE")\n'
        '    e = run_dir / "step-00000003.pt"\n'
        '    return {"exit_code": 0, "x": "FLEET_TARGET"}\n'
    )
    found = offenders(bad)
    assert [f.split(": ", 1)[1] for f in found] == [
        "run-dir file 'train.log'",
        "run-dir file 'exit_code'",
        "run-dir file 'step-00000003.pt'",
        "run-dir file 'events.jsonl'",
        "FLEET_DATA_CACHE",
    ]
