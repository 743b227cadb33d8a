"""``fab plot``: loss, acceptance tau and tokens/s over steps as one PNG (matplotlib, Agg).

The curves come from a run's ``step`` events (one line per rank that logs steps) and its
``eval`` events (real acceptance, one curve of points per eval set on the tau panel: the held-out
split, the general set, ...). Where the held-out evals measured DDTree (their ``tree`` figures), the
tau panel also has the tree's tau at one budget over steps (the last eval's best budget by the cost
model, else 64), and a fourth panel the last eval's tau against the budget, the chain's as a line,
with the modelled speedup per budget where measured. Each curve is drawn smoothed (a running
median, ``smooth``: one outlier, as the first step's loss, does not drag it) over its logged
points, drawn faint. The loss panel's range is the smoothed curve's: a drafter's first steps lose
10x what it loses once it learns (69 nats at step 1 of the smol run, 5-9 after), and a range that
held them would flatten the curve that matters; points above it are drawn as triangles on its top
edge and counted on the axis.
``series_from_events`` is pure; ``plot_png`` writes the file; ``plot_target`` plots a target's
latest run (the last ``PLOT_EVENT_BYTES`` of events.jsonl fetched in one command, no log),
``plot_log`` a local run dir or events file (``--log``).
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
from training.contract import EVENTS_FILE, TreeFigures, eval_set, parse_events, set_label, tree_figures

if TYPE_CHECKING:
    from fleet.target import Target

PLOT_EVENT_BYTES = 16 * 1024 * 1024
WIDTH_PX, HEIGHT_PX, DPI = 1200, 1000, 100
SMOOTH_POINTS = 5  # the running median's window, in logged points, centred
# The eval sets' points (marker, colour) in order, apart from the training curves' C0, C1, ...
EVAL_STYLES = (("o", "black"), ("s", "firebrick"), ("^", "darkgreen"), ("D", "purple"), ("v", "saddlebrown"))


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
    evals: tuple[Series, ...]  # one per eval set, held_out first
    tree_tau: Series | None = None  # the tree's tau at last_tree's shown budget, over steps
    last_tree: TreeFigures | None = None  # the last held-out eval's tree figures

    @property
    def empty(self) -> bool:
        return not any(s.steps for s in (*self.loss, *self.tau, *self.tokens_per_s))


def series_from_events(events: Sequence[Mapping[str, Any]]) -> PlotData:
    """Per-rank curves of loss, tau and tokens/s, and the eval tau points (pure); one continuous
    history across the run dir's launches (steps redone after a resume drawn once)."""
    events = continuous_events(events)
    per_rank: dict[tuple[int, str], dict[str, list[tuple[int, float]]]] = {}
    evals: dict[str, list[tuple[int, float]]] = {"held_out": []}
    trees: list[TreeFigures] = []
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
                evals.setdefault(eval_set(ev), []).append((step, float(value)))
            figures = tree_figures(ev) if eval_set(ev) == "held_out" else None
            if figures is not None:
                trees.append(figures)

    drafters = sorted(key for key in per_rank if key[1] != "single")

    def label(rank: int, role: str) -> str:
        """What a user calls the curve: one process trains (no name needed), or drafter k of N."""
        if role == "single":
            return "training"
        return f"drafter {drafters.index((rank, role))}" if role == "drafter" else f"{role} (rank {rank})"

    def curves(name: str) -> tuple[Series, ...]:
        out = []
        for (rank, role), data in sorted(per_rank.items()):
            points = data[name]
            steps, values = tuple(p[0] for p in points), tuple(p[1] for p in points)
            out.append(Series(label(rank, role), steps, values))
        return tuple(out)

    eval_series = tuple(
        Series(
            f"eval tau, {set_label(name)} (verified)",
            tuple(s for s, _ in points),
            tuple(v for _, v in points),
        )
        for name, points in evals.items()
        if points
    )
    last = trees[-1] if trees else None
    tree_series = None
    if last is not None:
        budget = last.shown_budget
        points = [(t.step, t.taus[budget]) for t in trees if budget in t.taus]
        name = f"eval tree tau @{budget} (greedy replay)"
        tree_series = Series(name, tuple(p[0] for p in points), tuple(p[1] for p in points))
    return PlotData(curves("loss"), curves("tau"), curves("tokens_per_s"), eval_series, tree_series, last)


def smooth(values: Sequence[float], window: int = SMOOTH_POINTS) -> list[float]:
    """The running median of ``window`` points centred on each (fewer at the ends), as pandas'
    ``Series.rolling(window, center=True, min_periods=1).median()``."""
    half_lo, half_hi = (window - 1) // 2, window // 2
    out = []
    for i in range(len(values)):
        part = sorted(values[max(0, i - half_hi) : i + half_lo + 1])
        mid = len(part) // 2
        out.append(part[mid] if len(part) % 2 else (part[mid - 1] + part[mid]) / 2)
    return out


