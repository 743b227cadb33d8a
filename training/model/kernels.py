"""The linear-attention fast path of a hybrid target: which implementation each function runs.

transformers' ``qwen3_5`` (Qwen3.5 / Qwen3.6) Gated DeltaNet layers call three functions that
have a fast implementation outside transformers and a pure-torch fallback inside it:

    delta_rule   chunk_gated_delta_rule   flash-linear-attention (PyPI fla-core, import ``fla``), Triton
    conv1d       causal_conv1d_fn         causal-conv1d (a CUDA extension)
    gated_norm   the gated RMSNorm        fla's ``FusedRMSNormGated`` (transformers 5.8 only)

transformers chooses per function, once, when ``modeling_qwen3_5`` is imported:

- 5.8: ``chunk_gated_delta_rule``, ``causal_conv1d_fn`` and ``FusedRMSNormGated`` are module
  globals, ``None`` unless ``is_flash_linear_attention_available()`` / ``is_causal_conv1d_available()``
  (both need CUDA); each layer keeps ``self.chunk_gated_delta_rule = chunk_gated_delta_rule or
  torch_chunk_gated_delta_rule``, ``self.causal_conv1d_fn`` (``None`` = ``F.conv1d``) and a
  ``self.norm`` of either class.
- 5.17 and later: ``@use_kernel_func_from_hub_with_fallback(name, package)`` wraps each torch
  function; at import it tries ``importlib.import_module(package)`` and keeps what it found in the
  wrapper's closure (``implementation``), the torch function when the import fails. The gated norm
  is transformers' own ``Qwen3_5RMSNormGated`` (only hub kernels replace it).

``linear_attention_kernels`` reads that choice off the loaded model (the layer's attributes and
the wrapper's closure), never from log text, so what it reports is what the forward runs. The
delta rule is the function that matters (the measured 1.48x on one H200: 1.82 s vs 2.69 s for a
4 x 4096 forward of the 27B shape, with only fla installed); ``causal-conv1d`` has no wheel on
PyPI (an sdist that compiles against the local CUDA toolkit or fetches a prebuilt wheel from
GitHub at install time), so ``envs/train`` pins fla alone and conv1d stays on ``F.conv1d``.
``target.require_fast_path`` therefore requires the delta rule only.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

# The packages transformers takes the fast implementations from (import names).
KERNEL_PACKAGES = ("fla", "causal_conv1d")
FUNCTIONS = ("delta_rule", "conv1d", "gated_norm")
REQUIRED = ("delta_rule",)
TORCH = "torch"


@dataclass(frozen=True)
class TargetKernels:
    """What a loaded target's linear-attention layers run, per function (empty: none of them)."""

    model_type: str
    linear_layers: int  # Gated DeltaNet layers (0: not a hybrid target)
    kernels: Mapping[str, str] = field(default_factory=dict)  # function -> "fla" | "causal_conv1d" | "torch"

    @property
    def hybrid(self) -> bool:
        return self.linear_layers > 0

    @property
    def fast_path(self) -> str:
        """``yes`` when every required function runs a kernel, ``no`` when one runs on torch,
        ``n/a`` for a target without linear attention."""
        if not self.hybrid:
            return "n/a"
        return "yes" if all(self.kernels.get(f, TORCH) != TORCH for f in REQUIRED) else "no"

    def summary(self) -> str:
        """``delta_rule fla, conv1d torch, gated_norm torch``."""
        return ", ".join(f"{name} {self.kernels.get(name, '?')}" for name in FUNCTIONS)

    def line(self) -> str:
        """The start-up line."""
        if not self.hybrid:
            return f"target kernels: {self.model_type} has no linear-attention layers (fast path n/a)"
        return (
            f"target kernels: {self.linear_layers} linear-attention layers, fast path {self.fast_path} "
            f"({self.summary()})"
        )


def _layer_module(layer: nn.Module) -> Any:
    return sys.modules.get(type(layer).__module__)


def _fallback_choice(fn: Any) -> Any:
    """What transformers' fallback wrapper calls: the ``implementation`` in its closure (5.17+);
    anything else is returned as it is."""
    current = fn
    for _ in range(4):  # wrappers of wrappers (functools.wraps keeps __wrapped__)
        try:
            nonlocals = inspect.getclosurevars(current).nonlocals
        except TypeError:  # a class, a builtin, a C function: not a wrapper
            break
        if "implementation" in nonlocals and "torch_function" in nonlocals:
            return nonlocals["implementation"]
        current = getattr(current, "__wrapped__", None)
        if current is None:
            break
    return fn


