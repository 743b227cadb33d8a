"""FLOPs of the target forward, for dense Qwen3 and the Qwen3.5/3.6 hybrid (``qwen3_5``) alike.

Matmul FLOPs (2 per multiply-add), as ``torch.utils.flop_counter.FlopCounterMode`` counts them;
norms, activations, rotary and other elementwise work are not counted. Per decoder layer:

    mlp                 2 * 3 * H * I per token
    full attention      q (gated in qwen3_5: 2 * heads * hd outputs), k, v, o projections per token, and
                        QK^T + PV: 4 * heads * hd * T^2 per sequence (``causal=True`` counts half:
                        the useful work; FlopCounterMode counts the whole square)
    linear attention    in_proj_qkv (2*Kd + Vd), in_proj_z (Vd), in_proj_b and in_proj_a (value heads),
    (Gated DeltaNet)    out_proj (Vd -> H) per token; the causal depthwise conv1d: 2 * conv_dim * K per
                        token; the gated delta rule in its chunked form (chunk C = 64, padded up), per
                        value head and chunk: 6 C^2 dk + 4 C^2 dv + 6 C dk dv (K K^T, the UT transform
                        applied to k and v, Q K^T, (Q K^T) V, and the state read / read / update; what
                        flash-linear-attention's chunk kernels and transformers' torch fallback compute)

with H hidden, I MLP width, Kd = key heads * dk, Vd = value heads * dv. ``layers_run`` counts the
layers from the bottom that a forward runs (``target_forward`` stops after the deepest chosen
layer); the lm_head is not part of it. tests/training/model/test_flops.py checks every term
against FlopCounterMode on a small hybrid config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CHUNK = 64  # the gated delta rule's chunk length (fla's and transformers' default)


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layer_types: tuple[str, ...]
    gated_query: bool = False  # qwen3_5's full attention: q_proj also outputs a gate
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0

    @classmethod
    def from_config(cls, config: Any) -> TargetShape:
        """From a transformers config (a multimodal one: its ``text_config``)."""
        c = getattr(config, "text_config", None) or config
        heads = int(c.num_attention_heads)
        layers = int(c.num_hidden_layers)
        types = tuple(getattr(c, "layer_types", None) or ("full_attention",) * layers)
        hybrid = "linear_attention" in types
        return cls(
            hidden=int(c.hidden_size),
            layers=layers,
            heads=heads,
            kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            intermediate=int(c.intermediate_size),
            vocab=int(c.vocab_size),
            layer_types=types,
            gated_query=str(getattr(c, "model_type", "")).startswith("qwen3_5"),
            linear_key_heads=int(getattr(c, "linear_num_key_heads", 0)) if hybrid else 0,
            linear_value_heads=int(getattr(c, "linear_num_value_heads", 0)) if hybrid else 0,
            linear_key_dim=int(getattr(c, "linear_key_head_dim", 0)) if hybrid else 0,
            linear_value_dim=int(getattr(c, "linear_value_head_dim", 0)) if hybrid else 0,
            conv_kernel=int(getattr(c, "linear_conv_kernel_dim", 0)) if hybrid else 0,
        )

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        )


def delta_rule_flops(shape: TargetShape, batch: int, length: int, chunk: int = CHUNK) -> float:
    """The chunked gated delta rule of one linear-attention layer on ``batch`` x ``length``."""
    dk, dv, c = shape.linear_key_dim, shape.linear_value_dim, chunk
    per_chunk = 6 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv
    return float(batch * shape.linear_value_heads * math.ceil(length / c) * per_chunk)


def forward_flops(
    shape: TargetShape,
    batch: int,
    length: int,
    *,
    layers_run: int | None = None,
    causal: bool = True,
    chunk: int = CHUNK,
) -> dict[str, float]:
    """FLOPs of a decoder forward on ``batch`` sequences of ``length`` tokens, by term, plus ``total``."""
    h, tokens = shape.hidden, batch * length
    run = shape.layer_types[: shape.layers if layers_run is None else layers_run]
    full = sum(1 for t in run if t != "linear_attention")
    linear = len(run) - full
    q_out = (2 if shape.gated_query else 1) * shape.heads * shape.head_dim
    kv_out = shape.kv_heads * shape.head_dim
    full_proj = 2 * tokens * (h * q_out + 2 * h * kv_out + shape.heads * shape.head_dim * h)
    scores = 4 * batch * shape.heads * shape.head_dim * length * length * (0.5 if causal else 1.0)
    kd = shape.linear_key_heads * shape.linear_key_dim
    vd = shape.linear_value_heads * shape.linear_value_dim
    linear_proj = 2 * tokens * (h * (2 * kd + vd) + h * vd + 2 * h * shape.linear_value_heads + vd * h)
    terms = {
        "mlp": float(len(run) * 2 * tokens * 3 * h * shape.intermediate),
        "attention_projections": float(full * full_proj),
        "attention_scores": float(full * scores),
        "linear_projections": float(linear * linear_proj),
        "conv1d": float(linear * 2 * tokens * shape.conv_dim * shape.conv_kernel),
        "delta_rule": linear * delta_rule_flops(shape, batch, length, chunk),
    }
    terms["total"] = sum(terms.values())
    return terms


__all__ = ["CHUNK", "TargetShape", "delta_rule_flops", "forward_flops"]
