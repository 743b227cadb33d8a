"""The frozen target model: loading, and the hidden states the drafter is trained on.

``load_target(path, device, dtype)`` loads any local Hugging Face causal-LM folder
(``local_files_only``), frozen and in eval mode. ``build_random_target`` builds one with
random weights straight on the device from a config (meta init, then ``to_empty`` and
``init_weights``), so a Qwen3-8B shape needs no 16 GB download or save. ``target_forward``
runs the decoder (not the lm_head: no [tokens x vocab] logits) and returns the outputs of the
chosen decoder layers, captured with forward hooks, concatenated on the feature axis.

``compile_target(model)`` makes ``target_forward`` run every decoder layer through one
``torch.compile``d function (``dynamic=False``: one graph per bucket shape, shared by all layers,
whose weights are graph inputs), fusing the RMSNorms, the rotary embedding, SiLU x up and the
casts around the matmuls (a third of the uncompiled forward's GPU time). Only ``target_forward``
uses it: other callers of the model (the acceptance eval, with a new length every round) stay
eager. A target with linear-attention layers (``qwen3_5``) is not compiled: its fast path is
flash-linear-attention's own Triton kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.config import ConfigError, ModelSection, RunConfig
from training.contract import HF_CONFIG_FILE
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
    if not (folder / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"model folder {folder} has no {HF_CONFIG_FILE}: not a Hugging Face model folder")
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
    """A causal LM of ``model_cfg``'s shape and architecture with random weights, built directly on
    ``device``: on the meta device first, then materialised there and initialised by transformers'
    own ``init_weights`` (the per-architecture rules: rotary buffers, the Gated DeltaNet ``A_log`` /
    ``dt_bias``, the ``1 + weight`` norms), seeded by ``model.seed``."""
    from transformers import AutoModelForCausalLM

    from training.model.tinymodel import target_text_config

    config = target_text_config(model_cfg, model_cfg.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    generator_states = _rng_states(device)
    torch.manual_seed(model_cfg.seed)
    try:
        with torch.no_grad():
            model.init_weights()
    finally:
        _restore_rng(generator_states, device)
    return _freeze(model)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.random.get_rng_state(), cuda


def _restore_rng(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.random.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def model_source(config: RunConfig) -> tuple[str, str]:
    """(model folder, tokenizer folder) of a run config; the model folder is "" for ``random``.

    ``tiny`` builds its folder once (model + tokenizer, saved with save_pretrained) and then
    is loaded like any other folder; ``smol`` converts its GGUF once into such a folder.
    """
    from training.model.tinymodel import STAND_IN_TOKENIZER_FILES, build_tiny_model

    cache_dir = default_cache_dir(config.model.cache_dir)
    if config.model.kind == "smol":
        from training.model.smol import build_smol_model

        folder = str(build_smol_model(cache_dir))
        return folder, config.model.tokenizer_path or folder
    if config.model.kind == "tiny":
        folder = str(build_tiny_model(config.model, cache_dir, config.data.corpus_files))
        return folder, config.model.tokenizer_path or folder
    if config.model.kind == "random":
        if config.model.tokenizer_path:
            return "", config.model.tokenizer_path
        return "", str(build_tiny_model(ModelSection(), cache_dir, STAND_IN_TOKENIZER_FILES))
    folder = Path(config.model.path).expanduser()
    if not (folder / HF_CONFIG_FILE).is_file():
        what = (
            "does not exist" if not folder.exists() else f"has no {HF_CONFIG_FILE} (not an HF model folder)"
        )
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


def text_config(model: nn.Module) -> Any:
    """The text model's config (a multimodal config nests it under ``text_config``)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def layer_types(model: nn.Module) -> list[str]:
    """Each decoder layer's mixer: ``full_attention``, ``linear_attention`` (Gated DeltaNet in
    ``qwen3_5``), ``sliding_attention``; a config without ``layer_types`` is all full attention."""
    types = getattr(text_config(model), "layer_types", None)
    return list(types) if types else ["full_attention"] * num_layers(model)


def describe_layers(model: nn.Module, layer_ids: Sequence[int]) -> str:
    """``[1 linear, 16 linear, 31 full, ...]``: the chosen layers and their mixers (start-up line)."""
    types = layer_types(model)
    return "[" + ", ".join(f"{i} {types[i].removesuffix('_attention')}" for i in layer_ids) + "]"


# Which layers a hybrid target gives the drafter. DFlash takes ``n`` layer outputs spread evenly
# over the depth (``training.model.drafter.select_target_layers``), whatever each layer's mixer is;
# the reference Qwen3.6-27B drafter (SpecForge ``configs/qwen3.6-27b-dflash.json``,
# ``target_layer_ids`` [1, 16, 31, 46, 61] of 64) is exactly that formula, although with the
# interval-4 layout it picks four Gated DeltaNet layers and one full-attention layer (31). What
# is read is the residual stream after a whole decoder layer (mixer + MLP), which is the same
# kind of feature after either mixer, and it is what SGLang and vLLM capture at serving time; so
# the formula is used unchanged and no layer type is preferred.