def source_of(fn: Any) -> str:
    """The package an implementation comes from: ``fla``, ``causal_conv1d``, ``torch`` (transformers'
    own reference code, or ``None``: the layer then calls ``F.conv1d``), or another top-level name."""
    if fn is None:
        return TORCH
    chosen = _fallback_choice(fn)
    module = getattr(chosen, "__module__", None) or type(chosen).__module__
    top = str(module).split(".", 1)[0]
    return TORCH if top in ("transformers", "torch") else top


def _function(layer: nn.Module, attribute: str, global_name: str) -> Any:
    """The layer's own reference (5.8) if it has one, else the modeling module's global (5.17+)."""
    if hasattr(layer, attribute):
        return getattr(layer, attribute)
    return getattr(_layer_module(layer), global_name, None)


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet mixers of a model (``qwen3_5``'s ``linear_attn``), in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def linear_attention_kernels(model: nn.Module) -> TargetKernels:
    """Which implementation each linear-attention function of ``model`` runs (module docstring)."""
    config = getattr(model.config, "text_config", None) or model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    layers = linear_attention_layers(model)
    if not layers:
        return TargetKernels(model_type, 0)
    layer = layers[0]
    delta = _function(layer, "chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")
    conv = _function(layer, "causal_conv1d_fn", "causal_conv1d_fn")
    norm = getattr(layer, "norm", None)
    kernels = {
        "delta_rule": source_of(delta) if delta is not None else "unknown",
        "conv1d": source_of(conv),
        "gated_norm": source_of(type(norm)) if norm is not None else "unknown",
    }
    return TargetKernels(model_type, len(layers), kernels)


def import_problem(package: str = "fla", module: str = "fla.ops.gated_delta_rule") -> str:
    """Why ``module`` cannot be imported here ("" when it can): the reason the fallback is taken."""
    if sys.modules.get(package, False) is None:
        return f"{package} is hidden in this process (hide_kernels)"
    try:
        importlib.import_module(module)
    except Exception as exc:  # what transformers' own import would have swallowed
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
    return ""


def hide_kernels(packages: tuple[str, ...] = KERNEL_PACKAGES) -> None:
    """Make the kernel packages unimportable in this process, so transformers takes its torch
    fallback (the fallback side of a measurement). ``sys.modules[name] = None`` makes both
    ``import name`` and ``importlib.util.find_spec(name)`` (transformers 5.8's availability check)
    fail. Must run before ``modeling_qwen3_5`` is imported: its choice is made once, then."""
    loaded = "transformers.models.qwen3_5.modeling_qwen3_5"
    if loaded in sys.modules:
        raise RuntimeError(f"hide_kernels: {loaded} is already imported; call hide_kernels first")
    for name in packages:
        sys.modules[name] = None  # type: ignore[assignment]


def autotune_results(triton_dir: str | os.PathLike[str] | None) -> int:
    """Triton autotune results saved under ``triton_dir`` (``*.autotune.json``; fla asks Triton to
    keep them on disk, ``cache_results``): 0 means the first hybrid forward will autotune."""
    if not triton_dir:
        return 0
    root = Path(triton_dir)
    if not root.is_dir():
        return 0
    return sum(1 for _ in root.rglob("*.autotune.json"))


def require_fast_path(kernels: TargetKernels, *, device_type: str, required: bool, who: str) -> None:
    """Stop (``ConfigError``, one line) when ``required``, on a GPU, a hybrid target's delta rule
    runs on the torch fallback. CPU runs have no kernels to require (fla's are Triton GPU code)."""
    from training.config import ConfigError

    if not required or device_type != "cuda" or kernels.fast_path != "no":
        return
    reason = import_problem() or "transformers did not take it"
    raise ConfigError(
        f"{who}: the gated delta rule of this hybrid target ({kernels.model_type}) runs on transformers' "
        f"torch fallback, ~1.5x slower ({reason}); use an env with fla-core (envs/train pins it) or set "
        "--target.require_fast_path=false"
    )


__all__ = [
    "FUNCTIONS",
    "KERNEL_PACKAGES",
    "REQUIRED",
    "TargetKernels",
    "autotune_results",
    "hide_kernels",
    "import_problem",
    "linear_attention_kernels",
    "linear_attention_layers",
    "require_fast_path",
    "source_of",
]
