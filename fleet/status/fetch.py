"""The I/O side of ``fab status`` / ``fab plot``: fetch a run's facts in ONE command, read a local
run dir (``--log``), watch until the run ends, poll many targets. The model is ``fleet.status``.

The fetch is one fixed POSIX sh script sent as ``sh -c SCRIPT fleet-status ARGS...``: the
workdir, tmux path, byte budget and a per-call random boundary are positional arguments,
never interpolated into the script. It prints sections ``<boundary> <name>``: the target's
clock, the latest run id, the tmux pane state, run.json, the exit_code file, size+mtime and
the last ``TAIL_BYTES`` (``tail -c``) of events.jsonl and train.log, and optionally one
``nvidia-smi --query-gpu`` table. A log of many GB is never downloaded.
"""

from __future__ import annotations

import io
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from fleet.errors import ConfigError, FleetError, GpuGateError, RunError
from fleet.gpus import QUERY_FIELDS, parse_query_gpu
from fleet.layout import RUN_SESSION
from fleet.status import GpuRow, RunFacts, RunStatus, build_status

TAIL_BYTES = 256 * 1024
GPU_FIELDS = ",".join(QUERY_FIELDS)

FETCH_SCRIPT = r"""
wd=$1; tmux=$2; session=$3; n=$4; b=$5; nvsmi=$6; fields=$7; m=${8:-$4}
sec() { printf '\n%s %s\n' "$b" "$1"; }
sec now; date +%s
run=$(readlink -- "$wd/runs/latest" 2>/dev/null)
run=${run##*/}
sec run; printf '%s' "$run"
d="$wd/runs/$run"
if [ -n "$run" ] && [ -d "$d" ]; then
    sec pane
    "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_dead_status} #{pane_dead_signal}' 2>/dev/null
    sec run_json; cat -- "$d/run.json" 2>/dev/null
    sec exit_code; cat -- "$d/exit_code" 2>/dev/null
    for f in events.jsonl train.log; do
        sec "stat $f"; stat -c '%s %Y' -- "$d/$f" 2>/dev/null
        sec "tail $f"; tail -c "$n" -- "$d/$f" 2>/dev/null
        n=$m
    done
fi
if [ -n "$nvsmi" ]; then
    sec gpus
    if command -v timeout >/dev/null 2>&1; then t="timeout -k 2 10"; else t=""; fi
    $t "$nvsmi" --query-gpu="$fields" --format=csv 2>/dev/null
fi
sec end
exit 0
"""


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
    boundary: str,
    tail_bytes: int = TAIL_BYTES,
    log_bytes: int | None = None,
) -> list[str]:
    """The one command of a status call (argv list; everything variable is a positional arg)."""
    return [
        "sh",
        "-c",
        FETCH_SCRIPT,
        "fleet-status",
        workdir,
        tmux,
        RUN_SESSION,
        str(tail_bytes),
        boundary,
        nvidia_smi,
        GPU_FIELDS,
        str(tail_bytes if log_bytes is None else log_bytes),
    ]


def split_sections(stdout: str, boundary: str) -> dict[str, str]:
    """``<boundary> name`` headed sections -> {name: text} (each section's framing newline removed)."""
    sections: dict[str, str] = {}
    parts = stdout.split(f"\n{boundary} ")
    for part in parts[1:]:
        name, _, body = part.partition("\n")
        sections[name] = body
    return sections


