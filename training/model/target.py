"""The frozen target model: loading, and the hidden states the drafter is trained on.

``load_target(path, device, dtype)`` loads any local Hugging Face causal-LM folder
(``local_files_only``), frozen and in eval mode. ``build_random_target`` builds one with
random weights straight on the device from a config (meta init, then ``to_empty`` and
``init_weights``), so a Qwen3-8B shape needs no 16 GB download or save. ``target_forward``
runs the decoder (not the lm_head: no [tokens x vocab] logits) and returns the outputs of the
chosen decoder layers, captured with forward hooks, concatenated on the feature axis.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.config import ConfigError, ModelSection, RunConfig
from training.data.corpus import default_cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedTarget:
    model: nn.Module  # the causal LM (embed_tokens, decoder layers, lm_head)
    tokenizer: Any  # a transformers tokenizer
    path: str  # the folder it came from ("" for a random target)
    seconds: float


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"tokenizer folder {path}: cannot load a tokenizer ({first:.160})") from None


def load_target(path: str | Path, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen, eval-mode causal LM from a local folder; ``ConfigError`` if it is missing/broken."""
    from transformers import AutoModelForCausalLM

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model folder {folder} does not exist: set model.path to a local HF model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model folder {folder} has no config.json: not a Hugging Face model folder")
    device = torch.device(device)
    dtype = dtype or resolve_dtype("auto", device)
    # Straight onto the device when `accelerate` is there; else load on CPU and move.
    placement = {"device_map": {"": str(device)}} if importlib.util.find_spec("accelerate") else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=dtype, **placement
        )
        if not placement:
            model = model.to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"model folder {folder}: cannot load ({type(exc).__name__}: {first:.160})"
        ) from None
    return _freeze(model)


def build_random_target(model_cfg: ModelSection, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A causal LM of ``model_cfg``'s shape with random weights, built directly on ``device``."""
    from transformers import AutoModelForCausalLM

    from training.model.tinymodel import qwen3_config

    config = qwen3_config(model_cfg, model_cfg.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(model_cfg.seed)
    try:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear | nn.Embedding):
                    nn.init.normal_(module.weight, std=config.initializer_range)
                    bias = getattr(module, "bias", None)
                    if bias is not None:
                        bias.zero_()
                elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                    module.weight.fill_(1.0)  # RMSNorm
            # Non-persistent buffers (rotary inv_freq) were never materialised: rebuild each
            # such module's buffers from its config, on the CPU, and move them over.
            for module in model.modules():
                if hasattr(module, "inv_freq") and hasattr(module, "config"):
                    fresh = type(module)(module.config)
                    for name, buffer in fresh.named_buffers(recurse=False):
                        setattr(module, name, buffer.to(device))
                    if hasattr(fresh, "attention_scaling"):
                        module.attention_scaling = fresh.attention_scaling
    finally:
        torch.random.set_rng_state(generator_state)
    return _freeze(model)


def model_source(config: RunConfig) -> tuple[str, str]:
    """(model folder, tokenizer folder) of a run config; the model folder is "" for ``random``.

    ``tiny`` builds its folder once (model + tokenizer, saved with save_pretrained) and then
    is loaded like any other folder.
    """
    from training.model.tinymodel import STAND_IN_TOKENIZER_FILES, build_tiny_model

    cache_dir = default_cache_dir(config.model.cache_dir)
    if config.model.kind == "tiny":
        folder = str(build_tiny_model(config.model, cache_dir, config.data.corpus_files))
        return folder, config.model.tokenizer_path or folder
    if config.model.kind == "random":
        if config.model.tokenizer_path:
            return "", config.model.tokenizer_path
        return "", str(build_tiny_model(ModelSection(), cache_dir, STAND_IN_TOKENIZER_FILES))
    folder = Path(config.model.path).expanduser()
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json (not an HF model folder)"
        raise ConfigError(f"model.path {folder} {what}: point model.path at a local model folder")
    return str(folder), config.model.tokenizer_path or str(folder)


def load_model(config: RunConfig, folder: str) -> nn.Module:
    """The frozen target of a run config (``folder`` from ``model_source``)."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.model.kind == "random":
        return build_random_target(config.model, device, dtype)
    return load_target(folder, device, dtype)


def check_vocab(model: nn.Module, tokenizer: Any) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}: "
            "set model.tokenizer_path to the model's own tokenizer"
        )


def build_target(config: RunConfig) -> LoadedTarget:
    """Tokenizer + frozen target of a run config, in one call."""
    started = time.monotonic()
    folder, tok_dir = model_source(config)
    tokenizer = load_tokenizer(tok_dir)
    model = load_model(config, folder)
    check_vocab(model, tokenizer)
    return LoadedTarget(model=model, tokenizer=tokenizer, path=folder, seconds=time.monotonic() - started)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (``model.model.layers`` for Llama/Qwen families)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}: no decoder `layers` list found; unsupported architecture")
    return layers


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


@torch.no_grad()
def target_forward(model: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Hidden states [B, T, len(layer_ids) * H] of the chosen decoder layers (their outputs).

    Sequences are right-padded; the causal mask already keeps padding out of every real
    position, so no attention mask is passed (the fast causal kernel stays in use).
    """
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(index: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        decoder(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    # Same convention as ``output_hidden_states`` (DFlash's, and the eval's): the last layer's
    # entry is taken after the decoder's final norm.
    last = len(layers) - 1
    final_norm = getattr(decoder, "norm", None)
    if last in captured and final_norm is not None:
        captured[last] = final_norm(captured[last])
    return torch.cat([captured[i] for i in layer_ids], dim=-1)