_COMPILED_LAYER = "_fleet_compiled_layer"  # the model attribute holding the compiled layer call


def _layer_call(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """One decoder layer's forward (its class's, so the compiled code is one for every layer)."""
    return type(layer).forward(layer, *args, **kwargs)


def can_compile(model: nn.Module) -> bool:
    """Whether ``compile_target`` applies: no linear-attention layers (those run their own kernels)."""
    return "linear_attention" not in layer_types(model)


def compile_target(model: nn.Module, *, mode: str = "default") -> bool:
    """Make ``target_forward`` run ``model``'s decoder layers compiled (module docstring); False
    (nothing changed) for a model ``can_compile`` refuses. Compiles lazily, at the first call of
    each shape, under the compile cache activated by then (``training.compile.cache``)."""
    if not can_compile(model):
        return False
    compiled = torch.compile(_layer_call, dynamic=False, mode=None if mode == "default" else mode)
    setattr(model, _COMPILED_LAYER, compiled)
    return True


def is_compiled(model: nn.Module) -> bool:
    return getattr(model, _COMPILED_LAYER, None) is not None


class _Captured(Exception):
    """Raised by the hook of the deepest chosen layer: the layers after it are not needed."""


@torch.no_grad()
def target_forward(model: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Hidden states [B, T, len(layer_ids) * H] of the chosen decoder layers (their outputs).

    Forward hooks keep only the chosen layers' outputs (not every layer's, as
    ``output_hidden_states`` would), and the forward stops after the deepest chosen layer: with
    DFlash's ids (up to L-3) the last layers, the final norm and the lm_head never run.
    Sequences are right-padded; the causal mask (and, in linear-attention layers, the causal
    recurrence) already keeps padding out of every real position, so no attention mask is passed
    (the fast causal kernels stay in use).
    """
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
    last = len(layers) - 1
    deepest = max(layer_ids)

    def hook_for(index: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest and index != last:
                raise _Captured

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    compiled: Callable[..., Any] | None = getattr(model, _COMPILED_LAYER, None)
    swapped = list(layers)[: deepest + 1] if compiled is not None else []
    for layer in swapped:  # for this call only; the hooks stay eager around the compiled body
        layer.forward = functools.partial(compiled, layer)
    try:
        decoder(input_ids=input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
        for layer in swapped:
            del layer.forward
    # Same convention as ``output_hidden_states`` (DFlash's, and the eval's): the last layer's
    # entry is taken after the decoder's final norm.
    final_norm = getattr(decoder, "norm", None)
    if last in captured and final_norm is not None:
        captured[last] = final_norm(captured[last])
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


class HiddenCache:
    """Each training sequence's target hidden states, computed once and reused (``target.cache_hidden``).

    SpecForge's offline mode computes the target's hidden states of the whole data set once and
    trains on the stored features; here they are kept in memory (on the CPU) the first time a
    sequence is in a batch, so the first epoch runs the target and every later one does not. A
    sequence's hidden states depend on its own tokens only (causal attention, right padding:
    ``target_forward``), so a row keyed by its tokens gets the same features in any batch; the
    padding positions, which no anchor, label or context reads, are zeros.
    """

    def __init__(self) -> None:
        self.rows: dict[bytes, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def forward(
        self, model: nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: Sequence[int]
    ) -> torch.Tensor:
        """``target_forward`` of the batch, the target run only when a row was not seen before."""
        keys = [input_ids[r, : int(n)].cpu().numpy().tobytes() for r, n in enumerate(lengths.tolist())]
        missing = [r for r, key in enumerate(keys) if key not in self.rows]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        fresh = None
        if missing:
            # The whole batch, at its bucket's shape: a compiled target forward is compiled for
            # those shapes alone, and a narrower or shorter batch of the missing rows would
            # recompile it at every new width (the run then stops at its recompile limit). In the
            # first epoch every row is missing anyway; later, none is.
            fresh = target_forward(model, input_ids, layer_ids)
            for r in missing:
                self.rows[keys[r]] = fresh[r, : int(lengths[r])].to("cpu", copy=True)
        features = next(iter(self.rows.values())).shape[-1]
        out = torch.zeros(
            (*input_ids.shape, features), dtype=self.rows[keys[0]].dtype, device=input_ids.device
        )
        for r, key in enumerate(keys):
            n = int(lengths[r])
            # a row just computed is already on the device: no copy back from the CPU
            out[r, :n] = fresh[r, :n] if fresh is not None and r in missing else self.rows[key].to(out.device)
        return out
