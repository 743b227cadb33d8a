"""The run dir's contract is spelled once, in training/contract.py: no other file of fleet/ or
training/, nor tasks.py or fabfile.py, spells a run-dir file name or a ``FLEET_*`` variable in code.
The rule has no exceptions: the controller's own settings (``FLEET_TARGET``, ``FLEET_CONFIG``) are in
the contract too, the shell shipped to targets (``fleet/remote/*.sh``) gets the names from the
contract as variables (``# fleet: include contract``), and the remote Python helpers import it.

Read from the source, so prose may mention the names: in Python (``ast``) comments and docstrings,
in shell the ``#`` comment lines. Everything else is code: a string literal, an f-string's text, a
shell word.

What counts as spelling a run-dir file name:

- ``FLEET_X``: anywhere in a Python string or a shell line;
- a name with a dot or a dash (``events.jsonl``, ``run.env``, ``attempts-earlier.jsonl``, ...) or a
  checkpoint's name (``step-00000003.pt``, ``step-*.pt``): anywhere in a Python string or a shell line;
- a plain word (``pid``, ``exit_code``, ``stop_signal``, ...): as a path's component, which in
  Python is an operand of ``/``, an argument of ``join``/``joinpath``/``with_name`` or ``/word``
  inside a string, and in shell ``/word`` or a word of a ``for F in ...`` list (``$run_dir/pid``,
  ``for f in pid pgid``). The same word elsewhere is a key, a field or a variable (``"pid"`` of
  ``run_start``, ``"exit_code"`` of an attempts line, a section's name, ``read -r pgid``), not a
  file's name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from training import contract

REPO = Path(__file__).resolve().parent.parent
FLEET_VAR = re.compile(r"\bFLEET_[A-Z0-9_]*[A-Z0-9]\b")
# The checkpoints' names as code would spell one (a step, a glob, a pattern's text).
CHECKPOINT_TEXT = re.compile(r"step-(?:\d{8}|\*|%08d)\.pt")


def run_dir_names() -> tuple[str, ...]:
    """Every run-dir name of the contract: its files, the prefix of the set-aside ones, run.env's
    trailer line."""
    return (*contract.RUN_DIR_FILES, contract.SET_ASIDE_PREFIX, contract.RUN_ENV_TRAILER)


def _plain(name: str) -> bool:
    """A name that is also an ordinary word or key (``pid``), not only a file's name."""
    return re.fullmatch(r"[a-z_]+", name) is not None


def files(root: Path = REPO) -> list[Path]:
    """Every Python and shell file the rule covers."""
    found = [root / name for name in ("tasks.py", "fabfile.py") if (root / name).exists()]
    for package in ("fleet", "training"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                found.append(path)
    return [p for p in found if p != root / "training" / "contract.py"]


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
    ``x.joinpath("name")``, ``x.with_name("name")``."""
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


def _in_text(text: str, *, shell: bool) -> Iterator[str]:
    """The contract's names that ``text`` (a string's value, a shell line) spells."""
    yield from FLEET_VAR.findall(text)
    yield from CHECKPOINT_TEXT.findall(text)
    for name in run_dir_names():
        if not _plain(name):
            if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text):
                yield name
        elif shell and (
            re.search(rf"/{re.escape(name)}(?=[\s/\"';)]|$)", text)
            or re.search(rf"^\s*for \w+ in (?:.*\s)?{re.escape(name)}(?:\s.*)?; do", text)
        ):
            yield name
        elif not shell and re.search(rf"/{re.escape(name)}(?![\w.-])", text):
            yield name


def python_offenders(path: Path, rel: Path | str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    plain = {n for n in run_dir_names() if _plain(n)}
    for line, part in _path_parts(tree):
        if part in plain or contract.CHECKPOINT_RE.fullmatch(part):
            found.append((line, f"run-dir file {part!r}"))
    for line, text in _strings(tree):
        found += [(line, repr(name)) for name in _in_text(text, shell=False)]
    return [f"{rel}:{line}: {what}" for line, what in sorted(set(found))]


def shell_offenders(path: Path, rel: Path | str) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        found += [f"{rel}:{number}: {name!r}" for name in dict.fromkeys(_in_text(line, shell=True))]
    return found


def offenders(path: Path) -> list[str]:
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return python_offenders(path, rel) if path.suffix == ".py" else shell_offenders(path, rel)


def test_the_contract_lists_every_run_dir_file_and_variable() -> None:
    assert {
        "events.jsonl",
        "train.log",
        "exit_code",
        "pid",
        "pgid",
        "lock",
        "run.json",
        "attempts.jsonl",
        "config.json",
        "stop_signal",
        "run.env",
        "segments.jsonl",
        "attempts-earlier.jsonl",
        "launched_at",
    } <= set(contract.RUN_DIR_FILES)
    assert contract.checkpoint_name(7) == "step-00000007.pt" and contract.CHECKPOINT_RE.fullmatch(
        "step-00000007.pt"
    )
    assert all(FLEET_VAR.fullmatch(v) for v in (*contract.RUN_ENV, *contract.CONTROLLER_ENV))


@pytest.mark.parametrize("path", files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_spells_the_run_dirs_contract(path: Path) -> None:
    assert offenders(path) == []


def test_the_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Docstrings may say events.jsonl and FLEET_DATA_CACHE."""\n'
        "import os\n"
        "def f(run_dir):\n"
        "    # so may comments: train.log, FLEET_TARGET\n"
        '    a = run_dir / "train.log"\n'
        '    b = os.path.join(run_dir, "exit_code")\n'
        '    c = f"{run_dir}/events.jsonl"\n'
        '    d = os.environ.get("FLEET_DATA_CACHE")\n'
        '    e = run_dir / "step-00000003.pt"\n'
        '    g = f"{run_dir}/pgid"\n'
        '    return {"exit_code": 0, "x": "FLEET_TARGET", "pid": 1}\n'
    )
    assert [f.split(": ", 1)[1] for f in offenders(bad)] == [
        "'train.log'",
        "run-dir file 'exit_code'",
        "'events.jsonl'",
        "'FLEET_DATA_CACHE'",
        "'step-00000003.pt'",
        "run-dir file 'step-00000003.pt'",
        "'pgid'",
        "'FLEET_TARGET'",
    ]
    sh = tmp_path / "bad.sh"
    sh.write_text(
        "# comments may say $run_dir/pid and FLEET_RUN_DIR\n"
        'cat -- "$run_dir/pid"\n'
        "for f in exit_code stop_signal; do :; done\n"
        'ls "$1"/checkpoints/step-*.pt\n'
        'printf "%s" "$FLEET_NO_RETRY" > run.env\n'
        'ps -o pid= -p "$$"; echo "$pid"; echo "$EXIT_CODE_FILE"\n'
        "read -r _state pgid _rest; printf '{\"exit_code\": %s}' 0; section exit_code cat x\n"
    )
    assert [f.split(": ", 1)[1] for f in offenders(sh)] == [
        "'pid'",
        "'exit_code'",
        "'stop_signal'",
        "'step-*.pt'",
        "'checkpoints'",
        "'FLEET_NO_RETRY'",
        "'run.env'",
    ]