def parse_fetch(
    stdout: str, boundary: str, *, tail_bytes: int = TAIL_BYTES, gpu_targets: int | None = None
) -> Fetched:
    """The fetch script's output -> facts and tails (pure)."""
    s = split_sections(stdout, boundary)
    if "end" not in s:
        raise RunError("status fetch was cut short (no end marker): retry; check the target's disk and shell")
    run_id = s.get("run", "").strip()
    now = _float(s.get("now", ""))
    alive: bool | None = None
    exit_code = _int(s.get("exit_code", ""))
    if run_id:
        pane = s.get("pane", "").split()
        alive = bool(pane) and pane[0] == "0"
        if exit_code is None and pane and pane[0] == "1":
            status, signal = (
                _int(pane[1]) if len(pane) > 1 else None,
                _int(pane[2]) if len(pane) > 2 else None,
            )
            exit_code = 128 + signal if signal else status
    run_json = _json_object(s.get("run_json", ""))
    ev_stat = s.get("stat events.jsonl", "").split()
    log_stat = s.get("stat train.log", "").split()
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
    )
    ev_size = _int(ev_stat[0]) if ev_stat else None
    gpus = gpu_rows_from_csv(s["gpus"], gpu_targets) if s.get("gpus", "").strip() else ()
    return Fetched(
        facts=facts,
        events_text=_strip_last_nl(s.get("tail events.jsonl", "")),
        events_truncated=ev_size is not None and ev_size > tail_bytes,
        log_text=_strip_last_nl(s.get("tail train.log", "")),
        gpus=gpus,
    )


def _strip_last_nl(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


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


def _json_object(text: str) -> Mapping[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def fetch(
    target: Any, events_bytes: int = TAIL_BYTES, log_bytes: int = TAIL_BYTES, gpus: bool = True
) -> Fetched:
    """Run the fetch on an open ``fleet.target.Target`` (one command) and parse it."""
    spec = target.spec
    boundary = "@@fleet-" + secrets.token_hex(8)
    nvsmi = spec.commands.nvidia_smi if spec.gpus > 0 and gpus else ""
    argv = fetch_argv(spec.workdir, spec.commands.tmux, nvsmi, boundary, events_bytes, log_bytes)
    result = target.run(argv, timeout=60)
    gpu_targets = spec.topology.targets if spec.topology else None
    return parse_fetch(result.stdout, boundary, tail_bytes=events_bytes, gpu_targets=gpu_targets)


def fetch_status(target: Any) -> RunStatus:
    """The RunStatus of a target's latest run; RunError when it has none."""
    got = fetch(target)
    if not got.facts.run_id:
        raise RunError(f"{target.name}: no run under {target.spec.workdir}/runs: start one with `fab train`")
    facts = got.facts if got.facts.env else replace(got.facts, env=target.spec.env)
    return build_status(
        target.name,
        facts,
        got.events_text,
        got.log_text,
        stall_window_s=target.spec.stall_window_s,
        events_truncated=got.events_truncated,
        gpus=got.gpus,
    )


def read_local(path: Path, tail_bytes: int = TAIL_BYTES) -> tuple[str, str, bool, RunFacts]:
    """``--log PATH``: a run dir, an events file (*.jsonl) or a log -> (events, log, truncated, facts)."""
    if not path.exists():
        raise ConfigError(
            f"--log {path}: no such file or directory; give a run dir, events.jsonl or a log file"
        )
    events_path = log_path = None
    if path.is_dir():
        events_path, log_path = path / "events.jsonl", path / "train.log"
    elif path.suffix == ".jsonl":
        events_path = path
    else:
        log_path = path
    events_text, truncated = _tail(events_path, tail_bytes)
    log_text, _ = _tail(log_path, tail_bytes)
    if not events_text and not log_text:
        raise ConfigError(f"--log {path}: found no events.jsonl or train.log there")
    exit_code = None
    if path.is_dir() and (path / "exit_code").is_file():
        exit_code = _int((path / "exit_code").read_text(errors="replace"))
    if path.is_dir():
        run_id = path.name
    else:
        run_id = path.parent.name if path.name in ("events.jsonl", "train.log") else path.name
    facts = RunFacts(run_id=run_id, exit_code=exit_code, alive=False if exit_code is not None else None)
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
    events_text, log_text, truncated, facts = read_local(path)
    return build_status(name, facts, events_text, log_text, events_truncated=truncated)


def watch_live(get: Callable[[], RunStatus], interval: float) -> RunStatus:
    """Refresh the picture in place (rich Live) every ``interval`` s until the run is final."""
    from rich.live import Live

    st = get()
    with Live(st.renderable(), refresh_per_second=4, screen=False) as live:
        while not st.final:
            time.sleep(interval)
            st = get()
            live.update(st.renderable())
    return st


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


def poll_all(specs: Sequence[Any]) -> list[tuple[str, RunStatus | FleetError]]:
    """``FLEET_TARGET=all``: every target's status, polled in parallel; a failure becomes its line."""
    from fleet.target import open_target

    def one(spec: Any) -> RunStatus | FleetError:
        try:
            with open_target(spec) as target:
                return fetch_status(target)
        except FleetError as err:
            return err

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(specs)))) as pool:
        results = list(pool.map(one, specs))
    return [(spec.name, result) for spec, result in zip(specs, results, strict=True)]


