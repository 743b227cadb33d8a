"""The hybrid target's kernel warm-up in a spawned process (training.run.kernel_warmup)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from training.compile.cache import ShapeRecord
from training.config import load_config
from training.model.target import model_source
from training.run.kernel_warmup import KernelWarmup, KernelWarmupFailed
from training.run.warm import kernel_probe_target, target_config, warm_target_kernels

SHAPES = [ShapeRecord(0, 2, 32), ShapeRecord(1, 1, 64)]


def tiny_hybrid() -> tuple[object, object]:
    config = load_config("tiny-qwen3.5-cpu")
    folder, _tokenizer = model_source(config)
    return config, target_config(config, folder)


@pytest.mark.slow
def test_the_child_reports_what_the_warm_up_in_process_does(tiny_cache: Path) -> None:
    config, hf_config = tiny_hybrid()
    device = torch.device("cpu")
    here: list[str] = []
    probe = kernel_probe_target(hf_config, device, torch.float32)
    assert probe is not None
    expected = warm_target_kernels(config, probe, SHAPES, device=device, echo=here.append)

    warmup = KernelWarmup(config, hf_config, device, torch.float32)
    warmup.send_shapes(SHAPES)
    lines: list[str] = []
    assert warmup.result(lines.append) == expected
    assert lines == here and any("target kernels:" in line for line in lines)


@pytest.mark.slow
def test_a_failing_child_is_one_line_in_the_parent(tiny_cache: Path) -> None:
    config, hf_config = tiny_hybrid()
    broken = type(hf_config).from_dict({**hf_config.to_dict(), "intermediate_size": -1})
    warmup = KernelWarmup(config, broken, torch.device("cpu"), torch.float32)
    warmup.send_shapes(SHAPES)
    with pytest.raises(KernelWarmupFailed) as info:
        warmup.result(lambda line: None)
    message = str(info.value)
    assert message.startswith("warm: the target's kernel warm-up failed: ") and "\n" not in message


def test_a_killed_child_is_named_not_waited_for(tiny_cache: Path) -> None:
    config, hf_config = tiny_hybrid()
    warmup = KernelWarmup(config, hf_config, torch.device("cpu"), torch.float32)
    os.kill(warmup.pid, signal.SIGKILL)  # before it gets its shapes: it would wait for them forever
    warmup.send_shapes(SHAPES)
    with pytest.raises(KernelWarmupFailed, match=r"ended without a result \(exit code -9"):
        warmup.result(lambda line: None)


def test_warm_main_ends_a_failed_kernel_warm_up_with_its_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.run import warm

    def fail(*args: object, **kwargs: object) -> None:
        raise KernelWarmupFailed("warm: the target's kernel warm-up failed: ValueError: no")

    monkeypatch.setattr(warm, "run_warm", fail)
    assert warm.warm_main("tiny-cpu", str(tmp_path / "cache"), [], if_needed=False) == 1
    err = capsys.readouterr().err
    assert err == "warm: the target's kernel warm-up failed: ValueError: no\n"  # no traceback
