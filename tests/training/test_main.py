"""``python -m training``: the process settings it makes before torch starts, and how it ends."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from training.__main__ import PINNED_HOST_ALLOC, allocator_settings


def test_pinned_host_allocation_is_added_to_the_users_allocator_settings() -> None:
    env: dict[str, str] = {}
    allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_HOST_ALLOC}
    allocator_settings(env)  # once
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_HOST_ALLOC}
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # the user's variable keeps theirs
    allocator_settings(env)
    assert env == {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{PINNED_HOST_ALLOC}"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}  # their choice wins
    allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}


def _write_to_full_disk() -> None:
    """A real ENOSPC: /dev/full refuses every write with it."""
    with open("/dev/full", "w") as fh:
        fh.write("x" * 8192)
        fh.flush()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_is_one_line_an_error_event_and_exit_1_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import __main__ as entry
    from training.contract import EVENTS_FILE
    from training.events import read_events
    from training.run import single

    def train(config: str, run_dir: Path, overrides: list[str]) -> None:
        try:
            _write_to_full_disk()
        except OSError as exc:  # as torch's writer does: its own error, raised from the OSError
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from exc

    monkeypatch.setattr(single, "train", train)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert entry.main(["train", "--config", "tiny-cpu", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: the disk is full (No space left on device)")
    assert "`fab train` resumes" in err
    errors = [e for e in read_events(run_dir / EVENTS_FILE) if e["event"] == "error"]
    assert errors and errors[-1]["type"] == "RuntimeError"


def test_disk_full_reads_the_chain_and_the_text_and_nothing_else() -> None:
    from training.__main__ import disk_full

    try:
        _write_to_full_disk()
    except OSError as exc:
        real = exc
    assert disk_full(real) == "the disk is full (No space left on device)"  # a write(2) names no file
    named = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/checkpoints/step-00000004.pt.tmp")
    assert disk_full(named) == (
        "the disk is full (No space left on device) writing '/runs/r/checkpoints/step-00000004.pt.tmp'"
    )
    wrapped = RuntimeError(
        "[enforce fail at inline_container.cc:664] . unexpected pos: No space left on device"
    )
    assert disk_full(wrapped) is not None and "unexpected pos" in (disk_full(wrapped) or "")
    assert disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) is not None
    assert disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert disk_full(ValueError("loss is nan")) is None