def watch_interval(value: bool | str | float | None) -> float | None:
    """``--watch`` (no value: 5 s) / ``--watch SECONDS`` -> seconds, or None when not watching."""
    if value is None or value is False:
        return None
    if value is True or value == "":
        return 5.0
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"status --watch {value}: give seconds, e.g. --watch 10") from None
    if not 0.2 <= seconds <= 3600:
        raise ConfigError(f"status --watch {value}: give seconds between 0.2 and 3600")
    return seconds


def _show(st: RunStatus, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st.to_json(), sort_keys=True, allow_nan=False), flush=True)
    else:
        Console().print(st.renderable())


def status_task(ctx: Any, *, watch: bool | str | None = None, as_json: bool = False, log: str = "") -> int:
    """``fab status``: show the picture(s); returns the exit code (the state's, see fleet.status)."""
    from fleet.cli import single_target, targets_for

    interval = watch_interval(watch)
    if log:
        st = status_from_path(Path(log).expanduser())
        _show(st, as_json)
        return st.exit_code
    specs = targets_for(ctx, read_only=True)
    if len(specs) > 1:
        if interval is not None:
            raise ConfigError("status --watch follows one target; set FLEET_TARGET to one name, not all")
        rows = poll_all(specs)
        if as_json:
            data = [
                r.to_json() if isinstance(r, RunStatus) else {"target": n, "error": str(r)} for n, r in rows
            ]
            print(json.dumps(data, sort_keys=True, allow_nan=False), flush=True)
        else:
            Console().print(summary_table(rows))
        return max(r.exit_code for _, r in rows)  # the worst target's code
    with single_target(ctx) as target:
        if interval is None:
            st = fetch_status(target)
            _show(st, as_json)
        elif as_json:  # one JSON line per refresh until the run ends
            st = fetch_status(target)
            _show(st, True)
            while not st.final:
                time.sleep(interval)
                st = fetch_status(target)
                _show(st, True)
        else:
            st = watch_live(lambda: fetch_status(target), interval)
    return st.exit_code


# ---------------------------------------------------------------- rendering


