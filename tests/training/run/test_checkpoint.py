"""Checkpoints: atomic files, last K kept, stale temp files removed, RNG restored."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from training.run.checkpoint import (
    checkpoint_dir,
    list_checkpoints,
    load_latest,
    remove_stale_temps,
    restore_rng,
    save_checkpoint,
)


def test_save_keeps_last_k_and_loads_newest(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    for step in (2, 4, 6):
        saved = save_checkpoint(tmp_path, step, {"w": torch.full((3,), float(step))}, keep=2)
        assert saved.path.is_file() and saved.step == step
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    state = load_latest(tmp_path)
    assert state is not None and state["step"] == 6 and torch.equal(state["w"], torch.full((3,), 6.0))
    assert not [p for p in checkpoint_dir(tmp_path).iterdir() if p.name.endswith(".tmp")]


def test_a_torn_temp_file_is_ignored_and_removed(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    torn = checkpoint_dir(tmp_path) / ".step-00000002.pt.999.tmp"
    torn.write_bytes(b"\x80\x02half a pickle")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    state = load_latest(tmp_path)
    assert state is not None and state["step"] == 1
    assert remove_stale_temps(tmp_path) == 1 and not torn.exists()


def test_rng_state_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(5)
    random.seed(5)
    save_checkpoint(tmp_path, 1, {}, keep=1)
    expected = (torch.rand(3), random.random())
    torch.rand(7)  # move the generators on
    state = load_latest(tmp_path)
    assert state is not None
    restore_rng(state)
    again = (torch.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]


def test_resume_mismatches_name_only_what_a_checkpoint_depends_on() -> None:
    from training.config import config_to_dict, load_config, resume_mismatches

    saved = config_to_dict(load_config("tiny-cpu"))
    same_shape = load_config(
        "tiny-cpu", ["--train.steps=999", "--train.lr=1e-5", "--model.device=cpu", "--data.num_proc=4"]
    )
    assert resume_mismatches(saved, same_shape) == []
    other = load_config("tiny-cpu", ["--drafter.block_size=4", "--data.seed=3"])
    assert resume_mismatches(saved, other) == ["drafter.block_size 8 -> 4", "data.seed 0 -> 3"]
    # An older config.json without a key: not compared; not a dict: ignored.
    del saved["drafter"]["block_size"]
    saved["data"] = "?"
    assert resume_mismatches(saved, other) == []


def test_a_run_dir_without_checkpoints_takes_any_config(tmp_path: Path) -> None:
    from training.config import ConfigError, load_config, write_config
    from training.run.checkpoint import check_resumable

    write_config(load_config("tiny-cpu"), tmp_path)
    check_resumable(load_config("tiny-cpu", ["--drafter.num_layers=3"]), tmp_path)  # no checkpoint yet
    save_checkpoint(tmp_path, 1, {"step": 1}, keep=1)
    with pytest.raises(ConfigError, match=r"drafter.num_layers 2 -> 3"):
        check_resumable(load_config("tiny-cpu", ["--drafter.num_layers=3"]), tmp_path)
