"""Verified checkpoints: a sha256 manifest written with each one, checked before a resume; a bad
checkpoint set aside (never deleted) and the previous one used; pruning keeps the newest good one;
a non-finite loss stops the run before it checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import types
import zipfile
from pathlib import Path

import pytest
import torch

from training.config import load_config
from training.data.buckets import Position
from training.events import EventWriter, read_events, validate_event
from training.run.checkpoint import (
    CheckpointManager,
    NonFiniteLoss,
    check_finite,
    check_resumable,
    checkpoint_dir,
    checkpoint_path,
    list_checkpoints,
    manifest_path,
    prune,
    save_checkpoint,
    verify_checkpoint,
)

CONFIG = load_config("tiny-cpu")


def _save(run_dir: Path, step: int, keep: int = 5) -> Path:
    return save_checkpoint(run_dir, step, {"w": torch.full((4096,), float(step)), "step": step}, keep).path


def _overwrite_inside(path: Path, size: int = 4096) -> None:
    """A few KB overwritten in the middle of the file: its length and zip structure unchanged."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2 - size // 2)
        handle.write(b"\xa5" * size)


def test_the_manifest_holds_the_files_size_and_sha256(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    manifest = json.loads(manifest_path(path).read_text())
    data = path.read_bytes()
    assert manifest == {
        "step": 3,
        "file": "step-00000003.pt",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert verify_checkpoint(path, 3) == ""
    assert not [p for p in checkpoint_dir(tmp_path).iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_overwrite_inside, "sha256 mismatch"),
        (lambda p: os.truncate(p, p.stat().st_size // 2), "truncated"),
    ],
    ids=["overwritten", "truncated"],
)
def test_a_bad_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(
    tmp_path: Path, damage, reason: str
) -> None:
    from training.run import core

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    model.cfg = types.SimpleNamespace(mask_token_id=7)  # what checkpoint_state reads of a drafter
    optimizer, scheduler = core.build_optimizer(CONFIG, model)
    for step in (2, 4):
        with torch.no_grad():
            model.weight.fill_(float(step))
        state = core.checkpoint_state(
            model, optimizer, scheduler, position=Position(0, step), tau=1.0, config=CONFIG
        )
        save_checkpoint(tmp_path, step, state, keep=5)
    newest = checkpoint_path(tmp_path, 4)
    damage(newest)
    events = EventWriter(tmp_path, rank=0, role="single")
    lines: list[str] = []
    manager = CheckpointManager(tmp_path, CONFIG, dict, events=events, echo=lines.append)
    point = manager.check()
    assert point.step == 2 and point.path == checkpoint_path(tmp_path, 2).resolve()
    resumed = manager.resume(model, optimizer, scheduler, map_location="cpu")
    events.close()
    assert resumed is not None and (resumed.step, resumed.position) == (2, Position(0, 2))
    assert torch.equal(model.weight, torch.full((64, 64), 2.0))
    aside = newest.with_name("step-00000004.pt.bad")
    assert aside.exists() and not newest.exists()  # renamed, not deleted
    assert manifest_path(aside).exists() and not manifest_path(newest).exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert len(lines) == 1 and "step 4" in lines[0] and reason in lines[0] and aside.name in lines[0], lines
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_set_aside"]
    assert validate_event(event) == []
    assert event["step"] == 4 and reason in event["reason"] and event["moved_to"] == str(aside)


def test_the_read_only_check_names_the_bad_one_and_moves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (1, 2):
        _save(tmp_path, step)
    _overwrite_inside(checkpoint_path(tmp_path, 2))
    point = check_resumable(CONFIG, tmp_path)
    assert point.step == 1 and [r.step for r in point.rejected] == [2]
    assert point.rejected[0].moved_to is None and checkpoint_path(tmp_path, 2).exists()
    # the command fab train runs on the target says the same, in lines fleet parses
    from training.__main__ import main

    assert main(["resume-check", "--config", "tiny-cpu", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rejected 2 checkpoint step 2 (") and "sha256 mismatch" in out[0], out
    assert out[1] == f"checkpoint 1 {CONFIG.train.steps} {checkpoint_path(tmp_path, 1).resolve()}", out
    from fleet.runs import parse_resume_check
    from training.contract import parse_rejected_lines

    assert parse_resume_check("r", "\n".join(out)).step == 1  # type: ignore[union-attr]
    assert parse_rejected_lines("\n".join(out)) == (out[0].split(" ", 2)[2],)


def test_every_checkpoint_bad_means_nothing_to_resume(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    os.truncate(checkpoint_path(tmp_path, 1), 100)
    point = check_resumable(CONFIG, tmp_path, set_aside=True)
    assert point.path is None and point.step == 0 and [r.step for r in point.rejected] == [1]
    assert checkpoint_path(tmp_path, 1).with_name("step-00000001.pt.bad").stat().st_size == 100


def test_a_second_bad_copy_of_a_step_does_not_overwrite_the_first(tmp_path: Path) -> None:
    for _ in range(2):
        _save(tmp_path, 7)
        _overwrite_inside(checkpoint_path(tmp_path, 7))
        check_resumable(CONFIG, tmp_path, set_aside=True)
    names = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir() if ".bad" in p.name)
    assert names == [
        "step-00000007.pt.bad",
        "step-00000007.pt.bad.2",
        "step-00000007.pt.bad.2.manifest.json",
        "step-00000007.pt.bad.manifest.json",
    ]


def _legacy(run_dir: Path, step: int) -> Path:
    """A checkpoint as written before manifests existed: torch.save under the final name."""
    path = checkpoint_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.full((4096,), float(step)), "step": step}, path)
    return path


def test_a_checkpoint_without_a_manifest_resumes_when_its_crcs_and_load_pass(tmp_path: Path) -> None:
    _legacy(tmp_path, 1)
    _legacy(tmp_path, 2)
    assert check_resumable(CONFIG, tmp_path).step == 2
    _overwrite_inside(checkpoint_path(tmp_path, 2))
    # independent of our check: the zip's own CRCs catch it, torch.load does not
    with zipfile.ZipFile(checkpoint_path(tmp_path, 2)) as archive:
        assert archive.testzip() is not None
    point = check_resumable(CONFIG, tmp_path)
    assert point.step == 1 and "CRC mismatch" in point.rejected[0].reason


def test_pruning_keeps_the_newest_checkpoint_that_passed_its_check(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        _save(tmp_path, step)
    assert prune(tmp_path, 1, known_good={10}) == [20]  # 30 kept (the last 1), 10 kept (newest good)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 30]
    assert prune(tmp_path, 1, known_good={10, 30}) == [10]
    assert not manifest_path(checkpoint_path(tmp_path, 10)).exists()  # its manifest went with it


def test_a_resumed_run_keeps_its_verified_checkpoint_through_pruning(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    keep_one = load_config("tiny-cpu", ["--checkpoint.keep=1"])
    manager = CheckpointManager(tmp_path, keep_one, lambda: {"w": torch.zeros(3)}, events=None, echo=print)
    assert manager.check().step == 5
    _legacy(tmp_path, 9)  # an unchecked newer file appears (e.g. copied in by hand)
    manager.save(6)
    manager.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 9]  # 6: the newest that passed a check


def test_check_finite_names_the_step_and_the_last_good_checkpoint() -> None:
    check_finite(3, 1.5, 0.2, 2)
    with pytest.raises(NonFiniteLoss, match=r"^non-finite loss at step 7 .*last good checkpoint is step 6"):
        check_finite(7, float("nan"), 0.1, 6)
    with pytest.raises(NonFiniteLoss, match=r"^non-finite gradient norm at step 2 "):
        check_finite(2, 0.5, float("inf"), 0)
    assert NonFiniteLoss.exit_code == 4
