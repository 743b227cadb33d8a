"""What the configured run needs: sizes from the run config the inventory loaded (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.doctor.parse import CHECKPOINT_BYTES_PER_PARAM
from training.config import TargetShape, target_shape
from training.contract import HF_CONFIG_FILE

if TYPE_CHECKING:
    from fleet.inventory import TargetSpec


# --- what the run needs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunNeeds:
    """Sizes of the configured run, from its config (``training/configs/<name>.toml`` + overrides)."""

    config: str
    known: bool  # False: the run config was not found; sizes are not estimated
    kind: str = ""  # model.kind: tiny | random | pretrained
    model_path: str = ""
    hidden_size: int = 0
    target_layers: int = 0  # hidden states taken per token
    token_budget: int = 0
    dtype_bytes: int = 2
    drafter_params: int = 0
    target_bytes: int | None = None
    keep_checkpoints: int = 2
    notes: tuple[str, ...] = ()
    shape: TargetShape | None = None  # the target's sizes (known: from the config or its config.json)

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.target_layers * self.hidden_size * self.dtype_bytes

    @property
    def batch_hidden_bytes(self) -> int:
        return self.token_budget * self.hidden_bytes_per_token

    @property
    def checkpoint_bytes(self) -> int:
        return self.drafter_params * CHECKPOINT_BYTES_PER_PARAM


def _layer_params(h: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter


def run_needs(
    spec: TargetSpec,
    model_config: Mapping[str, Any] | None = None,
    model_bytes: int | None = None,
) -> RunNeeds:
    """Sizes from the run config the inventory loaded (``spec.run.loaded``); a pretrained target's
    shape from its ``config.json`` (pure)."""
    config = spec.run.loaded
    if config is None:
        return RunNeeds(spec.run.config, known=False)
    model, drafter = config.model, config.drafter
    notes: list[str] = []
    shape = target_shape(config)
    if shape is None:  # pretrained: the folder's config.json, read on the target
        cfg = dict(model_config or {})
        cfg = dict(cfg.get("text_config", cfg))
        if not cfg:
            notes.append(f"the model's {HF_CONFIG_FILE} was not readable: hidden size 5120 assumed")
        h = int(cfg.get("hidden_size", 5120))
        heads = int(cfg.get("num_attention_heads", 4))
        shape = TargetShape(
            hidden_size=h,
            num_hidden_layers=int(cfg.get("num_hidden_layers", 4)),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or h // max(heads, 1)),
            intermediate_size=int(cfg.get("intermediate_size", 4 * h)),
            vocab_size=int(cfg.get("vocab_size", 1024)),
        )
    h = shape.hidden_size
    layer = _layer_params(
        h, shape.intermediate_size, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    )
    ids = drafter.target_layer_ids
    n_target = len(ids) if ids else drafter.num_target_layers
    dtype = model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if spec.gpus > 0 else "float32"
    dtype_bytes = 4 if dtype == "float32" else 2
    drafter_params = drafter.num_layers * layer + n_target * h * h
    if model.kind == "pretrained":
        target_bytes = model_bytes
    else:
        target_bytes = (shape.num_hidden_layers * layer + 2 * shape.vocab_size * h) * dtype_bytes
    return RunNeeds(
        config=spec.run.config,
        known=True,
        kind=model.kind,
        model_path=model.path,
        hidden_size=h,
        target_layers=n_target,
        token_budget=config.data.token_budget,
        dtype_bytes=dtype_bytes,
        drafter_params=drafter_params,
        target_bytes=target_bytes,
        keep_checkpoints=config.checkpoint.keep,
        notes=tuple(notes),
        shape=shape,
    )
