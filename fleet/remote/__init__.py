"""The programs fleet ships to targets, one file each, and the one way to load them.

Shell sent to a target is never a Python string: each script is a file here (``*.sh``, checked
by shellcheck in CI), sent as ``sh -c <text> <$0> <args...>``. Everything variable is a
positional argument, never pasted into the text, so a workdir with quotes or ``$(...)`` stays a
literal path. ``run.sh`` (the tmux pane's wrapper, bash) and ``env_probe.py`` (stdlib Python)
are shipped as files inside the release / env instead.

Shell shared by several scripts is written once, in a part file, and a script names it on a line
``# fleet: include <part>``: :func:`script` puts the part's code there, so the script is still one
text on the wire. ``prelude.sh`` (``emit``, ``section``, ``tail_section``, ``smi_section``,
``limited``) is the one framing of every script that answers in several parts, ``@@fleet <name>
<exit code> <lines>`` and then exactly that many lines, read by :func:`parse_answers`;
``rundir.sh`` (``run_alive``, ``latest_run``) is what the run-dir scripts share, ``doctor.sh``
(``nodes``) what both doctor scripts read alike.

One part is not a file: ``# fleet: include contract`` becomes ``training.contract.shell_assignments()``,
``NAME='value'`` lines of the run dir's file names and the run's variable names under the names
they have in ``training/contract.py`` (``$EVENTS_FILE``, ``$RESTART_MAX_ENV``), so no script spells
one itself. Rendered where the text is made: here for ``sh -c``, and by ``fleet.deploy`` for the
``run.sh`` a release carries (``deploy.release_file``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from training import contract

DIR = Path(__file__).resolve().parent
INCLUDE = "# fleet: include "  # followed by a part's file name (prelude.sh, rundir.sh), or CONTRACT
CONTRACT = "contract"  # the generated part: training/contract.py's names as shell assignments
SECTION_MARK = "@@fleet "  # prelude.sh's emit: "@@fleet <name> <exit code> <lines>", then the text


@dataclass(frozen=True)
class Answer:
    """What one command of a script printed (stdout + stderr) and its exit status."""

    exit_code: int
    output: str


def path(name: str) -> Path:
    """The packaged file ``name`` (a FileNotFoundError names a script that does not exist)."""
    file = DIR / name
    if not file.is_file():
        raise FileNotFoundError(f"fleet/remote/{name}: no such script")
    return file


def _part(name: str) -> str:
    """A part's code: the contract's assignments, or a part file's code (its header comments, up
    to the first other line, stay here)."""
    if name == CONTRACT:
        return contract.shell_assignments()
    lines = path(name).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[next(i for i, line in enumerate(lines) if not line.startswith("#")) :])


@functools.cache
def script(name: str) -> str:
    """The text of the packaged script ``name`` (read once per process), each of its
    ``# fleet: include <part>`` lines replaced by that part's code."""
    out = []
    for line in path(name).read_text(encoding="utf-8").splitlines(keepends=True):
        out.append(_part(line[len(INCLUDE) :].strip()) if line.startswith(INCLUDE) else line)
    return "".join(out)


def parse_answers(text: str) -> dict[str, Answer]:
    """The sections of a prelude script's output (pure): each header ``@@fleet <name> <exit code>
    <lines>`` is followed by exactly ``<lines>`` lines of text, so a text line that looks like a
    header is text. A name may hold spaces (the last two fields are numbers); a malformed exit code
    reads as -1; a repeated name keeps the last; what is outside any section is ignored, and a
    section cut short (the connection dropped) keeps the lines that came."""
    parts: dict[str, Answer] = {}
    lines = text.removesuffix("\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith(SECTION_MARK):
            continue
        head = line[len(SECTION_MARK) :].rsplit(" ", 2)
        if len(head) != 3 or not head[2].isdigit():
            continue
        name, code, count = head[0], head[1], int(head[2])
        parts[name] = Answer(int(code) if code.lstrip("-").isdigit() else -1, "\n".join(lines[i : i + count]))
        i += count
    return parts


def ok_output(parts: dict[str, Answer], name: str) -> str:
    """Section ``name``'s text where its command succeeded; "" where it failed or is missing (a
    file not there, no tmux server: the error message is not the file's content)."""
    part = parts.get(name)
    return part.output if part is not None and part.exit_code == 0 else ""


def sh(name: str, *args: str, dollar0: str = "") -> list[str]:
    """The argv that runs script ``name`` with ``args`` as ``$1...``.

    ``$0`` (what ``ps`` and error messages show) is ``fleet-<name without .sh, _ as ->`` unless
    ``dollar0`` says otherwise.
    """
    return ["sh", "-c", script(name), dollar0 or "fleet-" + Path(name).stem.replace("_", "-"), *args]
