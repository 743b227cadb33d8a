"""The I/O side of ``fab status`` / ``fab plot``: a run's facts from a target in ONE command, or
from a local run dir (``--log``). The model is ``fleet.status.model``; the view ``fleet.status.render``.

The fetch is ``fleet/remote/status_fetch.sh``: the workdir, tmux path and byte budgets are
positional arguments, never interpolated into the script. It answers in the one framing of
``fleet.remote`` (``parse_answers``): the target's clock, the latest run id, the tmux pane
state, run.json, the exit_code file, size+mtime and the last ``TAIL_BYTES`` (``tail -c``) of
events.jsonl and train.log, and optionally one ``nvidia-smi --query-gpu`` table. A log of many
GB is never downloaded; a log line that looks like a section header stays log text.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet import remote
from fleet.errors import CommandFailed, ConfigError, GpuGateError, RunError, TargetError
from fleet.gpus import QUERY_FIELDS, parse_query_gpu
from fleet.layout import RUN_SESSION
from fleet.status.model import GpuRow, RunFacts, RunStatus, State, build_status
from training.contract import (
    EVENTS_FILE,
    EXIT_CODE_FILE,
    LAUNCHED_AT_FILE,
    LOG_FILE,
    PID_FILE,
    STOP_SIGNAL_FILE,
)

if TYPE_CHECKING:
    from fleet.target import Target

TAIL_BYTES = 256 * 1024
GPU_FIELDS = ",".join(QUERY_FIELDS)


@dataclass(frozen=True)
class Fetched:
    """What one fetch returned: the facts plus the two tails."""

    facts: RunFacts
    events_text: str
    events_truncated: bool
    log_text: str
    gpus: tuple[GpuRow, ...]


def fetch_argv(
    workdir: str,
    tmux: str,
    nvidia_smi: str,
    tail_bytes: int = TAIL_BYTES,
    log_bytes: int | None = None,
) -> list[str]:
    """The one command of a status call (argv list; everything variable is a positional arg)."""
    logs = str(tail_bytes if log_bytes is None else log_bytes)
    args = (workdir, tmux, RUN_SESSION, str(tail_bytes), nvidia_smi, GPU_FIELDS, logs)
    return remote.sh("status_fetch.sh", *args)


def parse_fetch(stdout: str, *, tail_bytes: int = TAIL_BYTES, gpu_targets: int | None = None) -> Fetched:
    """The fetch script's output -> facts and tails (pure)."""
    parts = remote.parse_answers(stdout)
    s = {name: remote.ok_output(parts, name) for name in parts}
    if "end" not in s:
        raise RunError("status fetch was cut short (no end marker): retry; check the target's disk and shell")
    run_id = s.get("run", "").strip()
    now = _float(s.get("now", ""))
    alive: bool | None = None
    exit_code = _int(s.get(EXIT_CODE_FILE, ""))  # status_fetch.sh names these sections by their files
    if run_id:
        # tmux leaves a field empty (a pane killed by a signal has no exit status): split on the
        # single spaces of the format, so no field slides into another's place.
        pane = (s.get("pane", "").splitlines() or [""])[0].split(" ")
        # The session's pane is this run's only when its pid is the one run.sh recorded: a pane
        # left by another run must not lend this one its liveness or exit status.
        pid, pane_pid = _int(s.get(PID_FILE, "")), _int(pane[3]) if len(pane) > 3 else None
        if pid is None or (pane_pid is not None and pane_pid != pid) or pane[0] not in ("0", "1"):
            pane = []
        # The run's own lock says whether it lives (tmux may be gone while its trainer runs on);
        # the pane only where the script predates that section.
        lock = s.get("alive", "").strip()
        alive = lock == "1" if lock in ("0", "1") else bool(pane) and pane[0] == "0"
        if exit_code is None and not alive and pane and pane[0] == "1":
            status, signal = (
                _int(pane[1]) if len(pane) > 1 else None,
                _int(pane[2]) if len(pane) > 2 else None,
            )
            exit_code = 128 + signal if signal else status
    launched_at = _float(s.get(LAUNCHED_AT_FILE, ""))
    if alive and launched_at is None and _int(s.get(PID_FILE, "")) is None:
        # A wrapper writes its launch time first, as soon as it holds the lock: one that holds it
        # and has written neither that nor its pid has only just started (the launch moved the
        # previous launch's files aside). A wrapper that predates launched_at wrote its pid.
        launched_at = now
    run_json = _json_object(s.get("run_json", ""))
    ev_stat = s.get("events_stat", "").split()
    log_stat = s.get("log_stat", "").split()
    facts = RunFacts(
        run_id=run_id,
        release=str(run_json.get("release", run_json.get("release_id", ""))),
        env=str(run_json.get("env", "")),
        alive=alive,
        exit_code=exit_code,
        now=now,
        log_mtime=_float(log_stat[1]) if len(log_stat) > 1 else None,
        events_mtime=_float(ev_stat[1]) if len(ev_stat) > 1 else None,
        log_size=_int(log_stat[0]) if log_stat else None,
        started_at=_iso_seconds(run_json.get("started_at")),
        launched_at=launched_at,
        stop_signal=s.get(STOP_SIGNAL_FILE, "").strip(),
        attempts=tuple(_attempts(s.get("attempts", ""))),
    )
    ev_size = _int(ev_stat[0]) if ev_stat else None
    gpus = gpu_rows_from_csv(s["gpus"], gpu_targets) if s.get("gpus", "").strip() else ()
    return Fetched(
        facts=facts,
        events_text=s.get("events_tail", ""),
        events_truncated=ev_size is not None and ev_size > tail_bytes,
        log_text=s.get("log_tail", ""),
        gpus=gpus,
    )