def loss_range(series: Sequence[Series]) -> tuple[float | None, int]:
    """(top of the loss axis, points above it): the smoothed curves' highest value plus a margin of
    a quarter of their span; (None, 0) when nothing lies above the raw points' own range."""
    values = [v for s in series for v in s.values]
    smoothed = [v for s in series for v in smooth(s.values)]
    if not values:
        return None, 0
    low, high = min(values), max(smoothed)
    top = high + 0.25 * max(high - low, 0.05 * abs(high))
    clipped = sum(1 for v in values if v > top)
    return (top, clipped) if clipped else (None, 0)


def tree_panel(ax: Any, tree: TreeFigures) -> None:
    """The last eval's tau against the tree budget (log scale), the chain's tau as a line, and
    the modelled speedup per budget on a second axis where the cost was measured."""
    budgets = sorted(b for b in tree.taus if b > 0)
    ax.plot(budgets, [tree.taus[b] for b in budgets], "o-", color="C0", label="tree tau (greedy replay)")
    if 0 in tree.taus:
        ax.axhline(tree.taus[0], color="black", linestyle="--", linewidth=1, label="chain tau")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel(f"tree budget (nodes), eval at step {tree.step}")
    ax.set_ylabel("acceptance length tau\n(last eval)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    measured = sorted(b for b in tree.speedups if b > 0)
    if measured:
        twin = ax.twinx()
        twin.plot(measured, [tree.speedups[b] for b in measured], "s:", color="C3", label="modelled speedup")
        if tree.best_budget in measured:
            twin.plot([tree.best_budget], [tree.speedups[tree.best_budget]], "*", color="C3", markersize=14)
        twin.set_ylabel("modelled speedup (x)", color="C3")
        twin.legend(loc="lower right", fontsize="small")


def figure(data: PlotData, title: str) -> Any:
    """The three panels (four with tree figures) as a matplotlib Figure (Agg); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    count = 4 if data.last_tree is not None else 3
    fig, axes = plt.subplots(count, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    for ax in axes[1:3]:
        ax.sharex(axes[0])
    for ax in axes[:2]:
        ax.tick_params(labelbottom=False)
    top, clipped = loss_range(data.loss)
    above = f"\n{clipped} early point{'s' if clipped > 1 else ''} above, clipped" if clipped else ""
    panels = (
        (axes[0], data.loss, f"loss (nats){above}"),
        (axes[1], data.tau, "acceptance length tau\n(training estimate)"),
        (axes[2], data.tokens_per_s, "tokens/s"),
    )
    for ax, series, ylabel in panels:
        for i, s in enumerate(series):
            if not s.steps:
                continue
            color = f"C{i}"
            ax.plot(s.steps, s.values, ".", color=color, alpha=0.35, markersize=6)
            ax.plot(s.steps, smooth(s.values), color=color, linewidth=1.6, label=s.label)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    if clipped and top is not None:
        low = min(v for s in data.loss for v in s.values)
        axes[0].set_ylim(low - 0.05 * (top - low), top)
        for i, s in enumerate(data.loss):
            over = [step for step, v in zip(s.steps, s.values, strict=True) if v > top]
            axes[0].plot(over, [top] * len(over), "^", color=f"C{i}", markersize=7, clip_on=False)
    for i, e in enumerate(data.evals):
        marker, color = EVAL_STYLES[i % len(EVAL_STYLES)]
        axes[1].plot(e.steps, e.values, marker, color=color, linestyle="--", linewidth=1, label=e.label)
    if data.tree_tau:
        t = data.tree_tau
        axes[1].plot(t.steps, t.values, "D", color="C3", label=t.label)
    if data.last_tree is not None:
        tree_panel(axes[3], data.last_tree)
    note = f"lines: running median of {SMOOTH_POINTS} logged steps; faint dots: each logged step"
    axes[0].set_title(note, fontsize="small", loc="left")
    for ax in axes[:3]:
        labels = ax.get_legend_handles_labels()[1]
        if len(labels) > 1 or (labels and labels != ["training"]):  # one process: no legend needed
            ax.legend(loc="best", fontsize="small")
    axes[2].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_png(data: PlotData, out: Path, title: str) -> Path:
    """Write the panels to ``out`` (PNG, WIDTH_PX x HEIGHT_PX)."""
    from matplotlib import pyplot as plt

    if data.empty:
        raise RunError(f"{title}: no step events yet to plot; wait for training to log a step")
    fig = figure(data, title)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return out


def plot_log(path: Path, out: str = "") -> Path:
    """``fab plot --log PATH``: the PNG of a local run dir or events file; returns its path."""
    events_text, _log, truncated, _facts = read_local(path, PLOT_EVENT_BYTES)
    if not events_text:
        raise ConfigError(f"plot --log {path}: no {EVENTS_FILE} there; plot needs the events of a run")
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
    data = series_from_events(events)
    if data.empty:
        raise RunError(
            f"{name}: nothing to plot yet: run {run_id} has logged no training step "
            "(`fab status` shows its phase)"
        )
    dest = Path(out) if out else default_path(name, run_id)
    return plot_png(data, dest, f"{name}  {run_id}")
