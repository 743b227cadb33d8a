"""The view of ``fab status``: a RunStatus as a rich picture or one JSON object, the one-row-per-target
table of ``FLEET_TARGET=all``, and ``--watch`` (refresh until the run ends). The model
(``fleet.status.model``) never imports this module.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from fleet.errors import ConfigError, FleetError
from fleet.status.model import RunStatus, State
from training.contract import set_label


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


def _print_json(data: Any) -> None:
    print(json.dumps(data, sort_keys=True, allow_nan=False), flush=True)


def show(results: Sequence[tuple[str, RunStatus | FleetError]], *, as_json: bool) -> int:
    """Print one target's picture (or JSON object), or for several targets one table (or a JSON list
    of objects, ``{target, error}`` for a target that failed). Returns ``fab status``'s exit code:
    the state's (fleet.status.model), for several targets the worst (highest) of them."""
    if len(results) == 1 and isinstance(results[0][1], RunStatus):
        st = results[0][1]
        if as_json:
            _print_json(st.to_json())
        else:
            Console().print(render(st))
        return st.exit_code
    if as_json:
        _print_json(
            [r.to_json() if isinstance(r, RunStatus) else {"target": n, "error": str(r)} for n, r in results]
        )
    else:
        Console().print(summary_table(results))
    return max(r.exit_code for _, r in results)


def watch(get: Callable[[], RunStatus], interval: float, *, as_json: bool) -> RunStatus | None:
    """``--watch``: one JSON line per refresh (``as_json``) or the picture refreshed in place, every
    ``interval`` s until the run is final; returns the last status, or None when the user ended
    the watch (Ctrl-C: leaving a watch is no failure, as for ``fab logs --follow``)."""
    try:
        if not as_json:
            return watch_live(get, interval)
        st = get()
        _print_json(st.to_json())
        while not st.final:
            time.sleep(interval)
            st = get()
            _print_json(st.to_json())
        return st
    except KeyboardInterrupt:
        return None


def watch_live(get: Callable[[], RunStatus], interval: float) -> RunStatus:
    """Refresh the picture in place (rich Live) every ``interval`` s until the run is final."""
    from rich.live import Live

    st = get()
    with Live(render(st), refresh_per_second=4, screen=False) as live:
        while not st.final:
            time.sleep(interval)
            st = get()
            live.update(render(st))
    return st


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


def _ranks(ranks: Sequence[int]) -> str:
    """``0-4`` for a run of consecutive ranks, else ``0, 2``."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def render(st: RunStatus, now: float | None = None) -> Group:
    """The picture of one run: state, progress, speed, buckets, GPUs, diagnosis."""
    now = now if now is not None else time.time()
    style = {
        State.FAILED: "bold red",
        State.STALLED: "bold yellow",
        State.STOPPED: "yellow",
        State.FINISHED: "green",
    }
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
    if st.progress is not None:
        p = st.progress
        rate = f", {p.rate:,.3g} {p.unit}/s" if p.rate > 0 else ""
        eta = f", ETA {_duration(p.eta_s)}" if p.eta_s is not None else ", ETA - (no unit done yet)"
        info.add_row("progress", f"{p.text()}{rate}{eta}  (reported {_ago(p.ts, now)})")
    elif st.load:
        info.add_row("load", f"{st.load.what} {st.load.done} of {st.load.total}")
    if st.step is not None:
        epoch = f"  epoch {st.epoch}" if st.epoch is not None else ""
        info.add_row("step", f"{st.step}/{st.total_steps or '?'}{epoch}")
        trend = ""
        if st.loss_trend is not None:
            w = st.loss_window
            trend = f"  ({st.loss_trend * 100:+.1f}% over the last {w} steps vs the {w} before)"
        info.add_row("loss", f"{_f(st.loss)}{trend}")
        info.add_row("tau", f"{_f(st.tau, '.3f')}{_evals_text(st)}")
    if st.tree is not None:
        info.add_row("tree", st.tree.text())
    if st.serve is not None:
        info.add_row("engine", st.serve.text())
    if st.tokens_per_s is not None or st.tokens_per_s_by_role:
        roles = "  ".join(f"{r} {v:,.0f}" for r, v in sorted(st.tokens_per_s_by_role.items()))
        info.add_row("tokens/s", f"{_f(st.tokens_per_s, ',.0f')}  ({roles})")
    if st.eta_s is not None:
        info.add_row("ETA", _duration(st.eta_s) + ("" if st.progress else " to the last step"))
    if st.attempt > 1 or st.last_cause:
        info.add_row(
            "attempt", f"{st.attempt}" + (f"  (last ended: {st.last_cause})" if st.last_cause else "")
        )
    if st.segments > 1 or st.resumed_from is not None:
        resumed = f", resumed from step {st.resumed_from}" if st.resumed_from is not None else ""
        info.add_row("launches", f"{st.segments} (speed and ETA of the live one{resumed})")
    for path, ranks in st.target_paths():
        info.add_row("target", f"{path}  (rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)})")
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
    if st.checkpoint_s is not None:
        info.add_row("checkpoint time", f"{st.checkpoint_s:.2f}s to write (median)")
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


def _evals_text(st: RunStatus) -> str:
    """The eval figures after the training tau: each set's last tau per round (and per prompt),
    named where there is more than the held-out split."""
    if not st.evals:
        return ""
    if [f.set for f in st.evals] == ["held_out"]:
        text = f"  eval {_f(st.eval_tau, '.3f')}"
        return text + (
            f" per round, {_f(st.eval_tau_prompt, '.3f')} per prompt" if st.eval_tau_prompt else ""
        )
    rounds = ", ".join(f"{_f(f.tau_mean, '.3f')} {set_label(f.set)}" for f in st.evals)
    text = f"  eval {rounds} per round"
    if all(f.tau_prompt_mean for f in st.evals):
        text += f" ({', '.join(_f(f.tau_prompt_mean, '.3f') for f in st.evals)} per prompt)"
    return text


def render_text(st: RunStatus, width: int = 100, now: float | None = None) -> str:
    """The picture as plain text (no colour), e.g. for tests and logs."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(render(st, now))
    return console.file.getvalue()  # type: ignore[attr-defined]
