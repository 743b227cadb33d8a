"""``fab plot``: loss, acceptance tau and tokens/s over steps as one PNG (matplotlib, Agg).

The curves come from a run's ``step`` events (one line per rank that logs steps) and its
``eval`` events (real acceptance, drawn as points on the tau panel). ``series_from_events``
is pure; ``plot_png`` writes the file; ``plot_target`` plots a target's latest run (the last
``PLOT_EVENT_BYTES`` of events.jsonl fetched in one command, no log), ``plot_log`` a local run
dir or events file (``--log``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import ConfigError, RunError
from fleet.inventory import REPO_ROOT
from fleet.status.fetch import fetch, read_local
from fleet.status.model import continuous_events
from training.contract import parse_events

if TYPE_CHECKING:
    from fleet.target import Target

PLOT_EVENT_BYTES = 16 * 1024 * 1024
WIDTH_PX, HEIGHT_PX, DPI = 1200, 1000, 100


@dataclass(frozen=True)
class Series:
    """One curve: x = steps, y = values (NaN / missing values dropped)."""

    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class PlotData:
    loss: tuple[Series, ...]
    tau: tuple[Series, ...]
    tokens_per_s: tuple[Series, ...]
    eval_tau: Series | None

    @property
    def empty(self) -> bool:
        return not any(s.steps for s in (*self.loss, *self.tau, *self.tokens_per_s))


def series_from_events(events: Sequence[Mapping[str, Any]]) -> PlotData:
    """Per-rank curves of loss, tau and tokens/s, and the eval tau points (pure); one continuous
    history across the run dir's launches (steps redone after a resume drawn once)."""
    events = continuous_events(events)
    per_rank: dict[tuple[int, str], dict[str, list[tuple[int, float]]]] = {}
    evals: list[tuple[int, float]] = []
    for ev in events:
        kind = ev.get("event")
        step = ev.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        if kind == "step":
            key = (ev.get("rank", 0), str(ev.get("role", "single")))
            curves = per_rank.setdefault(key, {"loss": [], "tau": [], "tokens_per_s": []})
            for name, points in curves.items():
                value = ev.get(name)
                if isinstance(value, int | float) and math.isfinite(value):
                    points.append((step, float(value)))
        elif kind == "eval":
            value = ev.get("tau_mean")
            if isinstance(value, int | float) and math.isfinite(value):
                evals.append((step, float(value)))

    def curves(name: str) -> tuple[Series, ...]:
        out = []
        for (rank, role), data in sorted(per_rank.items()):
            points = data[name]
            steps, values = tuple(p[0] for p in points), tuple(p[1] for p in points)
            out.append(Series(f"rank {rank} ({role})", steps, values))
        return tuple(out)

    eval_series = Series("eval tau (verified)", tuple(s for s, _ in evals), tuple(v for _, v in evals))
    return PlotData(curves("loss"), curves("tau"), curves("tokens_per_s"), eval_series if evals else None)


def plot_png(data: PlotData, out: Path, title: str) -> Path:
    """Write the three panels to ``out`` (PNG, WIDTH_PX x HEIGHT_PX)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if data.empty:
        raise RunError(f"{title}: no step events yet to plot; wait for training to log a step")
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, sharex=True)
    try:
        panels = (
            (axes[0], data.loss, "loss (nats)"),
            (axes[1], data.tau, "acceptance tau"),
            (axes[2], data.tokens_per_s, "tokens/s"),
        )
        for ax, series, ylabel in panels:
            for s in series:
                if s.steps:
                    ax.plot(s.steps, s.values, label=s.label, linewidth=1.2)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        if data.eval_tau:
            e = data.eval_tau
            axes[1].plot(e.steps, e.values, "o", color="black", label=e.label)
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize="small")
        axes[2].set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return out


def plot_log(path: Path, out: str = "") -> Path:
    """``fab plot --log PATH``: the PNG of a local run dir or events file; returns its path."""
    events_text, _log, truncated, _facts = read_local(path, PLOT_EVENT_BYTES)
    if not events_text:
        raise ConfigError(f"plot --log {path}: no events.jsonl there; plot needs the events of a run")
    return _plot(events_text, truncated, "local", path.name if path.is_dir() else path.parent.name, out)


def plot_target(target: Target, out: str = "") -> Path:
    """``fab plot``: the PNG of the target's latest run; returns its path."""
    got = fetch(target, events_bytes=PLOT_EVENT_BYTES, log_bytes=0, gpus=False)
    if not got.facts.run_id:
        raise RunError(f"{target.name}: no run to plot: start one with `fab train`")
    return _plot(got.events_text, got.events_truncated, target.name, got.facts.run_id, out)


def default_path(name: str, run_id: str) -> Path:
    """``<checkout>/.fleet/plots/<target>-<run>.png``: git ignores .fleet/, so a plot never makes
    the next release ``-dirty`` (the current directory is usually the checkout)."""
    return REPO_ROOT / ".fleet" / "plots" / f"{name}-{run_id}.png"


def _plot(events_text: str, truncated: bool, name: str, run_id: str, out: str) -> Path:
    events = parse_events(events_text, truncated=truncated).events
    dest = Path(out) if out else default_path(name, run_id)
    return plot_png(series_from_events(events), dest, f"{name}  {run_id}")