def _ago(ts: float | None, now: float | None) -> str:
    if ts is None:
        return ""
    if now is None:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z"
    return f"{_duration(max(0.0, now - ts))} ago"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _f(value: float | None, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def render(st: RunStatus, now: float | None = None) -> Group:
    now = now if now is not None else time.time()
    style = {"failed": "bold red", "stalled": "bold yellow", "stopped": "yellow", "finished": "green"}
    head = Text.assemble(
        (f"{st.target}", "bold"),
        f"  run {st.run_id or '-'}  release {st.release or '-'}",
        f"  env {st.env}" if st.env else "",
    )
    state = Text.assemble(
        ("state ", ""),
        (st.state, style.get(st.state, "bold cyan")),
        f" since {_ago(st.since, now)}" if st.since else "",
        f"  phase {st.phase or '-'}",
        f"  exit {st.process_exit_code}" if st.process_exit_code is not None else "",
    )
    info = Table.grid(padding=(0, 2))
    info.add_column(style="dim")
    info.add_column()
    if st.load:
        info.add_row("load", f"{st.load.what} {st.load.done} of {st.load.total}")
    if st.step is not None:
        epoch = f"  epoch {st.epoch}" if st.epoch is not None else ""
        info.add_row("step", f"{st.step}/{st.total_steps or '?'}{epoch}")
        trend = "" if st.loss_trend is None else f"  ({st.loss_trend * 100:+.1f}% recent)"
        info.add_row("loss", f"{_f(st.loss)}{trend}")
        tau = f"{_f(st.tau, '.3f')}" + (f"  eval {_f(st.eval_tau, '.3f')}" if st.eval_tau else "")
        info.add_row("tau", tau)
    if st.tokens_per_s is not None or st.tokens_per_s_by_role:
        roles = "  ".join(f"{r} {v:,.0f}" for r, v in sorted(st.tokens_per_s_by_role.items()))
        info.add_row("tokens/s", f"{_f(st.tokens_per_s, ',.0f')}  ({roles})")
    if st.eta_s is not None:
        info.add_row("ETA", _duration(st.eta_s))
    if st.compile_cache:
        c = st.compile_cache
        warn = "  WARM START WITH MISSES" if c.warm_with_misses else ""
        info.add_row(
            "compile cache",
            f"fxgraph {c.fxgraph_hit} hit / {c.fxgraph_miss} miss, "
            f"aotautograd {c.aotautograd_hit} hit / {c.aotautograd_miss} miss{warn}",
        )
    if st.last_checkpoint:
        cp = st.last_checkpoint
        info.add_row("checkpoint", f"step {cp.step}  {cp.path}  ({_ago(cp.ts, now)})")
    if st.last_error:
        message = st.last_error.message
        message = message if len(message) <= 160 else message[:157] + "..."
        info.add_row("last error", f"{st.last_error.type}: {message}")
    for note in st.notes:
        info.add_row("note", note)
    parts: list[Any] = [head, state, info]
    if st.buckets:
        b = st.buckets
        parts.append(Text(f"Batches per epoch: {b.batches_per_epoch} (min={b.min} max={b.max} avg={b.avg})"))
        table = Table()
        for col in ("bucket", "tokens", "batches", "%"):
            table.add_column(col, justify="right")
        for row in b.buckets:
            table.add_row(str(row.index), f"[{row.lo}, {row.hi})", str(row.batches), f"{row.percent:.1f}")
        parts.append(table)
    if st.gpus:
        gpus = Table()
        for col in ("gpu", "role", "memory MiB", "util %"):
            gpus.add_column(col, justify="right")
        for g in st.gpus:
            mem = f"{_f(g.memory_used_mib, '.0f')} / {_f(g.memory_total_mib, '.0f')}"
            gpus.add_row(str(g.index), g.role or "-", mem, _f(g.utilization_pct, ".0f"))
        parts.append(gpus)
    for d in st.diagnosis:
        parts.append(Text.assemble(("diagnosis: ", "bold red"), d.cause))
        parts.append(Text.assemble(("  fix: ", "bold"), d.fix))
        parts.append(Text(f"  seen: {d.evidence}", style="dim"))
    return Group(*parts)


def summary_table(rows: Sequence[tuple[str, RunStatus | FleetError]]) -> Table:
    """One row per target (``FLEET_TARGET=all``): a status, or the one-line error that target gave."""
    table = Table()
    for col in ("target", "state", "phase", "step", "loss", "tokens/s", "ETA", "diagnosis"):
        table.add_column(col)
    for name, st in rows:
        if not isinstance(st, RunStatus):
            table.add_row(name, "error", "", "", "", "", "", str(st))
            continue
        step = f"{st.step}/{st.total_steps}" if st.step is not None else "-"
        eta = _duration(st.eta_s) if st.eta_s is not None else "-"
        diag = st.diagnosis[0].cause if st.diagnosis else ""
        table.add_row(name, st.state, st.phase, step, _f(st.loss), _f(st.tokens_per_s, ",.0f"), eta, diag)
    return table


def render_text(st: RunStatus, width: int = 100, now: float | None = None) -> str:
    """The picture as plain text (no colour), e.g. for tests and logs."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(render(st, now))
    return console.file.getvalue()  # type: ignore[attr-defined]
