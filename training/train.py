"""``python -m training train``: build the config, build the trainer, train, close."""

from __future__ import annotations

from pathlib import Path

from training.config import load_config
from training.trainer import Trainer


def train(config_name: str, run_dir: Path, overrides: list[str]) -> int:
    """Run (or resume) a training run; returns the steps done."""
    config = load_config(config_name, overrides)
    trainer = Trainer(config, run_dir)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
