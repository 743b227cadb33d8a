"""Checkpoints: atomic files, last K kept, stale temp files removed, RNG restored."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from training.config import load_config
from training.run.checkpoint import (
    CheckpointManager,
    CheckpointWriter,
    checkpoint_dir,
    checkpoint_path,
    list_checkpoints,
    load_latest,
    remove_stale_temps,
    restore_rng,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[3]


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


# ------------------------------------------------------------------ background writes
def _gate_torch_save(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """torch.save waits until the returned event is set (the write is held mid-way)."""
    gate = threading.Event()
    real = torch.save

    def held(obj, f, *args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held)
    return gate


def test_background_save_writes_a_snapshot_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CheckpointWriter(tmp_path, keep=2)
    w = torch.zeros(4)
    writer.save(1, {"w": w, "meta": {"note": ["a"]}})
    (first,) = writer.wait()
    assert first.step == 1 and first.blocking_s is not None and 0 <= first.blocking_s <= first.total_s
    gate = _gate_torch_save(monkeypatch)
    w += 2.0
    meta = {"note": ["b"]}
    writer.save(2, {"w": w, "meta": meta})
    w += 100.0  # training goes on: the saved copy must not see this
    meta["note"].append("changed")
    # a reader meanwhile sees the previous complete checkpoint only
    assert writer.busy and writer.poll() == []
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    state = load_latest(tmp_path)
    assert state is not None and state["step"] == 1 and torch.equal(state["w"], torch.zeros(4))
    gate.set()
    (second,) = writer.wait()
    assert second.step == 2 and second.path == checkpoint_path(tmp_path, 2).resolve()
    state = load_latest(tmp_path)
    assert state is not None and state["step"] == 2
    assert torch.equal(state["w"], torch.full((4,), 2.0)) and state["meta"] == {"note": ["b"]}
    assert not writer.busy and writer.wait() == []
    assert not [p for p in checkpoint_dir(tmp_path).iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_reserved_buffers_are_the_ones_the_first_save_copies_into(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=1)
    state = {
        "w": torch.arange(6.0, device="cuda"),
        "opt": {"state": {0: {"m": torch.ones(3, device="cuda")}}},
    }
    writer.reserve(state)
    assert writer.reserved
    writer.save(1, state)
    assert set(writer._buffers) == {("w",), ("opt", "state", 0, "m")}
    assert all(b.is_pinned() for b in writer._buffers.values())
    writer.wait()
    loaded = load_latest(tmp_path)
    assert loaded is not None and torch.equal(loaded["w"], torch.arange(6.0))


def test_reserve_then_save_writes_the_state_and_reserves_once(tmp_path: Path) -> None:
    """``reserve`` (host buffers for the GPU tensors of a state, in the background) before the
    first save: the save waits for it and writes the state; a second reserve does nothing. On a
    machine without CUDA no tensor needs a pinned buffer; the test above checks that case."""
    writer = CheckpointWriter(tmp_path, keep=1)
    w = torch.arange(6.0)
    assert not writer.reserved
    writer.reserve({"w": w, "meta": {"n": 1}})
    assert writer.reserved
    writer.reserve({"w": w})  # once
    writer.save(1, {"w": w, "meta": {"n": 1}})
    (saved,) = writer.wait()
    state = load_latest(tmp_path)
    assert saved.step == 1 and state is not None and torch.equal(state["w"], w) and state["meta"] == {"n": 1}


def test_background_save_keeps_the_rng_of_the_save_and_the_last_k(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=2)
    torch.manual_seed(9)
    writer.save(1, {})
    expected = torch.rand(3)  # drawn after the save: what a run resumed from step 1 draws next
    for step in (2, 3):
        writer.save(step, {})  # waits for the previous write first
    assert [s.step for s in writer.wait()] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    state = torch.load(checkpoint_path(tmp_path, 2), weights_only=False)
    restore_rng(state)
    assert not torch.equal(torch.rand(3), expected)  # step 2 was saved after that draw
    writer.save(4, {})
    writer.wait()
    torch.manual_seed(9)
    writer.save(5, {})
    writer.wait()
    torch.rand(100)
    restore_rng(torch.load(checkpoint_path(tmp_path, 5), weights_only=False))
    assert torch.equal(torch.rand(3), expected)


def test_a_failed_background_write_raises_in_the_training_thread(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("a file where the folder should be")
    writer = CheckpointWriter(tmp_path, keep=1)
    writer.save(1, {"x": torch.ones(2)})  # the snapshot works; the write fails in the thread
    with pytest.raises(OSError):
        writer.wait()
    assert writer.wait() == []  # raised once


KILLED_MID_WRITE = r"""
import sys, time, types, torch
from pathlib import Path
from training.config import load_config
from training.run import core
from training.run.checkpoint import CheckpointWriter

