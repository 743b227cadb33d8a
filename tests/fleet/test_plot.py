"""`fab plot`: the PNG written from step/eval events (real matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from fleet.errors import ConfigError, RunError
from fleet.plot import HEIGHT_PX, WIDTH_PX, plot_log, plot_png, series_from_events
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
    path = tmp_path / "run" / "events.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def test_series_per_rank_drop_nan_and_keep_eval() -> None:
    events = [step_event(1), step_event(2, loss=math.nan), step_event(3), step_event(1, rank=1)]
    events.append({"event": "eval", "step": 3, "tau_mean": 2.0})
    data = series_from_events(events)
    assert [s.label for s in data.loss] == ["rank 0 (drafter)", "rank 1 (drafter)"]
    assert data.loss[0].steps == (1, 3)  # the NaN loss is dropped, not plotted
    assert data.tau[0].steps == (1, 2, 3)
    assert data.eval_tau is not None and data.eval_tau.values == (2.0,)


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
