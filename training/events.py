"""The events.jsonl writer (stdlib only); the schema, validator and reader are training.contract's.

Every process of a run appends JSON lines to ``<run-dir>/events.jsonl``; ``fab status``
reads them. The full contract, with types and units, is ``training/EVENTS.md``. This module
must import nothing but the standard library: ``training.selftest`` uses it where torch is absent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from training.contract import (  # noqa: F401  (the schema and reader, re-exported)
    BUCKET_FIELDS,
    COMMON_FIELDS,
    EVENT_FIELDS,
    EVENTS_FILE,
    PHASES,
    ROLES,
    SCHEMA_VERSION,
    read_events,
    validate_event,
    validate_line,
)


def _jsonable(value: Any) -> Any:
    """Plain JSON types for numbers that come from numpy/torch scalars or tuples."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class EventWriter:
    """Appends events of one process (``rank``, ``role``) to ``<run_dir>/events.jsonl``.

    Lines are written with one ``write`` each on a file opened in append mode, so several
    processes can share the file; each line is flushed as written. A lock orders the writes of
    this process's threads (a phase's progress reporter writes from its own thread).
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int = 0, role: str = "single") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / EVENTS_FILE
        self.rank = rank
        self.role = role
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event line and return the object written."""
        obj: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "ts": time.time(),
            "event": event,
            "rank": self.rank,
            "role": self.role,
        }
        obj.update(_jsonable(fields))
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"EventWriter for {self.path} is closed")
            self._file.write(line)
            self._file.flush()
        return obj

    def phase(self, phase: str) -> dict[str, Any]:
        """Shorthand for a ``phase`` event."""
        return self.emit("phase", phase=phase)

    def error(self, exc: BaseException, message: str | None = None, **extra: Any) -> dict[str, Any]:
        """An ``error`` event for ``exc`` (``message``: its first line unless given; the tail of its
        traceback), then ``phase: error``. Returns the error event."""
        tail = "".join(traceback.format_exception(exc)[-6:])[-2000:]
        text = first_line(exc) if message is None else message
        emitted = self.emit("error", type=type(exc).__name__, message=text, traceback_tail=tail, **extra)
        self.phase("error")
        return emitted

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_main_process() -> bool:
    """True on rank 0 (``RANK`` unset counts as rank 0)."""
    return os.environ.get("RANK", "0") == "0"


def print0(*args: object, file: TextIO | None = None, **kwargs: Any) -> None:
    """``print`` on the main process only, flushed (stdout is read live in tmux)."""
    if is_main_process():
        print(*args, file=file if file is not None else sys.stdout, flush=True, **kwargs)
