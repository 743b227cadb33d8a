"""SIGTERM outside the step loop: the data phase (regeneration) and the eval stop at once, exit 0,
and say what a resume will find; the long phases write progress events while they run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.events import read_events, validate_event
from training.run.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _start(run_dir: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "training", "train", "--config", "tiny-cpu", "--run-dir", str(run_dir),
        "--train.torch_threads=1", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "FLEET_TRAINING_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _stop_when(proc: subprocess.Popen, events: Path, phase: str) -> list[dict]:
    """SIGTERM once ``phase`` has reported progress that moved; the run's events after it ended."""
    try:
        while proc.poll() is None:
            found = read_events(events) if events.exists() else []
            if any(e["event"] == "progress" and e["phase"] == phase and e["done"] > 0 for e in found):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        assert proc.wait(timeout=600) == 0, proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = read_events(events)
    assert all(validate_event(e) == [] for e in got)
    return got


def test_sigterm_during_regeneration_stops_at_once_with_nothing_to_resume(
    tiny_cache: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # enough replies that the stop lands long before the regeneration's end
    proc = _start(
        run, tiny_cache, "--data.regenerate=true", "--data.regen_prompts=600", "--data.regen_batch_size=2"
    )
    events = _stop_when(proc, run / "events.jsonl", "load_data")
    out = proc.stdout.read() if proc.stdout else ""
    last = events[-1]
    assert last["event"] == "phase" and last["phase"] == "stopped"
    assert (last["during"], last["resume_step"]) == ("load_data", 0)
    assert not any(e["event"] == "step" for e in events) and list_checkpoints(run) == []
    assert "`fab train` starts at step 1 (no checkpoint)" in out
    assert "Traceback" not in out
    regen = tiny_cache / "regen"
    assert not regen.exists() or not [p.name for p in regen.iterdir() if p.name.endswith(".tmp")]


def test_sigterm_during_eval_stops_it_and_keeps_the_trained_step(tiny_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    long_eval = ["--eval.num_prompts=8", "--eval.max_new_tokens=400", "--data.eval_prompts=8"]
    proc = _start(
        run, tiny_cache, "--train.steps=2", "--train.log_every=1", "--checkpoint.every=0", *long_eval
    )
    events = _stop_when(proc, run / "events.jsonl", "eval")
    last = events[-1]
    assert (last["phase"], last["during"], last["resume_step"]) == ("stopped", "eval", 2)
    assert not any(e["event"] == "eval" for e in events)  # the eval never finished
    assert [step for step, _ in list_checkpoints(run)] == [2]
