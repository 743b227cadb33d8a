"""The events.jsonl contract: writer, schema and validator (stdlib only).

Every process of a run appends JSON lines to ``<run-dir>/events.jsonl``; ``fab status``
reads them. The full contract, with types and units, is ``training/EVENTS.md``; the
table here is the machine-checked form of it. This module must import nothing but the
standard library: ``training.selftest`` uses it where torch is absent.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

SCHEMA_VERSION = 1
EVENTS_FILE = "events.jsonl"
ROLES = ("single", "target", "drafter")
PHASES = (
    "load_data",
    "buckets",
    "load_target",
    "load_drafter",
    "compile",
    "train",
    "eval",
    "checkpoint",
    "done",
    "stopped",
    "error",
)

# Field kinds: "int", "float" (int accepted), "str", "list[float]", "list[int]", "buckets", "phase",
# "float?" (a float or null).
COMMON_FIELDS: dict[str, str] = {"v": "int", "ts": "float", "event": "str", "rank": "int", "role": "role"}

EVENT_FIELDS: dict[str, dict[str, str]] = {
    "run_start": {
        "config": "str",
        "run_dir": "str",
        "pid": "int",
        "host": "str",
        "world_size": "int",
        "device": "str",
    },
    "phase": {"phase": "phase"},
    "buckets": {
        "batches_per_epoch": "int",
        "min": "int",
        "max": "int",
        "avg": "float",
        "buckets": "buckets",
    },
    "load_progress": {"what": "str", "done": "int", "total": "int", "seconds": "float"},
    "step": {
        "step": "int",
        "total_steps": "int",
        "epoch": "int",
        "loss": "float",
        "acc": "list[float]",
        "tau": "float",
        "lr": "float",
        "tokens_per_s": "float",
        "grad_norm": "float",
        "mem_gib": "float",
    },
    "checkpoint": {"step": "int", "path": "str", "seconds": "float"},
    "eval": {"step": "int", "tau_mean": "float", "tau_hist": "list[int]", "tau_estimate": "float"},
    "compile_cache": {
        "fxgraph_hit": "int",
        "fxgraph_miss": "int",
        "aotautograd_hit": "int",
        "aotautograd_miss": "int",
    },
    "balance": {"window_s": "float", "busy_s": "float", "wait_s": "float", "tokens_per_s": "float"},
    "error": {"type": "str", "message": "str", "traceback_tail": "str"},
    "done": {"steps": "int", "seconds": "float"},
}

BUCKET_FIELDS: dict[str, str] = {
    "index": "int",
    "lo": "int",
    "hi": "int",
    "batches": "int",
    "percent": "float",
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_float(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not (
        isinstance(value, float) and math.isinf(value)
    )


def _check(kind: str, value: object, where: str) -> list[str]:
    """Problems with ``value`` against field kind ``kind``; empty when it fits."""
    ok: bool
    if kind == "int":
        ok = _is_int(value)
    elif kind == "float":
        ok = _is_float(value)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "role":
        ok = value in ROLES
    elif kind == "phase":
        ok = value in PHASES
    elif kind == "list[float]":
        ok = isinstance(value, list) and all(_is_float(x) for x in value)
    elif kind == "list[int]":
        ok = isinstance(value, list) and all(_is_int(x) for x in value)
    elif kind == "buckets":
        if not isinstance(value, list):
            return [f"{where}: expected a list of buckets, got {type(value).__name__}"]
        problems: list[str] = []
        for i, bucket in enumerate(value):
            if not isinstance(bucket, dict):
                problems.append(f"{where}[{i}]: expected an object")
                continue
            for name, sub in BUCKET_FIELDS.items():
                if name not in bucket:
                    problems.append(f"{where}[{i}].{name}: missing")
                else:
                    problems.extend(_check(sub, bucket[name], f"{where}[{i}].{name}"))
        return problems
    else:  # pragma: no cover - a typo in the table above
        raise ValueError(f"unknown field kind {kind!r}")
    if ok:
        return []
    return [f"{where}: expected {kind}, got {value!r:.60}"]


def validate_event(obj: object) -> list[str]:
    """Every way ``obj`` (one parsed events.jsonl line) breaks the schema; empty when valid.

    Unknown events and extra fields are allowed (forward compatible); known events must
    carry all their fields with the right types. NaN is accepted for floats (a diverged loss
    is still a valid report), infinity is not (JSON cannot carry it).
    """
    if not isinstance(obj, dict):
        return [f"line is {type(obj).__name__}, expected an object"]
    problems: list[str] = []
    for name, kind in COMMON_FIELDS.items():
        if name not in obj:
            problems.append(f"{name}: missing")
        else:
            problems.extend(_check(kind, obj[name], name))
    if obj.get("v") not in (None, SCHEMA_VERSION) and _is_int(obj.get("v")):
        problems.append(f"v: unsupported schema version {obj['v']} (this reader knows {SCHEMA_VERSION})")
    event = obj.get("event")
    fields = EVENT_FIELDS.get(event) if isinstance(event, str) else None
    if fields is None:
        return problems
    for name, kind in fields.items():
        if name not in obj:
            problems.append(f"{event}.{name}: missing")
        else:
            problems.extend(_check(kind, obj[name], f"{event}.{name}"))
    return problems


def validate_line(line: str) -> list[str]:
    """Parse one events.jsonl line and validate it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc.msg} at column {exc.colno}"]
    return validate_event(obj)


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
    processes can share the file; each line is flushed as written.
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
        if self._file is None:
            raise ValueError(f"EventWriter for {self.path} is closed")
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
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
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All parseable event objects of an events.jsonl file (a torn last line is skipped)."""
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                events.append(obj)
    return events


def is_main_process() -> bool:
    """True on rank 0 (``RANK`` unset counts as rank 0)."""
    return os.environ.get("RANK", "0") == "0"


def print0(*args: object, file: TextIO | None = None, **kwargs: Any) -> None:
    """``print`` on the main process only, flushed (stdout is read live in tmux)."""
    if is_main_process():
        print(*args, file=file if file is not None else sys.stdout, flush=True, **kwargs)
