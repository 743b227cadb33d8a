"""A DFlash drafter folder in the Hugging Face layout (``training.export`` writes one; z-lab's
published drafters are one), read back into a ``DFlashDrafter``: ``eval --export`` and
``drafter.init_from``. The names and fields are those of ``training/export.py``'s docstring.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from training.config import ConfigError
from training.contract import HF_CONFIG_FILE
from training.model.drafter import DFlashDrafter

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"


def read_export(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, fp32 weights) of an exported folder; a folder that is not one is a ConfigError."""
    from safetensors.torch import load_file

    folder = folder.expanduser()
    cfg_path, weights_path = folder / HF_CONFIG_FILE, folder / WEIGHTS
    if not cfg_path.is_file() or not weights_path.is_file():
        raise ConfigError(f"{folder} is not an exported drafter (needs {HF_CONFIG_FILE} and {WEIGHTS})")
    body = json.loads(cfg_path.read_text(encoding="utf-8"))
    if ARCHITECTURE not in body.get("architectures", []):
        raise ConfigError(f"{cfg_path}: architectures is not [{ARCHITECTURE!r}]")
    return body, {k: v.float() for k, v in load_file(str(weights_path)).items()}


def load_export_into(drafter: DFlashDrafter, folder: Path) -> dict[str, Any]:
    """Load an exported folder's weights into ``drafter`` after checking that the folder was
    exported for the same recipe (block size, target layers, MASK id, layer types, window)."""
    body, weights = read_export(folder)
    dflash = body.get("dflash_config", {})
    cfg = drafter.cfg
    attn = drafter.layers[0].self_attn
    want = {
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": attn.heads,
        "num_key_value_heads": attn.kv_heads,
        "head_dim": attn.head_dim,
        "intermediate_size": drafter.layers[0].mlp.gate_proj.out_features,
        "block_size": cfg.block_size,
        "target_layer_ids": list(drafter.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "layer_types": cfg.layer_types(),
    }
    got = {key: body.get(key) for key in list(want)[:5]}
    got |= {
        "block_size": dflash.get("block_size", body.get("block_size")),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "mask_token_id": dflash.get("mask_token_id"),
        "layer_types": body.get("layer_types"),
    }
    if "sliding_attention" in cfg.layer_types():
        want["sliding_window"], got["sliding_window"] = cfg.sliding_window, body.get("sliding_window")
    differ = [f"{k} {got[k]!r} (run: {want[k]!r})" for k in want if got[k] != want[k]]
    if differ:
        raise ConfigError(f"{folder} was exported for another drafter: {'; '.join(differ)}")
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"{folder}/{WEIGHTS} does not fit this run's drafter: {first}") from None
    return body
