"""Optional Weights & Biases logging: offline in the run dir by default, never fatal.

``make_logger`` returns a ``WandbLogger`` when wandb is enabled in the config and the
package imports (and, online, a key is configured); otherwise a ``NullLogger`` and a one-line
reason. A run never fails because wandb is missing or cannot start.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Protocol

from training.config import RunConfig, config_to_dict
from training.contract import EVENTS_FILE


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


class NullLogger:
    """Accepts everything, does nothing."""

    def __init__(self, reason: str = "disabled") -> None:
        self.reason = reason

    def log(self, metrics: dict[str, Any], step: int) -> None:
        del metrics, step

    def finish(self) -> None:
        return None


class WandbLogger:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def make_logger(config: RunConfig, run_dir: Path) -> tuple[MetricsLogger, str]:
    """(logger, one line saying what it does)."""
    section = config.wandb
    if not section.enabled:
        return NullLogger("disabled"), "wandb: disabled (wandb.enabled = false)"
    try:
        wandb = importlib.import_module("wandb")
    except ImportError:
        return NullLogger("not installed"), f"wandb: package not installed, metrics only in {EVENTS_FILE}"
    if section.mode == "online" and not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")):
        return NullLogger("no key"), "wandb: online mode but WANDB_API_KEY is not set, logging disabled"
    try:
        run = wandb.init(
            project=section.project,
            entity=section.entity or None,
            name=section.name or run_dir.name,
            dir=str(run_dir),
            mode=section.mode,
            config=config_to_dict(config),
            resume="allow",
            id=run_dir.name.replace(":", "-")[:64],
        )
    except (OSError, RuntimeError, ValueError) as exc:  # wandb's own errors derive from these
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return NullLogger("init failed"), f"wandb: could not start ({reason:.120}), logging disabled"
    return WandbLogger(run), f"wandb: {section.mode} in {run_dir}/wandb"
