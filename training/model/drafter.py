"""The DFlash drafter: a few Qwen3-style decoder blocks that draft a whole block at once.

Interface (the contract with the trainer; keep it):

    DrafterConfig                      frozen; see the fields below
    select_target_layers(L, n=5)       which target layers feed the drafter (DFlash's rule)
    target_context(hidden_states, ids) concat the chosen layers' hidden states -> [B, T, n*H]
    DFlashDrafter(cfg, target_config, embed_tokens, lm_head)
      .forward(input_ids, target_hidden, loss_mask, anchors) -> DraftOutput
      .propose(target_hidden, last_token) -> LongTensor [N, B-1]   (greedy block, for eval)
      .propose_logits(target_hidden, last_token) -> [N, B-1, V]    (propose = its argmax)
      .draft_hidden(target_hidden, first_tokens, anchors) -> [N, K, B-1, H]  (eval, any anchors)
    sample_anchors(loss_mask, lengths, num_anchors, generator) -> LongTensor [B, K]
      K = min(num_anchors, T - 1): the same number of anchors in every row of every bucket
    block_labels(input_ids, loss_mask, anchors, block_size) -> (labels, label_mask)  [B, K*bs]
    DFlashDrafter.block_hidden(input_ids, target_hidden, anchors) -> [B, K*bs, H]
    DFlashDrafter.variants() -> the attention windows in use (None = full)
    DFlashDrafter.graphs_per_shape() -> pass it to attention.configure_compile(num_buckets, n)

Beyond that interface: DrafterConfig also has
``num_target_layers`` / ``target_layer_ids`` (which target layers; () = DFlash's rule),
``flex_tile`` and ``attention_backend`` ("auto" = flex on CUDA, blockwise on CPU: torch
2.13 has no flex backward on CPU); DraftOutput also has ``correct_per_offset`` and
``count_per_offset`` (to aggregate accuracy over steps or ranks). ``mask_token_id`` is the
reserved token whose frozen target embedding fills the block (``resolve_mask_token_id``).

Model. ``target_hidden`` [B, T, n*H] (the n chosen target layers, concatenated on the
feature axis, see ``target_context``) -> Linear(n*H -> H, no bias) -> RMSNorm = the fused
context. Each anchor ``a`` gets a block ``[x_a, MASK x (B-1)]``, all of it embedded with the
target's frozen embedding: MASK is the token ``cfg.mask_token_id``, not a learned vector.
This is the reference scheme (z-lab/dflash ``dflash/model.py``: ``dflash_generate`` fills the
block with ``model.mask_token_id`` and embeds it with the target's input embeddings; SpecForge
``specforge/algorithms/common/dflash_family_model.py``: ``_create_noise_embed``), and the
serving engines load no MASK weight (SGLang ``python/sglang/srt/models/dflash.py`` ignores
unknown weights; vLLM ``vllm/model_executor/models/qwen3_dflash.py`` embeds
``dflash_config.mask_token_id`` through the target's table), so a learned vector would not
leave the trainer. The blocks pass N decoder layers (RMSNorm, GQA attention with per-head q/k
RMSNorm and RoPE as in Qwen3, SwiGLU MLP, pre-norm residuals) at the target's hidden size with
``drafter_layout``'s heads and MLP width. Each layer's queries come from the block tokens; its
keys/values from [fused context ; block tokens] through the layer's own k/v projections (the
context is not updated across layers). Visibility: ``training/model/attention.py``. RoPE
positions: context ``j`` -> ``j``; block offset ``i`` of anchor ``a`` -> ``a + i``. A final
RMSNorm, then the target's frozen lm_head; offset ``i >= 1`` predicts the token at ``a + i``
(loss: ``training/model/loss.py``).

Layers listed in ``cfg.full_attention_layers`` see all context before the anchor and their
whole block both ways; the others are sliding layers: a per-token window of
``cfg.sliding_window`` tokens, causal inside the block (the rule and its sources:
``training/model/attention.py``). ``layer_types()`` names them as the exported config does.

The shared ``embed_tokens`` and ``lm_head`` are held by reference, NOT registered as
submodules: they are not in ``parameters()`` / ``state_dict()`` (checkpoints hold only the
drafter's own weights) and ``.to()`` does not move them. Pass them on the drafter's device
(in a split topology: copies of the target's on the drafter GPU). They stay frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.config import DrafterSection
from training.model import attention
from training.model.loss import block_loss

_RUN = DrafterSection()  # the run config's defaults: one default per value


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter hyper-parameters (DFlash defaults). The fields the run config's [drafter] section
    has take their defaults from it (``training.config.DrafterSection``)."""

    num_layers: int = _RUN.num_layers
    block_size: int = _RUN.block_size
    num_anchors: int = _RUN.num_anchors
    sliding_window: int = _RUN.sliding_window  # tokens of context before the anchor (sliding layers)
    full_attention_layers: tuple[int, ...] = _RUN.full_attention_layers  # the others slide
    gamma: float = _RUN.gamma  # loss weight exp(-(k-1)/gamma) for block offset k
    loss_chunk_size: int = _RUN.loss_chunk_size  # positions per lm_head+CE chunk
    label_smoothing: float = _RUN.label_smoothing  # eps of the block CE (training.model.loss)
    rms_norm_eps: float = 1e-6
    rope_theta: float = _RUN.rope_theta
    num_target_layers: int = _RUN.num_target_layers  # n target hidden states fused (no target_layer_ids)
    target_layer_ids: tuple[int, ...] = _RUN.target_layer_ids  # explicit layers; () = select_target_layers
    flex_tile: int = 128  # flex BlockMask tile (sparsity granularity)
    attention_backend: str = "auto"  # auto (flex on CUDA, blockwise on CPU) | flex | blockwise | dense
    # The reserved token whose target embedding is MASK; -1 = not resolved yet (the trainer
    # resolves it with resolve_mask_token_id before building the drafter).
    mask_token_id: int = _RUN.mask_token_id
    # The drafter's head layout and MLP width (0 = the target's; see drafter_layout).
    num_attention_heads: int = _RUN.num_attention_heads
    num_key_value_heads: int = _RUN.num_key_value_heads
    head_dim: int = _RUN.head_dim
    intermediate_size: int = _RUN.intermediate_size

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers={self.num_layers} must be >= 1")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size={self.block_size} must be >= 2")
        if self.num_anchors < 1 or self.sliding_window < 1 or self.loss_chunk_size < 1:
            raise ValueError("drafter.num_anchors, sliding_window and loss_chunk_size must be >= 1")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"drafter.full_attention_layers={list(self.full_attention_layers)}: "
                f"indexes must be in [0, {self.num_layers})"
            )
        if self.attention_backend not in attention.BACKENDS:
            raise ValueError(
                f"drafter.attention_backend={self.attention_backend!r}: expected one of "
                f"{', '.join(attention.BACKENDS)}"
            )
        if self.gamma <= 0:
            raise ValueError(f"drafter.gamma={self.gamma} must be > 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"drafter.label_smoothing={self.label_smoothing} must be in [0, 1)")
        sliding = len(set(self.full_attention_layers)) < self.num_layers
        if sliding and self.sliding_window < self.block_size:
            raise ValueError(
                f"drafter.sliding_window={self.sliding_window} must be >= drafter.block_size="
                f"{self.block_size}: the window counts the block's own tokens"
            )

    def layer_types(self) -> list[str]:
        """Per layer ``full_attention`` or ``sliding_attention`` (the exported ``layer_types``)."""
        return [
            "full_attention" if i in self.full_attention_layers else "sliding_attention"
            for i in range(self.num_layers)
        ]

    def resolved_target_layers(self, num_hidden_layers: int) -> list[int]:
        """The target layer ids this drafter reads from a target with ``num_hidden_layers``."""
        if self.target_layer_ids:
            bad = [i for i in self.target_layer_ids if not 0 <= i < num_hidden_layers]
            if bad:
                raise ValueError(
                    f"drafter.target_layer_ids={list(self.target_layer_ids)}: the target has "
                    f"{num_hidden_layers} layers (ids 0..{num_hidden_layers - 1})"
                )
            return list(self.target_layer_ids)
        return select_target_layers(num_hidden_layers, self.num_target_layers)


@dataclass(frozen=True)
class DraftOutput:
    """One training forward: loss and the accuracy/acceptance it implies."""

    loss: Tensor  # scalar, differentiable
    acc_per_offset: Tensor  # [B-1] float, offsets 1..B-1
    tau_estimate: float  # 1 + mean accepted length per block (loss.accept_lengths)
    num_tokens: int  # labelled positions in the loss
    correct_per_offset: Tensor  # [B-1] long (sum across steps/ranks, then divide by count)
    count_per_offset: Tensor  # [B-1] long


def select_target_layers(num_hidden_layers: int, n: int = _RUN.num_target_layers) -> list[int]:
    """DFlash's rule: ``n`` layer ids spread evenly over the target's depth.

    ``round(1 + i * (L - 4) / (n - 1))`` for i = 0..n-1: from layer 1 to layer L-3 (the
    first layer is skipped as too shallow, the last few as too specialised to the
    next-token head). Qwen3-8B (36 layers): [1, 9, 17, 25, 33]. n = 1: [L // 2]. A target
    shallower than that span (L < 5 or fewer distinct ids than n) spreads over 0..L-1
    instead, repeating ids when L < n. Layer id ``i`` means the output of decoder layer
    ``i``, i.e. ``hidden_states[i + 1]`` of ``output_hidden_states=True``.
    """
    if num_hidden_layers < 1 or n < 1:
        raise ValueError(
            f"select_target_layers: num_hidden_layers={num_hidden_layers} and n={n} must be >= 1"
        )
    if n == 1:
        return [num_hidden_layers // 2]
    start, end = 1, num_hidden_layers - 3
    if end - start >= n - 1:
        return [round(start + i * (end - start) / (n - 1)) for i in range(n)]
    last = num_hidden_layers - 1
    return [round(i * last / (n - 1)) for i in range(n)]


def target_context(hidden_states: Sequence[Tensor], layer_ids: Sequence[int]) -> Tensor:
    """Concatenate the chosen layers' outputs: ``hidden_states`` as returned by a HF model with
    ``output_hidden_states=True`` (embeddings first) -> [B, T, n*H]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _text_config(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [B, L, head_dim] for integer positions [B, L] (Qwen3 / rotate-half layout)."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, D]; cos/sin [B, L, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


Attend = attention.Attend


def _autocast_copy(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype of its device when autocast is on there (what autocast hands
    a matmul), else ``x``: cast once, used by several matmuls."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x
    return x.to(torch.get_autocast_dtype(kind))


class DrafterAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, n, self.head_dim)

    def project(
        self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, Hq, Q, D], k and v [B, Hkv, T+Q, D] of the block input ``x`` over [context ; block]."""
        # Keys/values of [context ; block]: projected apart and joined after the projection (KV
        # width, not the hidden width: no [B, T+Q, H] concatenation), from one autocast copy of
        # the block's input (autocast would cast it once per projection); ``ctx`` comes cast once
        # for all layers (``_blocks``).
        x = _autocast_copy(x)
        q = self.q_norm(self._heads(self.q_proj(x), self.heads)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1)
        k = self.k_norm(self._heads(k, self.kv_heads)).transpose(1, 2)
        v = self._heads(v, self.kv_heads).transpose(1, 2)
        return _apply_rope(q, *rope_q), _apply_rope(k, *rope_kv), v

    def output(self, out: Tensor) -> Tensor:
        """The attention output [B, Hq, Q, D] -> [B, Q, hidden]."""
        b, _, q_len, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = _autocast_copy(x)  # one cast for both projections (autocast would cast it for each)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DrafterAttention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = DrafterMLP(hidden, inter)

    def attention_inputs(
        self, h: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Everything before the attention kernel: pre-norm, projections, q/k norms, RoPE."""
        return self.self_attn.project(self.input_layernorm(h), ctx, rope_q, rope_kv)

    def finish(self, h: Tensor, out: Tensor) -> Tensor:
        """Everything after it: output projection, residual, post-norm, MLP, residual."""
        h = h + self.self_attn.output(out)
        return h + self.mlp(self.post_attention_layernorm(h))


def _layer_inputs(
    layer: DrafterLayer, h: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    return DrafterLayer.attention_inputs(layer, h, ctx, rope_q, rope_kv)


def _layer_finish(layer: DrafterLayer, h: Tensor, out: Tensor) -> Tensor:
    return DrafterLayer.finish(layer, h, out)


def _fuse(fc: nn.Linear, norm: RMSNorm, target_hidden: Tensor) -> Tensor:
    if not torch.is_autocast_enabled(target_hidden.device.type):
        # no autocast: match the weight (autocast casts inside the matmul, no fp32 copy)
        target_hidden = target_hidden.to(fc.weight.dtype)
    return norm(fc(target_hidden))


def _final_norm(norm: RMSNorm, h: Tensor) -> Tensor:
    return RMSNorm.forward(norm, h)


@dataclass(frozen=True)
class _Regions:
    """The training forward's code between the attention kernels. Plain functions of (module,
    tensors), not bound methods, so that one compiled graph per shape serves every layer (the
    weights are graph inputs), as the compiled target's decoder layer does."""

    fuse: Any = _fuse
    layer_inputs: Any = _layer_inputs
    layer_finish: Any = _layer_finish
    final_norm: Any = _final_norm


_EAGER = _Regions()
_COMPILED_REGIONS: dict[str, _Regions] = {}  # per compile mode, built once per process


def _regions(mode: str | None) -> _Regions:
    """Eager (``mode`` None) or ``torch.compile``d (``dynamic=False``: one graph per bucket shape)."""
    if mode is None:
        return _EAGER
    if mode not in _COMPILED_REGIONS:
        kwargs: dict[str, Any] = {"dynamic": False, "mode": None if mode == "default" else mode}
        _COMPILED_REGIONS[mode] = _Regions(
            **{name: torch.compile(getattr(_EAGER, name), **kwargs) for name in _Regions.__dataclass_fields__}
        )
    return _COMPILED_REGIONS[mode]


def drafter_layout(target_config: Any, cfg: DrafterConfig | None = None) -> dict[str, int]:
    """The drafter's width and head layout. The width is the target's hidden size (the drafter
    shares its embedding and lm_head; ``fc`` maps n x hidden -> hidden); heads, KV heads,
    head_dim and MLP width are ``cfg``'s where set (a published drafter's own layout, e.g.
    z-lab's Qwen3.6 drafters: 32 heads of 128, 8 KV heads) and the target's where 0."""
    tc = _text_config(target_config)
    hidden = int(tc.hidden_size)
    heads = int(tc.num_attention_heads)
    layout = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(tc, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(tc, "head_dim", None) or hidden // heads),
        "intermediate_size": int(tc.intermediate_size),
    }
    if cfg is not None:
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(cfg, key) > 0:
                layout[key] = int(getattr(cfg, key))
        if not cfg.num_key_value_heads and cfg.num_attention_heads:
            layout["num_key_value_heads"] = min(layout["num_key_value_heads"], layout["num_attention_heads"])
    if layout["num_attention_heads"] % layout["num_key_value_heads"]:
        raise ValueError(
            f"drafter.num_attention_heads={layout['num_attention_heads']} must be a multiple of "
            f"drafter.num_key_value_heads={layout['num_key_value_heads']}"
        )
    return layout


class DFlashDrafter(nn.Module):
    """The DFlash drafter (see the module docstring)."""

    def __init__(
        self, cfg: DrafterConfig, target_config: Any, embed_tokens: nn.Embedding, lm_head: nn.Linear
    ) -> None:
        super().__init__()
        tc = _text_config(target_config)
        self.cfg = cfg
        layout = drafter_layout(target_config, cfg)
        self.hidden_size = layout["hidden_size"]
        heads, kv_heads = layout["num_attention_heads"], layout["num_key_value_heads"]
        head_dim, inter = layout["head_dim"], layout["intermediate_size"]
        self.head_dim = head_dim
        self.target_layer_ids = cfg.resolved_target_layers(int(tc.num_hidden_layers))
        n = len(self.target_layer_ids)
        eps = cfg.rms_norm_eps
        self.fc = nn.Linear(n * self.hidden_size, self.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(self.hidden_size, eps)
        self.layers = nn.ModuleList(
            DrafterLayer(self.hidden_size, heads, kv_heads, head_dim, inter, eps)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(self.hidden_size, eps)
        rows = int(embed_tokens.weight.shape[0])
        if not 0 <= cfg.mask_token_id < rows:
            raise ValueError(
                f"drafter.mask_token_id={cfg.mask_token_id}: must be a row of the target's embedding "
                f"(0..{rows - 1}); set drafter.mask_token_id to the tokenizer's reserved mask token"
            )
        self.windows: list[int | None] = [
            None if i in cfg.full_attention_layers else cfg.sliding_window for i in range(cfg.num_layers)
        ]
        # Shared, frozen, deliberately unregistered (see the module docstring).
        self._shared: tuple[nn.Embedding, nn.Linear] = (embed_tokens, lm_head)
        for p in (*embed_tokens.parameters(), *lm_head.parameters()):
            p.requires_grad_(False)
        # The training forward compiled around the attention kernels (``compile_regions``); a str,
        # not the compiled callables, so the module stays picklable and copyable.
        self.compile_mode: str | None = None
        self.reset_parameters()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    def reset_parameters(self) -> None:
        """Qwen3-style init: linears N(0, 0.02), norms 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def compile_regions(self, mode: str = "default") -> None:
        """Compile the training forward's code between the attention kernels (the fusion of the
        target's hidden states, each layer's norms, projections, RoPE and MLP, the final norm) and
        the loss's softmax, one graph per bucket shape shared by every layer; what a run that
        compiles does (``training.run.core.build_drafter``). ``propose`` (eval: a context that
        grows every round) stays eager. Flex attention is compiled either way."""
        self.compile_mode = mode

    def graphs_per_shape(self) -> int:
        """The most graphs one compiled function gets per bucket shape: one per attention window
        (flex, ``variants``); two for the compiled regions (the first layer's input needs no
        gradient, the later layers' do). For ``attention.configure_compile``."""
        return max(len(self.variants()), 2 if self.compile_mode is not None else 1)

    def variants(self) -> list[int | None]:
        """The distinct attention windows (None = full): one BlockMask / compiled shape each."""
        return sorted(set(self.windows), key=lambda w: -1 if w is None else w)

    def _blocks(
        self,
        ctx: Tensor,
        first_tokens: Tensor,
        anchors: Tensor,
        attends: dict[int | None, Attend],
        regions: _Regions = _EAGER,
    ) -> Tensor:
        """Run the layers: ctx [B, T, H] fused, first_tokens/anchors [B, K] -> hidden [B, K*bs, H]."""
        bsz, k = first_tokens.shape
        bs = self.cfg.block_size
        T = ctx.shape[1]
        ids = torch.full((bsz, k, bs), self.cfg.mask_token_id, dtype=torch.long, device=first_tokens.device)
        ids[:, :, 0] = first_tokens
        h = self.embed_tokens(ids.reshape(bsz, k * bs))  # [B, K*bs, H]: [x_a, MASK, ..., MASK]
        h = h.to(self.fc.weight.dtype)  # the residual stream in the drafter's dtype (fp32 under autocast)
        offs = torch.arange(bs, device=anchors.device)
        q_pos = (anchors.clamp(min=0)[:, :, None] + offs).reshape(bsz, k * bs)
        kv_pos = torch.cat([torch.arange(T, device=anchors.device).expand(bsz, T), q_pos], dim=1)
        rope_q = _rope(q_pos, self.head_dim, self.cfg.rope_theta)
        rope_kv = _rope(kv_pos, self.head_dim, self.cfg.rope_theta)
        ctx = _autocast_copy(ctx)  # every layer's k/v projections read it: one cast per step
        for layer, window in zip(self.layers, self.windows, strict=True):
            q, k, v = regions.layer_inputs(layer, h, ctx, rope_q, rope_kv)
            h = regions.layer_finish(layer, h, attends[window](q, k, v))
        return regions.final_norm(self.norm, h)

    def fuse(self, target_hidden: Tensor, regions: _Regions = _EAGER) -> Tensor:
        """[B, T, n*H] -> the fused context [B, T, H]."""
        return regions.fuse(self.fc, self.hidden_norm, target_hidden)

    def block_hidden(self, input_ids: Tensor, target_hidden: Tensor, anchors: Tensor) -> Tensor:
        """The final (normed) hidden states of every block: [B, K*block_size, H], block-major."""
        cfg = self.cfg
        T = input_ids.shape[1]
        attends = {
            w: attention.make_attend(
                anchors, T, cfg.block_size, w, backend=cfg.attention_backend, tile=cfg.flex_tile
            )
            for w in self.variants()
        }
        first_tokens = input_ids.gather(1, anchors.clamp(min=0))
        regions = _regions(self.compile_mode)
        return self._blocks(self.fuse(target_hidden, regions), first_tokens, anchors, attends, regions)

    def forward(
        self, input_ids: Tensor, target_hidden: Tensor, loss_mask: Tensor, anchors: Tensor
    ) -> DraftOutput:
        """input_ids [B, T], target_hidden [B, T, n*H], loss_mask [B, T], anchors [B, K] (-1 padded)."""
        cfg = self.cfg
        hidden = self.block_hidden(input_ids, target_hidden, anchors)
        labels, label_mask = block_labels(input_ids, loss_mask, anchors, cfg.block_size)
        result = block_loss(
            hidden,
            labels,
            label_mask,
            self.lm_head,
            block_size=cfg.block_size,
            gamma=cfg.gamma,
            chunk_size=cfg.loss_chunk_size,
            compiled=self.compile_mode,
            label_smoothing=cfg.label_smoothing,
        )
        acc = result.acc_per_offset
        return DraftOutput(
            loss=result.loss,
            acc_per_offset=acc,
            tau_estimate=result.tau_estimate,
            num_tokens=result.labelled,
            correct_per_offset=result.correct,
            count_per_offset=result.count,
        )

    @torch.no_grad()
    def draft_hidden(self, target_hidden: Tensor, first_tokens: Tensor, anchors: Tensor) -> Tensor:
        """The final hidden states of offsets 1..B-1 of each anchor's block: [N, K, B-1, H].

        target_hidden [N, T, n*H]: the target's chosen hidden states of positions 0..T-1;
        first_tokens [N, K]: each block's anchor token; anchors [N, K]: its position (<= T; each
        block sees the context before its anchor, as ``block_hidden``). Eager, blockwise attention
        (a compiled drafter's shapes are the training buckets': evaluation shapes change every
        round), so it runs between compiled steps without a recompile."""
        n, k = first_tokens.shape
        T = target_hidden.shape[1]
        attends = {
            w: attention.make_attend(anchors, T, self.cfg.block_size, w, backend="blockwise")
            for w in self.variants()
        }
        hidden = self._blocks(self.fuse(target_hidden), first_tokens.long(), anchors, attends)
        return hidden.view(n, k, self.cfg.block_size, -1)[:, :, 1:]

    @torch.no_grad()
    def propose_logits(self, target_hidden: Tensor, last_token: Tensor) -> Tensor:
        """The drafter's logits of one block per row: [N, B-1, V] for positions T+1..T+B-1.

        target_hidden [N, T, n*H]: the target's chosen hidden states of the verified prefix
        (positions 0..T-1); last_token [N]: the token at position T (the target's newest
        token, no hidden state yet) = the block's anchor. What a DDTree round builds its tree
        from (``training.run.tree``); ``propose`` is its argmax."""
        n, T = target_hidden.shape[0], target_hidden.shape[1]
        anchors = torch.full((n, 1), T, dtype=torch.long, device=target_hidden.device)
        hidden = self.draft_hidden(target_hidden, last_token.view(n, 1), anchors)[:, 0]
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    @torch.no_grad()
    def propose(self, target_hidden: Tensor, last_token: Tensor) -> Tensor:
        """Greedy draft of one block per row: [N, B-1] long, the argmax of ``propose_logits``
        (the drafted tokens for positions T+1..T+B-1)."""
        return self.propose_logits(target_hidden, last_token).argmax(dim=-1)


def block_labels(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Labels and label mask of every block position: ([B, K*bs] long, [B, K*bs] bool).

    Block offset ``i`` of anchor ``a`` is labelled with ``input_ids[a + i]``; it counts when
    ``i >= 1``, ``a + i < T``, ``loss_mask[a + i]`` and the anchor is not padding (-1).
    """
    bsz, T = input_ids.shape
    k = anchors.shape[1]
    pos = anchors.clamp(min=0)[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, K, bs]
    ok = (pos < T) & (anchors >= 0)[:, :, None]
    ok[:, :, 0] = False
    pos_c = pos.clamp(max=T - 1).reshape(bsz, k * block_size)
    labels = input_ids.gather(1, pos_c)
    label_mask = loss_mask.bool().gather(1, pos_c) & ok.reshape(bsz, k * block_size)
    return labels, label_mask


def sample_anchors(
    loss_mask: Tensor, lengths: Tensor, num_anchors: int, generator: torch.Generator | None
) -> Tensor:
    """Random anchors per row: LongTensor [B, min(num_anchors, T - 1)], ascending, -1 padded.

    SpecForge's rule (``specforge/algorithms/common/dflash_family_model.py``,
    ``_sample_anchor_positions``): an anchor ``a`` is eligible when ``a <= T - 2`` and both
    ``loss_mask[a]`` and ``loss_mask[a + 1]`` are set (and ``a + 1 < length``); each row draws
    ``min(num_anchors, eligible)`` distinct anchors uniformly without replacement (anchors
    closer than ``block_size`` occur). Every row of every bucket has the same width
    ``min(num_anchors, T - 1)`` (stable compiled shapes): the drafter's memory then grows with
    the rows of a micro-batch, which ``data.max_batch_size`` caps, not with fewer anchors.
    Drawn on the CPU from ``generator`` (reproducible, resumable), returned on
    ``loss_mask``'s device.
    """
    bsz, T = loss_mask.shape
    candidates = max(T - 1, 1)
    width = max(1, min(int(num_anchors), candidates))
    lm = loss_mask.detach().to("cpu").bool()
    lens = lengths.detach().to("cpu").long().clamp(max=T)
    pos = torch.arange(candidates)
    eligible = torch.zeros(bsz, candidates, dtype=torch.bool)
    if T >= 2:
        eligible = lm[:, : T - 1] & lm[:, 1:T] & (pos[None, :] + 1 < lens[:, None])
    scores = torch.rand(bsz, candidates, generator=generator)
    scores = scores.masked_fill(~eligible, 2.0)
    picked_scores, picked = scores.topk(width, dim=1, largest=False)
    taken = picked_scores < 2.0
    key = torch.where(taken, picked, torch.full_like(picked, T))
    ordered = key.sort(dim=1).values
    anchors = torch.where(ordered < T, ordered, torch.full_like(ordered, -1))
    return anchors.to(loss_mask.device)


def resolve_mask_token_id(explicit: int, tokenizer: Any, target_config: Any) -> int:
    """The MASK token id: ``explicit`` (``drafter.mask_token_id``) when >= 0, else the target
    config's ``mask_token_id``, else the tokenizer's ``mask_token``, else the first embedding
    row no token of the tokenizer uses (``len(tokenizer)``, when the embedding has spare rows:
    z-lab's Qwen3 drafters use 151669 = the size of Qwen3's tokenizer, with 151936 rows).
    Raises ValueError (one line) when none applies or the id is not an embedding row."""
    rows = int(_text_config(target_config).vocab_size)
    source = "drafter.mask_token_id"
    value = int(explicit)
    if value < 0:
        from_config = getattr(target_config, "mask_token_id", None)
        from_config = getattr(_text_config(target_config), "mask_token_id", from_config)
        from_tokenizer = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        if from_config is not None:
            value, source = int(from_config), "the target config's mask_token_id"
        elif from_tokenizer is not None:
            value, source = int(from_tokenizer), "the tokenizer's mask_token"
        elif tokenizer is not None and len(tokenizer) < rows:
            value, source = len(tokenizer), "the first embedding row past the tokenizer"
        else:
            raise ValueError(
                "drafter.mask_token_id: the tokenizer has no mask token and the embedding no spare row; "
                "set drafter.mask_token_id to a reserved token id"
            )
    if not 0 <= value < rows:
        raise ValueError(
            f"drafter.mask_token_id={value} (from {source}) is not a row of the {rows}-row embedding"
        )
    return value
