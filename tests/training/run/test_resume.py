"""Resume: kill -9 + restart continues with the same batches and losses; SIGTERM checkpoints, exits 0."""

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
SMALL = [
    "--train.log_every=1",
    "--train.torch_threads=1",
    "--checkpoint.every=2",
    "--checkpoint.keep=2",
    "--eval.num_prompts=0",
    "--data.token_budget=512",
]

pytestmark = pytest.mark.slow


def _argv(run_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "training", "train", "--config", "tiny-cpu",
        "--run-dir", str(run_dir), f"--train.steps={steps}", *SMALL,
    ]  # fmt: skip


def _env(cache: Path) -> dict[str, str]:
    # the runs here train the same data: tokenized once (FLEET_DATA_CACHE), not per run
    return {
        **os.environ,
        "FLEET_TRAINING_CACHE": str(cache),
        "FLEET_DATA_CACHE": str(cache / "data"),
        "OMP_NUM_THREADS": "1",
    }


def _run(run_dir: Path, steps: int, cache: Path) -> None:
    result = subprocess.run(_argv(run_dir, steps), cwd=REPO, env=_env(cache), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _wait_for(path: Path, predicate, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(predicate(e) for e in read_events(path)):
            return
        assert proc.poll() is None, "the run ended before the awaited event"
        time.sleep(0.2)
    raise AssertionError(f"no awaited event in {path} within {timeout}s")


def _losses(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def test_kill_9_then_resume_sees_the_same_batches_and_losses(tiny_cache: Path, tmp_path: Path) -> None:
    # Enough steps after the awaited checkpoint that the kill lands before the run's end even when
    # its background write (and so its event) is slow on a loaded machine: 6 steps were not.
    steps = 30
    straight = tmp_path / "straight"
    _run(straight, steps, tiny_cache)
    expected = _losses(read_events(straight / "events.jsonl"))
    assert sorted(expected) == list(range(1, steps + 1))

    killed = tmp_path / "killed"
    events_path = killed / "events.jsonl"
    proc = subprocess.Popen(_argv(killed, steps), cwd=REPO, env=_env(tiny_cache), stdout=subprocess.DEVNULL)
    try:
        _wait_for(events_path, lambda e: e["event"] == "checkpoint" and e["step"] == 2, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = read_events(events_path)
    assert not any(e["event"] == "done" for e in before)
    # Checkpoints are written in the background and their event follows the file: the kill can
    # land after a newer file is complete but before its event. The resume takes the newest
    # complete file on disk.
    on_disk = [step for step, _ in list_checkpoints(killed)]
    assert on_disk and max(on_disk) >= max(e["step"] for e in before if e["event"] == "checkpoint")
    _run(killed, steps, tiny_cache)
    events = read_events(events_path)
    assert all(validate_event(e) == [] for e in events)
    starts = [i for i, e in enumerate(events) if e["event"] == "run_start"]
    assert len(starts) == 2
    resumed = events[starts[1] :]
    resumed_losses = _losses(resumed)
    newest = max(on_disk)
    # The resumed process starts right after the newest checkpoint: no batch repeated or skipped.
    assert min(resumed_losses) == newest + 1
    marks = [e for e in resumed if e["event"] == "resume"]  # the launch says where it continued
    assert [(e["step"], Path(e["path"]).name) for e in marks] == [(newest, f"step-{newest:08d}.pt")]
    assert max(resumed_losses) == steps
    for step, loss in resumed_losses.items():
        assert loss == expected[step], (step, loss, expected[step])
    for step, loss in _losses(before).items():
        assert loss == expected[step]
    assert [e["phase"] for e in resumed if e["event"] == "phase"][-1] == "done"


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(tiny_cache: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    events_path = run_dir / "events.jsonl"
    proc = subprocess.Popen(_argv(run_dir, 500), cwd=REPO, env=_env(tiny_cache), stdout=subprocess.DEVNULL)
    try:
        _wait_for(events_path, lambda e: e["event"] == "step", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = read_events(events_path)
    assert all(validate_event(e) == [] for e in events)
    phases = [e["phase"] for e in events if e["event"] == "phase"]
    assert phases[-1] == "stopped"
    last_step = max(e["step"] for e in events if e["event"] == "step")
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert saved and saved[-1]["step"] >= last_step and Path(saved[-1]["path"]).is_file()


def test_a_resume_with_another_model_or_data_config_is_refused_in_one_line(
    tiny_cache: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    _run(run_dir, 2, tiny_cache)  # checkpoint at step 2
    saved = (run_dir / "config.json").read_text()
    changed = subprocess.run(
        [*_argv(run_dir, 4), "--drafter.num_layers=3", "--data.max_length=128"],
        cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True,
    )  # fmt: skip
    assert changed.returncode == 2, changed.stderr[-2000:]
    lines = changed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in changed.stderr, changed.stderr
    assert "holds checkpoints of another config" in lines[0]
    assert "drafter.num_layers 2 -> 3" in lines[0] and "data.max_length 192 -> 128" in lines[0]
    assert (run_dir / "config.json").read_text() == saved  # nothing overwritten
    # The same rule, asked before a launch (fleet's `fab train`): read-only, one line.
    check = [sys.executable, "-m", "training", "resume-check", "--config", "tiny-cpu", "--run-dir"]
    asked = subprocess.run(
        [*check, str(run_dir), *SMALL, "--drafter.num_layers=3"], cwd=REPO, env=_env(tiny_cache),
        capture_output=True, text=True,
    )  # fmt: skip
    assert asked.returncode == 2 and asked.stderr == "changed settings: drafter.num_layers 2 -> 3\n", asked
    fine = subprocess.run(
        [*check, str(run_dir), *SMALL], cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True
    )
    newest = (run_dir / "checkpoints" / "step-00000002.pt").resolve()
    assert fine.returncode == 0 and fine.stdout == f"checkpoint 2 150 {newest}\n", fine
    empty = subprocess.run(
        [*check, str(tmp_path / "none")], cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True
    )
    assert (empty.returncode, empty.stdout) == (0, "none\n"), empty
    assert (run_dir / "config.json").read_text() == saved
    # More steps, another lr: what a resume may change. It continues from step 2.
    _run_with(run_dir, 4, tiny_cache, "--train.lr=1e-4")
    steps = [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"]
    assert steps[-2:] == [3, 4]


def _run_with(run_dir: Path, steps: int, cache: Path, *extra: str) -> None:
    argv = [*_argv(run_dir, steps), *extra]
    result = subprocess.run(argv, cwd=REPO, env=_env(cache), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_non_finite_loss_fails_the_run_before_it_checkpoints_and_is_not_retried(
    tiny_cache: Path, tmp_path: Path
) -> None:
    from fleet.remote.run_cause import first_cause
    from fleet.status.diagnose import NOT_RETRYABLE, diagnose

    run_dir = tmp_path / "run"
    argv = [*_argv(run_dir, 6), "--checkpoint.every=1", "--checkpoint.keep=10", "--train.lr=1e12"]
    argv += ["--train.warmup_steps=1"]  # a learning rate no model survives: the loss overflows
    result = subprocess.run(argv, cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True)
    assert result.returncode == 4, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    bad = int(line.split("non-finite loss at step ")[1].split()[0])
    assert bad >= 2 and f"the last good checkpoint is step {bad - 1}" in line, line
    # nothing written at or after the bad step; the earlier ones kept
    assert [s for s, _ in list_checkpoints(run_dir)] == list(range(1, bad))
    events = read_events(run_dir / "events.jsonl")
    assert [e["phase"] for e in events if e["event"] == "phase"][-1] == "error"
    (error,) = [e for e in events if e["event"] == "error"]
    assert error["type"] == "NonFiniteLoss" and error["message"].startswith(f"non-finite loss at step {bad} ")
    # fab status's diagnosis, and the restart policy's (remote/run.sh -> run_cause.py) reading of the log
    (found,) = diagnose(result.stdout + result.stderr, events)
    assert found.signature == "non-finite-loss" and f"at step {bad}" in found.cause
    rows = "\n".join(f"{sig}\t{pattern}" for sig, pattern in NOT_RETRYABLE)
    assert first_cause(result.stdout + result.stderr, rows) == "non-finite-loss"
