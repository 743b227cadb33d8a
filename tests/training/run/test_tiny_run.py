"""The done-when run: the tiny default trains on the default corpus, loss halves, eval reports tau."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.data.buckets import parse_bucket_table
from training.events import read_events, validate_event

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


def test_tiny_cpu_run_halves_its_loss_and_eval_reports_tau(tiny_cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FLEET_TRAINING_CACHE": str(tiny_cache)}
    run_dir = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "training", "train", "--config", "tiny-cpu", "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    table = parse_bucket_table(train.stdout)  # the start-up table is in the user's format
    assert table.batches_per_epoch == sum(b.batches for b in table.buckets) > 0

    events = read_events(run_dir / "events.jsonl")
    problems = [(e["event"], validate_event(e)) for e in events if validate_event(e)]
    assert problems == []
    steps = [e for e in events if e["event"] == "step"]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == steps[-1]["total_steps"]
    # Step losses are noisy (small batches): the mean of the last five logged ones must be
    # below half of the first step's loss.
    final = sum(e["loss"] for e in steps[-5:]) / 5
    assert final < steps[0]["loss"] / 2, (steps[0]["loss"], [e["loss"] for e in steps])
    assert [e["phase"] for e in events if e["event"] == "phase"][-1] == "done"
    assert (run_dir / "config.json").is_file()

    evaluate = subprocess.run(
        [sys.executable, "-m", "training", "eval", "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    assert "tau_mean=" in evaluate.stdout
    evals = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "eval"]
    assert len(evals) == 2  # the end of training + the eval command
    for e in evals:
        assert e["tau_mean"] >= 1.0 and sum(e["tau_hist"]) > 0
        assert e["step"] == steps[-1]["step"]
