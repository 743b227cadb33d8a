"""wandb is optional: disabled or absent gives a NullLogger and a one-line reason, never an error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from training.config import load_config
from training.wandb_logger import NullLogger, make_logger


def test_disabled_is_a_null_logger(tmp_path: Path) -> None:
    logger, line = make_logger(load_config("tiny-cpu"), tmp_path)
    assert isinstance(logger, NullLogger) and "disabled" in line
    logger.log({"loss": 1.0}, step=1)
    logger.finish()


def test_enabled_without_the_package_is_a_null_logger(tmp_path: Path) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here; this test covers a machine without it")
    logger, line = make_logger(load_config("tiny-cpu", ["--wandb.enabled=true"]), tmp_path)
    assert isinstance(logger, NullLogger) and "not installed" in line
    assert not (tmp_path / "wandb").exists()