def _attempts(text: str) -> list[Mapping[str, Any]]:
    """attempts.jsonl lines (run.sh's restart record) -> objects; unreadable lines skipped."""
    found = []
    for line in text.splitlines():
        obj = _json_object(line)
        if obj:
            found.append(obj)
    return found


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _float(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _iso_seconds(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def _json_object(text: str) -> Mapping[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def fetch(
    target: Target, events_bytes: int = TAIL_BYTES, log_bytes: int = TAIL_BYTES, gpus: bool = True
) -> Fetched:
    """Run the fetch on an open ``fleet.target.Target`` (one command) and parse it."""
    spec = target.spec
    nvsmi = spec.commands.nvidia_smi if spec.gpus > 0 and gpus else ""
    argv = fetch_argv(spec.workdir, spec.commands.tmux, nvsmi, events_bytes, log_bytes)
    result = target.run(argv, timeout=60)
    gpu_targets = spec.topology.targets if spec.topology else None
    return parse_fetch(result.stdout, tail_bytes=events_bytes, gpu_targets=gpu_targets)


WATCH_RETRIES = 5  # consecutive dropped sessions ``--watch`` rides out before it gives up


def fetch_retrying(target: Target, pause: float, retries: int = WATCH_RETRIES) -> Callable[[], RunStatus]:
    """``fetch_status`` for ``--watch``: a dropped SSH session (a TargetError that is not a failed
    command) is reconnected and read again, up to ``retries`` times in a row, ``pause`` s apart."""

    def get() -> RunStatus:
        for attempt in range(retries + 1):
            try:
                return fetch_status(target)
            except CommandFailed:
                raise
            except TargetError:
                if attempt == retries:
                    raise
                target.close()
                time.sleep(pause)
        raise AssertionError("unreachable")

    return get


def fetch_status(target: Target) -> RunStatus:
    """The RunStatus of a target's latest run; state ``never`` when it has none."""
    got = fetch(target)
    if not got.facts.run_id:
        return never_status(target.name, target.spec.workdir)
    facts = got.facts if got.facts.env else replace(got.facts, env=target.spec.env)
    if facts.alive is False and facts.exit_code == SIGKILL_EXIT and facts.stop_signal != "KILL":
        facts = kernel_facts(target, facts)
    return build_status(
        target.name,
        facts,
        got.events_text,
        got.log_text,
        stall_window_s=target.spec.stall_window_s,
        events_truncated=got.events_truncated,
        gpus=got.gpus,
    )


SIGKILL_EXIT = 137  # 128 + SIGKILL: the shell's exit status of a process killed by kill -9
_DMESG_SECONDS = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]\s*(.*)$")


def parse_kernel_log(text: str, since: float | None, until: float | None) -> tuple[bool, tuple[str, ...]]:
    """``kernel_log.sh`` output -> (readable, the OOM-killer lines from ``since`` to ``until`` + 60 s),
    dmesg's seconds since boot placed on the target's clock by its uptime (pure)."""
    lines = text.splitlines()
    if not lines or any(line.strip() == "unreadable" for line in lines[1:2]):
        return False, ()
    clock = lines[0].split()
    now, uptime = (_float(clock[0]), _float(clock[1])) if len(clock) == 2 else (None, None)
    found = []
    for line in lines[1:]:
        m = _DMESG_SECONDS.match(line.strip())
        if not m:
            continue
        if now is not None and uptime is not None:
            at = now - uptime + float(m.group(1))
            if (since is not None and at < since - 5) or (until is not None and at > until + 60):
                continue
        found.append(m.group(2))
    return True, tuple(found)


def kernel_facts(target: Target, facts: RunFacts) -> RunFacts:
    """A run killed by SIGKILL: did the kernel's OOM killer do it? (one more command, on the host)"""
    result = target.run(remote.sh("kernel_log.sh"), where="host", check=False, timeout=30)
    until = facts.log_mtime or facts.now
    readable, lines = parse_kernel_log(result.stdout, facts.started_at, until)
    return replace(facts, kernel_log_readable=readable, kernel_oom=lines)


def never_status(name: str, workdir: str) -> RunStatus:
    """The status of a target with no run yet (state ``never``, exit 0)."""
    st = build_status(name, RunFacts(), "", "")
    note = f"no run under {workdir}/runs yet: `fab train` starts one"
    return replace(st, state=State.NEVER, notes=(note,))


def read_local(path: Path, tail_bytes: int = TAIL_BYTES) -> tuple[str, str, bool, RunFacts]:
    """``--log PATH``: a run dir, an events file (*.jsonl) or a log -> (events, log, truncated, facts)."""
    if not path.exists():
        raise ConfigError(
            f"--log {path}: no such file or directory; give a run dir, {EVENTS_FILE} or a log file"
        )
    events_path = log_path = None
    if path.is_dir():
        events_path, log_path = path / EVENTS_FILE, path / LOG_FILE
    elif path.suffix == ".jsonl":
        events_path = path
    else:
        log_path = path
    events_text, truncated = _tail(events_path, tail_bytes)
    log_text, _ = _tail(log_path, tail_bytes)
    if not events_text and not log_text:
        raise ConfigError(f"--log {path}: found no {EVENTS_FILE} or {LOG_FILE} there")
    exit_code = None
    if path.is_dir() and (path / EXIT_CODE_FILE).is_file():
        exit_code = _int((path / EXIT_CODE_FILE).read_text(errors="replace"))
    if path.is_dir():
        run_id = path.name
    else:
        run_id = path.parent.name if path.name in (EVENTS_FILE, LOG_FILE) else path.name
    stop_signal = ""
    if path.is_dir() and (path / STOP_SIGNAL_FILE).is_file():
        stop_signal = (path / STOP_SIGNAL_FILE).read_text(errors="replace").strip()
    alive = False if exit_code is not None else None
    facts = RunFacts(run_id=run_id, exit_code=exit_code, alive=alive, stop_signal=stop_signal)
    return events_text, log_text, truncated, facts


def _tail(path: Path | None, tail_bytes: int) -> tuple[str, bool]:
    if path is None or not path.is_file():
        return "", False
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size > tail_bytes:
            fh.seek(size - tail_bytes)
        return fh.read().decode("utf-8", errors="replace"), size > tail_bytes


def status_from_path(path: Path, name: str = "local-log") -> RunStatus:
    """``--log PATH``: the status of a local run dir, events file or log (liveness unknown)."""
    events_text, log_text, truncated, facts = read_local(path)
    return build_status(name, facts, events_text, log_text, events_truncated=truncated)


def gpu_rows_from_csv(text: str, targets: int | None) -> tuple[GpuRow, ...]:
    """``nvidia-smi --query-gpu`` (fleet.gpus' parser) -> rows with roles from the topology."""
    try:
        query = parse_query_gpu(text)
    except GpuGateError:
        return ()  # the GPU table is optional in a status; the gate reports a broken nvidia-smi
    rows = []
    for gpu in query.gpus:
        role = "" if targets is None else ("target" if gpu.index < targets else "drafter")
        rows.append(GpuRow(gpu.index, role, gpu.memory_used_mib, gpu.memory_total_mib, gpu.utilization_pct))
    return tuple(rows)
