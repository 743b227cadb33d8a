"""The programs fleet ships to targets, one file each, and the one way to load them.

Shell sent to a target is never a Python string: each script is a file here (``*.sh``, checked
by shellcheck in CI), sent as ``sh -c <text> <$0> <args...>``. Everything variable is a
positional argument, never pasted into the text, so a workdir with quotes or ``$(...)`` stays a
literal path. ``run.sh`` (the tmux pane's wrapper, bash) and ``env_probe.py`` (stdlib Python)
are shipped as files inside the release / env instead.

A script that answers in sections has the line ``# fleet: prelude``: :func:`script` puts
``prelude.sh`` there (``emit``, ``section``, ``smi_section``, ``limited``), so the helpers are written
once and the script is still one text on the wire; :func:`parse_answers` reads their one framing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

DIR = Path(__file__).resolve().parent
PRELUDE_LINE = "# fleet: prelude"
SECTION_MARK = "@@fleet "  # prelude.sh's emit: "@@fleet <name> <exit code>", then the text


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


@functools.cache
def script(name: str) -> str:
    """The text of the packaged script ``name`` (read once per process), its ``# fleet: prelude``
    line replaced by ``prelude.sh``'s code (its header comments stay here)."""
    text = path(name).read_text(encoding="utf-8")
    if f"\n{PRELUDE_LINE}\n" not in text:
        return text
    lines = path("prelude.sh").read_text(encoding="utf-8").splitlines(keepends=True)
    body = "".join(lines[next(i for i, line in enumerate(lines) if not line.startswith("#")) :])
    return text.replace(f"\n{PRELUDE_LINE}\n", "\n" + body, 1)


def parse_answers(text: str) -> dict[str, Answer]:
    """The ``@@fleet <name> <exit code>`` sections of a prelude script's output (pure); a malformed
    exit code reads as -1, a repeated name keeps the last."""
    parts: dict[str, Answer] = {}
    name, code, lines = "", 0, []
    for line in [*text.splitlines(), f"{SECTION_MARK}end 0"]:
        if line.startswith(SECTION_MARK):
            if name:
                parts[name] = Answer(code, "\n".join(lines).strip("\n"))
            fields = line.split()
            name = fields[1] if len(fields) > 1 else "?"
            code = int(fields[2]) if len(fields) > 2 and fields[2].lstrip("-").isdigit() else -1
            lines = []
        elif name:
            lines.append(line)
    return parts


def sh(name: str, *args: str, dollar0: str = "") -> list[str]:
    """The argv that runs script ``name`` with ``args`` as ``$1...``.

    ``$0`` (what ``ps`` and error messages show) is ``fleet-<name without .sh, _ as ->`` unless
    ``dollar0`` says otherwise.
    """
    return ["sh", "-c", script(name), dollar0 or "fleet-" + Path(name).stem.replace("_", "-"), *args]
