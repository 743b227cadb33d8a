"""Through `fab` on the local target (real tmux, the real trainer): `fab status` shows every long
phase with its fraction and ETA, and `fab stop` (SIGTERM outside the step loop) stops the run at
once in the data phase and in the eval, exit 0, saying what a resume will find."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from testkit import LocalTmux, fab, phase_progress_gaps, render_inventory

from training.contract import EVENTS_FILE
from training.events import read_events, validate_event
from training.run.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def training_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's model cache (SmolLM2's converted folder and the tiny model, built on first use)."""
    return Path(os.environ.get("FLEET_TEST_TRAINING_CACHE") or tmp_path_factory.mktemp("training-cache"))


def _fleet(tmp_path: Path, cache: Path, config: str, overrides: list[str]) -> Path:
    target = {
        "host": "local",
        "workdir": str(tmp_path / "wd"),
        "gpus": 0,
        "env": "",
        "run": {"module": "training", "config": config, "overrides": ["--train.torch_threads=1", *overrides],
                "env": {"FLEET_TRAINING_CACHE": str(cache)}},
        "commands": {"python": str(REPO / ".venv" / "bin" / "python")},
    }  # fmt: skip
    path = tmp_path / "fleet.toml"
    path.write_text(render_inventory({"loc": target}, "loc"))
    return path


def _start(config: Path, env: dict[str, str]) -> None:
    for args in (["deploy"], ["train", "--no-warm"]):
        result = fab(*args, config=config, env=env)
        assert result.returncode == 0, result.stdout + result.stderr


def _status(config: Path, env: dict[str, str]) -> dict[str, Any]:
    result = fab("status", "--json", config=config, env=env)
    data = json.loads(result.stdout)
    data["polled_at"] = time.time()
    return data


def _poll_until(config: Path, env: dict[str, str], done: Any, polls: int = 2000) -> list[dict[str, Any]]:
    seen = []
    for _ in range(polls):  # a bound on polls, not a timing
        seen.append(_status(config, env))
        if done(seen[-1]) or seen[-1]["state"] in ("finished", "stopped", "failed", "stalled"):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"never reached: last status {seen[-1]['state']} {seen[-1]['phase']}")