run_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
model.cfg = types.SimpleNamespace(mask_token_id=7)  # what checkpoint_state reads of a drafter
optimizer, scheduler = core.build_optimizer(load_config("tiny-cpu"), model)
writer = CheckpointWriter(run_dir, keep=2)

def state(step):
    with torch.no_grad():
        model.weight.fill_(float(step))
    return core.checkpoint_state(model, optimizer, scheduler, position=core.Position(0, step), tau=1.0,
                                 config=load_config("tiny-cpu"))

writer.save(1, state(1))
writer.wait()
real = torch.save

class Stalling:  # a file that stalls for good after its first bytes: the write is mid-way
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, data):
        self.n += len(data)
        out = self.f.write(data)
        if self.n > 64:
            self.f.flush()
            marker.write_text("mid-write")
            time.sleep(600)
        return out
    def __getattr__(self, name):
        return getattr(self.f, name)

torch.save = lambda obj, f, *a, **k: real(obj, Stalling(f), *a, **k)
writer.save(2, state(2))
time.sleep(600)
"""


@pytest.mark.slow
def test_killed_during_a_background_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    from training.run import core

    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(run_dir), str(marker)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the writer process ended before the write stalled"
            assert time.monotonic() < deadline, "the write never started"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    temps = [p for p in checkpoint_dir(run_dir).iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size > 64  # a torn step-2 file, not under its name
    assert [s for s, _ in list_checkpoints(run_dir)] == [1]
    model = torch.nn.Linear(8, 8)
    optimizer, scheduler = core.build_optimizer(load_config("tiny-cpu"), model)
    manager = CheckpointManager(run_dir, load_config("tiny-cpu"), dict, events=None, echo=print)
    assert manager.check().step == 1
    resumed = manager.resume(model, optimizer, scheduler, map_location="cpu")
    assert resumed is not None and resumed.step == 1 and resumed.position.index == 1
    assert torch.equal(model.weight, torch.ones(8, 8))
    assert not checkpoint_dir(run_dir).joinpath(temps[0].name).exists()  # resume removed it


def test_adamw_is_fused_only_on_a_gpu_and_fused_updates_match() -> None:
    """CPU runs keep the default AdamW (their results unchanged); on a GPU it runs fused, which
    computes the same update (checked here with torch's CPU fused kernel, same hyper-parameters)."""
    from training.run import core

    config = load_config("tiny-cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    assert not core.fused_adamw(list(model.parameters()))
    optimizer, _ = core.build_optimizer(config, model)
    assert not optimizer.defaults["fused"]
    fused_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fused_model.load_state_dict(model.state_dict())
    t = config.train
    fused = torch.optim.AdamW(
        fused_model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, fused=True
    )
    for group in fused.param_groups:  # the schedule's warm-up lr, as build_optimizer's
        group["lr"] = optimizer.param_groups[0]["lr"]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 6, generator=g)
        for m, opt in ((model, optimizer), (fused_model, fused)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), fused_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
