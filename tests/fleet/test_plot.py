"""`fab plot`: the PNG written from step/eval events (real matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from fleet.errors import ConfigError, RunError
from fleet.plot import HEIGHT_PX, WIDTH_PX, figure, plot_log, plot_png, series_from_events, smooth
from training.contract import parse_events

T0 = 1_764_460_000.0


def step_event(n: int, rank: int = 0, loss: float | None = None) -> dict:
    return {
        "v": 1, "ts": T0 + n, "event": "step", "rank": rank, "role": "drafter", "step": n, "total_steps": 50,
        "epoch": 0, "loss": 6.0 / (1 + 0.1 * n) if loss is None else loss, "acc": [0.5], "tau": 1 + n / 25,
        "lr": 1e-4, "tokens_per_s": 9000.0 + 10 * n, "grad_norm": 1.0, "mem_gib": 0.0,
    }  # fmt: skip


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def events_file(tmp_path: Path) -> Path:
    events = [step_event(n, rank) for n in range(1, 51) for rank in (0, 1)]
    events.append({"v": 1, "ts": T0 + 60, "event": "eval", "rank": 0, "role": "drafter", "step": 50,
                   "tau_mean": 2.4, "tau_hist": [0, 3, 5], "tau_estimate": 2.9})  # fmt: skip
    events.append({"v": 1, "ts": T0 + 61, "event": "eval", "rank": 0, "role": "drafter", "step": 50,
                   "set": "general", "tau_mean": 1.7, "tau_hist": [2, 3], "tau_estimate": 2.9})  # fmt: skip
    path = tmp_path / "run" / "events.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def test_series_per_rank_drop_nan_and_keep_eval() -> None:
    events = [step_event(1), step_event(2, loss=math.nan), step_event(3), step_event(1, rank=1)]
    events.append({"event": "eval", "step": 3, "tau_mean": 2.0})
    data = series_from_events(events)
    assert [s.label for s in data.loss] == ["drafter 0", "drafter 1"]  # words, not rank numbers
    assert data.loss[0].steps == (1, 3)  # the NaN loss is dropped, not plotted
    assert data.tau[0].steps == (1, 2, 3)
    assert [(e.label, e.values) for e in data.evals] == [("eval tau, held_out (verified)", (2.0,))]


def test_each_eval_set_is_a_series_and_drawn() -> None:
    """eval.sets: one series of points per set, held_out first whatever came first; an event from
    before `set` with `split` alone is that split's (test_png_written_non_empty_right_size draws two)."""
    events = [step_event(n) for n in range(1, 5)]
    events.append({"event": "eval", "step": 2, "set": "general", "split": "general", "tau_mean": 1.5})
    events.append({"event": "eval", "step": 2, "split": "train", "tau_mean": 3.0})
    events.append({"event": "eval", "step": 4, "set": "held_out", "split": "held_out", "tau_mean": 2.5})
    events.append({"event": "eval", "step": 4, "set": "general", "split": "general", "tau_mean": 1.6})
    events.append({"event": "eval", "step": 4, "set": "/d/mine.jsonl", "tau_mean": 1.9})
    data = series_from_events(events)
    assert [(e.label, e.steps, e.values) for e in data.evals] == [
        ("eval tau, held_out (verified)", (4,), (2.5,)),
        ("eval tau, general (verified)", (2, 4), (1.5, 1.6)),
        ("eval tau, train (verified)", (2,), (3.0,)),
        ("eval tau, mine (verified)", (4,), (1.9,)),
    ]


def test_png_written_non_empty_right_size(tmp_path: Path) -> None:
    events = parse_events(events_file(tmp_path).read_text()).events
    out = plot_png(series_from_events(events), tmp_path / "out" / "run.png", "test  run")
    assert out.stat().st_size > 10_000  # three panels with curves, not a blank image
    assert png_size(out) == (WIDTH_PX, HEIGHT_PX)


def test_plot_task_from_a_local_run_dir(tmp_path: Path) -> None:
    run = events_file(tmp_path).parent
    out = plot_log(run, out=str(tmp_path / "p.png"))
    assert png_size(out) == (WIDTH_PX, HEIGHT_PX)


def test_no_steps_yet_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="no step events"):
        plot_png(series_from_events([]), tmp_path / "x.png", "t")
    assert not (tmp_path / "x.png").exists()
    (tmp_path / "train.log").write_text("only a log\n")
    with pytest.raises(ConfigError, match=r"no events\.jsonl"):
        plot_log(tmp_path / "train.log")


def test_a_resumed_run_is_plotted_as_one_curve() -> None:
    """Steps 1..8 logged, killed, resumed from the checkpoint at 5: 6..8 are drawn once (redone)."""
    first = [step_event(n, loss=9.0) for n in range(1, 9)]
    resume = {"v": 1, "ts": T0 + 20, "event": "resume", "rank": 0, "role": "drafter", "step": 5, "path": "/c"}
    second = [step_event(n, loss=1.0) for n in range(6, 11)]
    data = series_from_events([*first, resume, *second])
    assert data.loss[0].steps == tuple(range(1, 11))
    assert data.loss[0].values == (9.0,) * 5 + (1.0,) * 5


