"""The programs fleet ships to targets, one file each, and the one way to load them.

Shell sent to a target is never a Python string: each script is a file here (``*.sh``, checked
by shellcheck in CI), sent as ``sh -c <text> <$0> <args...>``. Everything variable is a
positional argument, never pasted into the text, so a workdir with quotes or ``$(...)`` stays a
literal path. ``run.sh`` (the tmux pane's wrapper, bash) and ``env_probe.py`` (stdlib Python)
are shipped as files inside the release / env instead.
"""

from __future__ import annotations

import functools
from pathlib import Path

DIR = Path(__file__).resolve().parent


def path(name: str) -> Path:
    """The packaged file ``name`` (a FileNotFoundError names a script that does not exist)."""
    file = DIR / name
    if not file.is_file():
        raise FileNotFoundError(f"fleet/remote/{name}: no such script")
    return file


@functools.cache
def script(name: str) -> str:
    """The text of the packaged script ``name`` (read once per process)."""
    return path(name).read_text(encoding="utf-8")


def sh(name: str, *args: str, dollar0: str = "") -> list[str]:
    """The argv that runs script ``name`` with ``args`` as ``$1...``.

    ``$0`` (what ``ps`` and error messages show) is ``fleet-<name without .sh, _ as ->`` unless
    ``dollar0`` says otherwise.
    """
    return ["sh", "-c", script(name), dollar0 or "fleet-" + Path(name).stem.replace("_", "-"), *args]
