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

The drafter's training step (``drafter_step_flops``): forward + backward of
``training.model.drafter.DFlashDrafter`` on one batch of ``rows`` rows padded to ``T``, with
``K`` anchors per row (the width; padded anchors' blocks run too) and block size ``bs``, so
``Q = rows * K * bs`` query tokens. A trained matmul costs 3x its forward (forward, input
gradient, weight gradient); what the drafter does not need is left out:

    fc                  2 * (2 * rows*T * nH * H): its input (the target's hidden states) needs no
                        gradient, so forward + weight gradient only
    q, o projections    3 * 2 * Q * H * heads*hd each, on the block tokens
    k, v projections    3 * 2 * (rows*T + Q) * H * kv_heads*hd each: every layer projects the whole
                        context (T tokens per row) and the block tokens
    mlp                 3 * 2 * Q * 3 * H * I
    attention           3 * 4 * heads*hd * (visible (query, key) pairs): in a full layer each of
                        an anchor ``a``'s bs queries sees the ``a`` context tokens before it and
                        its whole block (bs keys); in a sliding layer of window W block offset i
                        sees min(a, W - 1 - i) context keys and its block causally (i + 1 keys)
                        (training/model/attention.py); a padded anchor sees no context. Backward =
                        2x forward (dQ, dK, dV, dP), as FlopCounterMode counts attention
    lm_head             2 * (2 * H * V) per *labelled* block position: the head is frozen, so its
                        backward is the input gradient only, and it runs on the labelled positions
                        only (offset 0 and positions past the row's end or without loss are dropped
                        before it, training/model/loss.py)

Not counted (not useful work): the masked-out pairs flex still computes inside partly visible
tiles, norms, rotary, softmax, cross-entropy and the optimizer. ``AnchorStats`` carries what the
anchors decide (visible context keys per window, labelled positions): exactly from a batch's tensors
(``AnchorStats.from_tensors``) or as the expectation of ``sample_anchors``' uniform draw
(``AnchorStats.expected``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
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


# ------------------------------------------------------------------ the drafter step
@dataclass(frozen=True)
class DrafterShape:
    """The dimensions the drafter step's FLOPs depend on (the drafter runs at the target's
    hidden size and head layout; ``windows``: one per layer, None = full attention)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers: int  # n: the fused target layers (fc input = n * hidden)
    block_size: int
    windows: tuple[int | None, ...]

    @classmethod
    def from_configs(cls, target_config: Any, drafter: Any, target_layers: int) -> DrafterShape:
        """From a transformers config and anything with the drafter's ``num_layers``,
        ``block_size``, ``sliding_window`` and ``full_attention_layers`` (DrafterConfig or the run
        config's [drafter] section); ``target_layers``: how many target layers it fuses."""
        from training.model.drafter import drafter_layout

        t = TargetShape.from_config(target_config)
        full = set(drafter.full_attention_layers)
        windows = tuple(None if i in full else int(drafter.sliding_window) for i in range(drafter.num_layers))
        # The drafter's own head layout and MLP width where its config sets them (the target's where 0).
        own = drafter_layout(target_config, drafter if hasattr(drafter, "num_attention_heads") else None)
        return cls(
            hidden=t.hidden,
            heads=own["num_attention_heads"],
            kv_heads=own["num_key_value_heads"],
            head_dim=own["head_dim"],
            intermediate=own["intermediate_size"],
            vocab=t.vocab,
            target_layers=int(target_layers),
            block_size=int(drafter.block_size),
            windows=windows,
        )


def _visible(anchor: int, window: int | None, block_size: int) -> int:
    """(query, context key) pairs of one anchor's block (``training.model.attention``'s rule):
    a full layer's block sees the ``anchor`` tokens before it from every offset; a sliding one's
    offset i sees the context tokens inside its own window of ``window`` tokens ending at a + i."""
    if window is None:
        return block_size * anchor
    return sum(max(0, min(anchor, window - 1 - i)) for i in range(block_size))


@dataclass(frozen=True)
class AnchorStats:
    """What a batch's anchors decide for the drafter step's FLOPs.

    ``context_keys[w]``: the visible (block query, context key) pairs summed over the batch's
    anchors under window ``w`` (None = full); ``labelled``: block positions with a label (the
    lm_head's rows)."""

    rows: int
    per_row: int  # K, the anchors tensor's width (padded anchors included: their blocks run)
    context_keys: Mapping[int | None, float]
    labelled: float

    @classmethod
    def from_tensors(cls, anchors: Any, label_mask: Any, windows: Iterable[int | None]) -> AnchorStats:
        """Exact, from a batch's anchors [rows, K] (-1 padded) and its block label mask
        [rows, K*bs] (``training.model.drafter.block_labels``; offset 0 is never labelled)."""
        rows, per_row = (int(n) for n in anchors.shape)
        bs = int(label_mask.shape[-1]) // max(per_row, 1)
        real = [int(a) for a in anchors.reshape(-1).tolist() if int(a) >= 0]
        keys = {w: float(sum(_visible(a, w, bs) for a in real)) for w in set(windows)}
        return cls(rows, per_row, keys, float(label_mask.sum()))

    @classmethod
    def expected(
        cls, rows: int, length: float, per_row: int, block_size: int, windows: Iterable[int | None]
    ) -> AnchorStats:
        """The expectation under ``sample_anchors`` for rows of ``length`` real tokens whose every
        token has loss: each row draws min(K, length - 1) distinct anchors uniformly from the
        eligible positions 0 .. length-2; anchor ``a`` has min(bs - 1, length - 1 - a) labels.
        A fractional ``length`` (a batch's mean) is rounded down."""
        n = max(int(length) - 1, 0)  # eligible positions: a + 1 < length
        real = min(int(per_row), n)
        c = block_size - 1

        def mean_min(w: int | None) -> float:  # E[min(a, w)] for a uniform on 0 .. n-1
            if n == 0:
                return 0.0
            if w is None or w >= n - 1:
                return (n - 1) / 2
            return (w * (w - 1) / 2 + (n - w) * w) / n

        def mean_visible(w: int | None) -> float:  # E[_visible(a, w, block_size)]
            if w is None:
                return block_size * mean_min(None)
            return sum(mean_min(max(0, w - 1 - i)) for i in range(block_size))

        labels = (n * (n + 1) / 2 if n <= c else c * (c + 1) / 2 + (n - c) * c) / n if n else 0.0
        keys = {w: rows * real * mean_visible(w) for w in set(windows)}
        return cls(int(rows), int(per_row), keys, rows * real * labels)


def drafter_step_flops(
    shape: DrafterShape, context_len: int, anchors: AnchorStats, *, dense_attention: bool = False
) -> dict[str, float]:
    """FLOPs of one drafter training step (forward + backward), by term, plus ``total`` and
    ``forward`` (the forward's share of ``total``). ``context_len``: T, the padded length the
    context runs at. ``dense_attention``: count every (query, key) pair of the [Q x (T + K*bs)]
    square instead of the visible ones (what a dense masked attention computes; for tests)."""
    h, bs = shape.hidden, shape.block_size
    rows, queries = anchors.rows, anchors.rows * anchors.per_row * bs
    context = rows * int(context_len)
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layers = len(shape.windows)
    if dense_attention:
        pairs = layers * queries * (int(context_len) + anchors.per_row * bs)
    else:
        # Each block sees itself: both ways in a full layer, causally in a sliding one.
        own = {None: queries * bs, **{w: queries * (bs + 1) / 2 for w in shape.windows if w is not None}}
        pairs = sum(anchors.context_keys[w] + own[w] for w in shape.windows)
    forward = {
        "fc": 2.0 * context * shape.target_layers * h * h,
        "attention_projections": layers
        * 2.0
        * (2 * queries * h * q_out + 2 * (context + queries) * h * kv_out),
        "mlp": layers * 2.0 * queries * 3 * h * shape.intermediate,
        "attention_scores": 4.0 * shape.heads * shape.head_dim * pairs,
        "lm_head": 2.0 * h * shape.vocab * anchors.labelled,
    }
    passes = {"fc": 2, "attention_projections": 3, "mlp": 3, "attention_scores": 3, "lm_head": 2}
    terms = {name: passes[name] * value for name, value in forward.items()}
    terms["total"] = sum(terms.values())
    terms["forward"] = sum(forward.values())
    return terms


H200_BF16_DENSE_PEAK = 989e12  # NVIDIA's H200 SXM spec sheet: 989 TFLOP/s bf16 dense (1979 with sparsity)

__all__ = [
    "CHUNK",
    "H200_BF16_DENSE_PEAK",
    "AnchorStats",
    "DrafterShape",
    "TargetShape",
    "delta_rule_flops",
    "drafter_step_flops",
    "forward_flops",
]