def _stop(config: Path, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """`fab stop`; the seconds the run took to end after SIGTERM (fab stop's own measure)."""
    result = fab("stop", config=config, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    ended = re.search(r"the run ended ([\d.]+)s later with exit code 0", result.stdout)
    assert ended, result.stdout
    return float(ended[1]), _status(config, env)


def test_status_shows_each_long_phase_with_a_fraction_and_an_eta(
    local_tmux: LocalTmux, tmp_path: Path, training_cache: Path
) -> None:
    """The smol default with its data phase (conversion once per cache, regeneration), shortened;
    its eval on the held-out split alone, no trees (the default's both sets and trees through every
    phase: tests/e2e/test_fresh_machine.py)."""
    overrides = [
        "--data.regen_prompts=4", "--data.regen_max_new_tokens=24", "--data.regen_batch_size=2",
        "--data.eval_prompts=2", "--eval.num_prompts=1", "--eval.max_new_tokens=16",
        "--eval.sets=held_out", "--eval.tree_budgets=", "--train.steps=6", "--train.log_every=1",
    ]  # fmt: skip
    config = _fleet(tmp_path, training_cache, "smol-cpu", overrides)
    env = {"TMUX_TMPDIR": str(local_tmux.socket_dir)}
    _start(config, env)
    seen = _poll_until(config, env, lambda st: False)
    assert seen[-1]["state"] == "finished", seen[-1]
    whats = {st["progress"]["what"] for st in seen if st["progress"]}
    assert any(w.startswith("regenerating the data") for w in whats), whats
    assert phase_progress_gaps(seen) == []
    text = fab("status", config=config, env=env).stdout
    assert "finished" in text and "6/6" in text


def _run_events(tmp_path: Path) -> list[dict[str, Any]]:
    """The latest run's events, each valid under the events contract."""
    events = read_events(tmp_path / "wd" / "runs" / "latest" / EVENTS_FILE)
    assert all(validate_event(e) == [] for e in events)
    return events


def test_fab_stop_in_the_data_phase(local_tmux: LocalTmux, tmp_path: Path, training_cache: Path) -> None:
    """The tiny target regenerating many replies: stopped there at once (exit 0), it says a resume
    starts over, and leaves no step, no checkpoint and no half-written set."""
    overrides = ["--data.regenerate=true", "--data.regen_prompts=600", "--data.regen_batch_size=2"]
    config = _fleet(tmp_path, training_cache, "tiny-cpu", overrides)
    env = {"TMUX_TMPDIR": str(local_tmux.socket_dir)}
    _start(config, env)
    seen = _poll_until(config, env, lambda st: bool(st["progress"] and st["progress"]["done"] > 0))
    assert seen[-1]["phase"] == "load_data", seen[-1]
    seconds, st = _stop(config, env)
    assert st["state"] == "stopped" and st["exit_code"] == 10
    assert "stopped during load_data: `fab train` starts the run again from step 1" in " ".join(st["notes"])
    events = _run_events(tmp_path)
    last = events[-1]
    assert (last["event"], last["phase"], last["during"], last["resume_step"]) == (
        "phase", "stopped", "load_data", 0
    )  # fmt: skip
    run_dir = (tmp_path / "wd" / "runs" / "latest").resolve()
    assert not any(e["event"] == "step" for e in events) and list_checkpoints(run_dir) == []
    log = (run_dir / "train.log").read_text()
    assert "`fab train` starts at step 1 (no checkpoint)" in log and "Traceback" not in log
    planned = _planned_regen(training_cache, overrides)
    assert not list(planned.parent.glob(f".{planned.name}.*.tmp"))  # nothing half-written left
    print(f"fab stop in the data phase: the run ended {seconds:.1f}s after SIGTERM")


def _planned_regen(cache: Path, overrides: list[str]) -> Path:
    """The regenerated set a tiny-cpu run with ``overrides`` trains on (in ``cache``)."""
    from training.config import load_config
    from training.run.core import planned_regen_file

    saved = os.environ.get("FLEET_TRAINING_CACHE")
    os.environ["FLEET_TRAINING_CACHE"] = str(cache)
    try:
        return planned_regen_file(load_config("tiny-cpu", overrides))
    finally:
        if saved is None:
            os.environ.pop("FLEET_TRAINING_CACHE", None)
        else:
            os.environ["FLEET_TRAINING_CACHE"] = saved


def test_fab_stop_in_the_eval(local_tmux: LocalTmux, tmp_path: Path, training_cache: Path) -> None:
    long_eval = ["--eval.num_prompts=8", "--eval.max_new_tokens=400", "--data.eval_prompts=8"]
    config = _fleet(
        tmp_path, training_cache, "tiny-cpu", ["--train.steps=2", "--checkpoint.every=0", *long_eval]
    )
    env = {"TMUX_TMPDIR": str(local_tmux.socket_dir)}
    _start(config, env)
    seen = _poll_until(config, env, lambda st: st["state"] == "evaluating" and bool(st["progress"]))
    assert seen[-1]["state"] == "evaluating", seen[-1]
    seconds, st = _stop(config, env)
    assert st["state"] == "stopped" and st["step"] == 2
    assert "stopped during eval: `fab train` resumes from the checkpoint of step 2" in " ".join(st["notes"])
    events = _run_events(tmp_path)
    last = events[-1]
    assert (last["phase"], last["during"], last["resume_step"]) == ("stopped", "eval", 2)
    assert not any(e["event"] == "eval" for e in events)  # the eval never finished
    run_dir = (tmp_path / "wd" / "runs" / "latest").resolve()
    assert [step for step, _ in list_checkpoints(run_dir)] == [2]  # the trained step is kept
    print(f"fab stop in the eval: the run ended {seconds:.1f}s after SIGTERM")