def test_smoothing_is_pandas_running_median() -> None:
    """An independent implementation: pandas' centred rolling median."""
    import random

    import pandas as pd

    rng = random.Random(0)
    for window in (1, 2, 3, 4, 5):
        for n in (1, 2, 3, 8):
            values = [rng.uniform(0, 10) for _ in range(n)]
            expected = pd.Series(values).rolling(window, center=True, min_periods=1).median().tolist()
            assert smooth(values, window) == pytest.approx(expected)


def test_the_first_steps_loss_does_not_squash_the_curve_and_the_axis_says_so() -> None:
    """The smol run's shape: 69 nats at step 1, then 5-9: the axis spans the curve, not 69."""
    losses = {1: 69.0, **{n: 6.0 + (n % 30) / 10 for n in range(10, 160, 10)}}
    events = [{**step_event(n, loss=loss), "role": "single"} for n, loss in losses.items()]
    data = series_from_events(events)
    assert [s.label for s in data.loss] == ["training"]  # one process: no rank in sight
    fig = figure(data, "t")
    try:
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        assert high < 20 and low > 4  # the 5-9 curve fills the panel
        assert "1 early point above, clipped" in ax.get_ylabel()
        assert ax.get_legend() is None  # a single curve needs no legend
    finally:
        from matplotlib import pyplot as plt

        plt.close(fig)


def test_nothing_to_plot_yet_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    start = {"v": 1, "ts": T0, "event": "run_start", "rank": 0, "role": "single", "config": "smol-cpu",
             "run_dir": str(run), "pid": 1, "host": "h", "world_size": 1, "device": "cpu"}  # fmt: skip
    (run / "events.jsonl").write_text(json.dumps(start) + "\n")
    with pytest.raises(RunError, match="nothing to plot yet: run run has logged no training step"):
        plot_log(run, out=str(tmp_path / "p.png"))


def tree_eval(step: int, tau_64: float, best: int | None = 128) -> dict:
    entries = [
        {"budget": b, "tau_mean": t, "tau_prompt_mean": t, "hist": [0, 1], "rounds": 5, "tree_size_mean": b}
        for b, t in ((16, tau_64 - 0.4), (64, tau_64), (128, tau_64 + 0.2))
    ]
    event = {"v": 1, "ts": T0 + 100 + step, "event": "eval", "rank": 0, "role": "single", "step": step,
             "tau_mean": tau_64 - 1.0, "tau_hist": [1, 2], "tau_estimate": 2.9, "tree": entries}  # fmt: skip
    if best is not None:
        event["tree_cost"] = {"device": "H100", "context": 320, "speedup": {"0": 1.5, "16": 1.9, "64": 2.1,
                              "128": 2.2}, "best_budget": best, "best_speedup": 2.2}  # fmt: skip
    return event


def test_tree_figures_get_their_panel_and_a_curve_at_the_chosen_budget() -> None:
    events = [step_event(n) for n in range(1, 41)]
    events += [tree_eval(20, 3.0), {**tree_eval(40, 3.5), "split": "train"}, tree_eval(40, 3.4)]
    data = series_from_events(events)
    assert data.last_tree is not None and data.last_tree.step == 40 and data.last_tree.taus[64] == 3.4
    assert data.tree_tau is not None and data.tree_tau.label.startswith("eval tree tau @128")
    assert data.tree_tau.steps == (20, 40) and data.tree_tau.values == pytest.approx((3.2, 3.6))
    fig = figure(data, "t")
    try:
        assert len(fig.axes) == 5  # loss, tau, tokens/s, the budget panel and its speedup axis
        budget_ax, speed_ax = fig.axes[3], fig.axes[4]
        assert budget_ax.get_xscale() == "log" and "budget" in budget_ax.get_xlabel()
        tree_line = budget_ax.get_lines()[0]
        assert list(tree_line.get_xdata()) == [16, 64, 128]
        assert list(tree_line.get_ydata()) == pytest.approx([3.0, 3.4, 3.6])
        assert budget_ax.get_lines()[1].get_ydata()[0] == pytest.approx(2.4)  # the chain's tau
        assert list(speed_ax.get_lines()[0].get_ydata()) == pytest.approx([1.9, 2.1, 2.2])
        assert "eval tree tau @128 (greedy replay)" in fig.axes[1].get_legend_handles_labels()[1]
    finally:
        from matplotlib import pyplot as plt

        plt.close(fig)
    # no cost measured: the tau at 64 over steps, no speedup axis
    plain = series_from_events([*events[:40], tree_eval(40, 3.4, best=None)])
    assert plain.tree_tau is not None and plain.tree_tau.label.startswith("eval tree tau @64")
    fig = figure(plain, "t")
    try:
        assert len(fig.axes) == 4
    finally:
        from matplotlib import pyplot as plt

        plt.close(fig)
