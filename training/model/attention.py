"""The DFlash attention mask: flex_attention ``BlockMask`` + a dense reference.

Layout. A batch row has ``T`` target-context positions and ``K`` anchors; each anchor
``a`` owns a block of ``B`` (block_size) query positions. Queries are the ``K*B``
block tokens, flattened block-major: query ``q`` belongs to block ``q // B`` at block
offset ``q % B``. Keys/values are ``[context (T) ; block tokens (K*B)]``: key index
``j < T`` is the fused target hidden state at sequence position ``j``; key index
``j >= T`` is block token ``j - T``.

The exact visibility rule (``mask_mod`` below and ``dense_block_mask`` implement it), per
layer type as the serving engines run each drafter layer:

    query q at block offset i of block k, anchor a = anchors[b, k], sees key j iff
      full layer (window None):
        context:   j < T  and  j < a
        own block: j >= T and (j - T) // B == k                 (all B positions, both ways)
      sliding layer (window W):
        context:   j < T  and  j < a  and  j >= a + i - (W - 1)  (a per-token left window)
        own block: j >= T and (j - T) // B == k and (j - T) % B <= i   (causal in the block)

Sources: SpecForge ``specforge/algorithms/common/dflash_family_model.py``
(``create_dflash_block_mask`` / ``create_dflash_sdpa_mask`` with ``sliding_window``: "the
current draft token occupies one slot in the window"); z-lab/dflash ``dflash/model.py``
(``Qwen3DFlashAttention``: a ``sliding_attention`` layer is causal with the window
``query_position - key_position < sliding_window``, a ``full_attention`` layer attends both
ways); SGLang ``python/sglang/srt/models/dflash.py`` (full layers ``ENCODER_ONLY``, sliding
layers ``DECODER`` with the window) and vLLM
``vllm/model_executor/models/qwen3_dflash.py`` (``_resolve_layer_attention``: causal only for
``sliding_attention``). The window is in tokens and counts the query itself, so a sliding
layer needs ``W >= B`` for the whole block to fit (``DrafterConfig`` checks it).

Context *strictly before* the anchor: the anchor token itself enters the block as its
token embedding (block offset 0), and offset ``i`` predicts the token at ``a + i``. This
is what decoding has: the target's hidden states exist for the verified prefix
``0..a-1``; the token at ``a`` (the target's bonus token) has no hidden state yet.
A padded anchor (``-1``) sees no context, only its own block (no empty rows, no NaN;
its labels are masked by the loss). Blocks never see other blocks, so anchors closer
than ``B`` (overlapping blocks) are independent.

Backends (``make_attend``): ``flex`` — flex_attention with the BlockMask; ``blockwise`` —
plain autograd tensor ops that score each block against the context [Q x T] and against
its own block [B x B] only (never the block-to-block [Q x Q] part), one joint softmax;
``dense`` — SDPA with the full boolean mask (test reference). ``auto`` = flex on CUDA,
blockwise on CPU: torch 2.13 has no flex backward on CPU at all ("FlexAttention does not
support backward on CPU", eager and compiled), and compiling the block-mask builder with
the CPU inductor took 26 s (flex forward 4.4 s more) for one tiny shape on the 2-core dev
machine. CPU flex is still run forward-only by the tests, against the dense reference.

Compilation. On CUDA ``flex_attention`` always runs compiled: the eager flex path
materializes the whole [Q x KV] score matrix (hundreds of GB at real shapes), so
``flex_attend`` raises instead of ever running it uncompiled on a GPU. The block mask is built
eager (``build_block_mask``: a closed form of the rule per tile, no compile).
``configure_compile`` sets Dynamo's recompile limit from the number of length buckets and
makes hitting it an error, so a silent uncompiled (dense) fallback cannot happen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Compiled callables, built lazily once per process (torch.compile is cheap until first call).
_COMPILED: dict[str, Callable[..., Any]] = {}

# Compile flex on CPU too (off by default: slow to compile, forward-only there).
_CPU_COMPILE = {"enabled": False}

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
BACKENDS = ("auto", "flex", "blockwise", "dense")


def set_cpu_compile(enabled: bool) -> None:
    """Use the compiled flex path on CPU as well (default: eager flex on CPU)."""
    _CPU_COMPILE["enabled"] = bool(enabled)


def _use_compiled(device: torch.device) -> bool:
    return device.type != "cpu" or _CPU_COMPILE["enabled"]


def configure_compile(num_buckets: int, variants: int) -> int:
    """Set Dynamo's recompile limit for ``num_buckets`` length buckets x ``variants``.

    ``variants`` counts the distinct compiled shapes per bucket (mask variants such as
    full + sliding, forward/eval). Every bucket pads to its own length, so each
    (bucket, variant) is one compiled graph per code object. The limit gets a margin of
    2 and never goes below Dynamo's default (8). Hitting it raises
    (``fail_on_recompile_limit_hit``) instead of silently running flex uncompiled.
    Returns the limit set.
    """
    if num_buckets < 1 or variants < 1:
        raise ValueError(f"configure_compile: num_buckets={num_buckets} and variants={variants} must be >= 1")
    limit = max(8, num_buckets * variants + 2)
    cfg = torch._dynamo.config
    cfg.recompile_limit = limit
    cfg.accumulated_recompile_limit = max(int(cfg.accumulated_recompile_limit), limit * 8)
    cfg.fail_on_recompile_limit_hit = True
    return limit


def make_mask_mod(
    anchors: Tensor, context_len: int, block_size: int, window: int | None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The flex ``mask_mod`` of the rule in the module docstring (anchors: [B, K] long)."""
    T = int(context_len)
    bs = int(block_size)
    last_block = int(anchors.shape[1]) - 1

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        blk = q_idx // bs
        off = q_idx % bs
        # Kernels may evaluate padded rows of a partial tile (q_idx >= K*bs): never read
        # past the anchors tensor (those rows are discarded anyway).
        anchor = anchors[b, blk.clamp(max=last_block)]
        is_ctx = kv_idx < T
        ctx_ok = is_ctx & (kv_idx < anchor)
        own = (~is_ctx) & ((kv_idx - T) // bs == blk)
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx >= anchor + off - (window - 1))
            own = own & ((kv_idx - T) % bs <= off)
        return ctx_ok | own

    return mask_mod


def dense_block_mask(anchors: Tensor, context_len: int, block_size: int, window: int | None) -> Tensor:
    """Dense boolean reference of the rule: [B, K*block_size, T + K*block_size] (True = visible).

    Built independently of ``make_mask_mod`` (broadcast tensor algebra, no flex code), so
    tests can compare the two. Also the mask of ``dense_attend`` (eval's ``propose``).
    """
    bsz, k = anchors.shape
    T = int(context_len)
    q_len = k * block_size
    dev = anchors.device
    q_block = torch.arange(q_len, device=dev) // block_size  # [Q]
    q_off = torch.arange(q_len, device=dev) % block_size  # [Q]
    anchor_q = anchors[:, q_block]  # [B, Q]
    ctx_j = torch.arange(T, device=dev)  # [T]
    ctx = ctx_j[None, None, :] < anchor_q[:, :, None]
    blk_j = torch.arange(q_len, device=dev) // block_size
    own = q_block[:, None] == blk_j[None, :]  # [Q, Q]
    if window is not None:
        lower = anchor_q + q_off[None, :] - (window - 1)  # [B, Q]
        ctx = ctx & (ctx_j[None, None, :] >= lower[:, :, None])
        own = own & (q_off[None, :] <= q_off[:, None])  # key offset <= query offset
    return torch.cat([ctx, own.expand(bsz, q_len, q_len)], dim=2)


def build_block_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None,
    *,
    tile: int = 128,
) -> BlockMask:
    """The flex ``BlockMask`` for ``anchors`` [B, K] (-1 padded).

    ``tile`` is flex's BLOCK_SIZE (the sparsity granularity), not the DFlash block size. The mask
    depends on the anchors, so it is built every step, in two parts: ``tile_maps`` (which tiles
    are partly / wholly visible, from each query row's visible intervals) and the ordering of
    those tiles into flex's index lists (a sort over a few thousand entries). This is what
    ``create_block_mask`` computes (``torch/nn/attention/flex_attention.py``: ``create_mask``,
    ``_convert_mask_to_block_mask``, ``_dense_to_ordered``, ``BlockMask.from_kv_blocks``), without
    evaluating ``mask_mod`` at every (query, key) position: that evaluation had to be compiled
    to be fast, and its compile was the largest part of a cold start (one fused sort kernel
    135-142 s on an H200 under torch 2.11; 8 s of frames once the sort was split out). Both
    parts run eager, and nothing of the mask is compiled. ``mask_mod`` still goes with the mask:
    flex evaluates it inside the partial tiles.
    """
    k = anchors.shape[1]
    q_len = k * block_size
    kv_len = int(context_len) + q_len
    mask_mod = make_mask_mod(anchors, context_len, block_size, window)
    partial, full = tile_maps(anchors, context_len, block_size, window, tile)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


def tile_maps(
    anchors: Tensor, context_len: int, block_size: int, window: int | None, tile: int
) -> tuple[Tensor, Tensor]:
    """(partial, full): [B, 1, ceil(Q/tile), ceil(KV/tile)] bool, the tiles of the rule in the
    module docstring that are visible somewhere but not everywhere / everywhere. Positions past
    ``Q`` / ``KV`` (the last tiles' padding) count as masked, as in ``create_block_mask``.

    Closed form of the rule: every query row sees two intervals of keys, its context
    ``[lo, min(a, T))`` (``lo`` = 0, or ``a + i - (W - 1)`` in a sliding layer) and its own
    block ``[T + k*B, T + k*B + n)`` (``n`` = B, or ``i + 1`` in a sliding layer). A row's
    visible count in a key tile is the two intervals' overlap with it, and a tile's count the
    sum over its rows: [B, Q, KV/tile] integers instead of the [B, Q, KV] booleans of
    evaluating ``mask_mod`` everywhere (a few MB at the largest shapes, eager in well under a
    millisecond). Tests compare it with ``create_block_mask`` on ``make_mask_mod``.
    """
    bsz, k = anchors.shape
    T, bs = int(context_len), int(block_size)
    q_len = k * bs
    kv_len = T + q_len
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    dev = anchors.device
    rows = torch.arange(q_tiles * tile, device=dev)
    valid = rows < q_len  # the last query tile's padding sees nothing
    blk = (rows // bs).clamp(max=k - 1)
    off = rows % bs
    anchor = anchors[:, blk]  # [B, rows]
    ctx_hi = anchor.clamp(max=T)  # keys j < a (and j < T); a padded anchor (-1) sees no context
    ctx_lo = torch.zeros_like(anchor) if window is None else (anchor + off - (window - 1)).clamp(min=0)
    own_lo = (T + blk * bs).expand(bsz, -1)
    own_hi = own_lo + (bs if window is None else off + 1)
    k0 = torch.arange(kv_tiles, device=dev) * tile  # each key tile's first key
    k1 = k0 + tile

    def overlap(lo: Tensor, hi: Tensor) -> Tensor:  # [B, rows] intervals x key tiles -> [B, rows, tiles]
        return (torch.minimum(hi[..., None], k1) - torch.maximum(lo[..., None], k0)).clamp(min=0)

    seen = (overlap(ctx_lo, ctx_hi) + overlap(own_lo, own_hi)) * valid[None, :, None]
    counts = seen.view(bsz, q_tiles, tile, kv_tiles).sum(dim=2, dtype=torch.int32)[:, None]
    return (counts > 0) & (counts < tile * tile), counts == tile * tile


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """A row-wise tile map -> (count per row, the set tiles' column indices first): int32, as
    flex's ``_dense_to_ordered`` (a stable sort keeps the indices ascending)."""
    num = tiles.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _compiled_flex() -> Callable[..., Any]:
    fn = _COMPILED.get("flex")
    if fn is None:
        fn = torch.compile(flex_attention, dynamic=False)
        _COMPILED["flex"] = fn
    return fn


def _compiled_blockwise() -> Callable[..., Any]:
    fn = _COMPILED.get("blockwise")
    if fn is None:
        fn = torch.compile(blockwise_attend, dynamic=False)
        _COMPILED["blockwise"] = fn
    return fn


def flex_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
    compiled: bool | None = None,
) -> Tensor:
    """flex_attention over q [B, Hq, Q, D], k/v [B, Hkv, KV, D] (GQA when Hq != Hkv).

    ``compiled=None``: compiled off-CPU, eager on CPU unless ``set_cpu_compile(True)``.
    ``compiled=False`` off-CPU raises: the eager path materializes the whole score matrix.
    """
    use = _use_compiled(q.device) if compiled is None else compiled
    if not use and q.device.type != "cpu":
        raise RuntimeError(
            f"flex_attention must not run uncompiled on {q.device}: the eager path materializes "
            "the whole [Q x KV] score matrix (OOM at real shapes); use the compiled path"
        )
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "flex_attention has no backward on CPU in this torch; train on CPU with "
            "drafter.attention_backend = 'auto' or 'blockwise'"
        )
    dtype = v.dtype
    q, k = q.to(dtype), k.to(dtype)
    gqa = q.shape[1] != k.shape[1]
    if use:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # CPU only: eager is the intended path here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def dense_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None = None) -> Tensor:
    """Reference attention with a boolean mask [B, Q, KV] (SDPA; for tests and tiny-Q decoding).

    Materializes [B, H, Q, KV] scores: use only where Q is small (``propose``: Q = block size).
    """
    dtype = v.dtype
    q, k = q.to(dtype), k.to(dtype)
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :, :], scale=scale)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None = None
) -> Tensor:
    """Textbook softmax(QK^T * scale + mask) V in float64 (test oracle, no SDPA/flex code)."""
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * s
    scores = scores.masked_fill(~mask[:, None, :, :], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v.double()).to(q.dtype)


def blockwise_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None,
    *,
    scale: float | None = None,
) -> Tensor:
    """The mask rule as tensor ops: scores [Q x T] to the context + [B x B] within each block.

    Memory O(Q * (T + B)) per head instead of O(Q * (T + Q)); differentiable (CPU training).
    """
    bsz, hq, q_len, d = q.shape
    kblocks = anchors.shape[1]
    T = int(context_len)
    if k.shape[1] != hq:
        rep = hq // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    s = scale if scale is not None else d**-0.5
    qf, kf, vf = q.float(), k.float(), v.float()
    k_ctx, v_ctx = kf[:, :, :T], vf[:, :, :T]
    k_blk = kf[:, :, T:].reshape(bsz, hq, kblocks, block_size, d)
    v_blk = vf[:, :, T:].reshape(bsz, hq, kblocks, block_size, d)
    q_blk = qf.reshape(bsz, hq, kblocks, block_size, d)
    s_ctx = torch.einsum("bhkqd,bhtd->bhkqt", q_blk, k_ctx) * s
    j = torch.arange(T, device=q.device)
    a = anchors[:, None, :, None, None]
    ctx_ok = j < a
    s_own = torch.einsum("bhkqd,bhkjd->bhkqj", q_blk, k_blk) * s
    if window is not None:
        off = torch.arange(block_size, device=q.device)
        ctx_ok = ctx_ok & (j >= a + off[:, None] - (window - 1))
        causal = off[None, :] <= off[:, None]  # [query offset, key offset]
        s_own = s_own.masked_fill(~causal, float("-inf"))
    s_ctx = s_ctx.masked_fill(~ctx_ok, float("-inf"))
    p = torch.cat([s_ctx, s_own], dim=-1).softmax(dim=-1)
    out = torch.einsum("bhkqt,bhtd->bhkqd", p[..., :T], v_ctx) + torch.einsum(
        "bhkqj,bhkjd->bhkqd", p[..., T:], v_blk
    )
    return out.reshape(bsz, hq, q_len, d).to(v.dtype)


def make_attend(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None,
    *,
    backend: str = "auto",
    tile: int = 128,
) -> Attend:
    """An ``attend(q, k, v) -> out`` for one mask variant (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "auto" and anchors.device.type == "cpu" and _CPU_COMPILE["enabled"]:
        # CPU training with compile on: flex has no CPU backward, so compile blockwise.
        blockwise = _compiled_blockwise()
        return lambda q, k, v: blockwise(q, k, v, anchors, context_len, block_size, window)
    if backend == "auto":
        backend = "blockwise" if anchors.device.type == "cpu" else "flex"
    if backend == "flex":
        bm = build_block_mask(anchors, context_len, block_size, window, tile=tile)
        return lambda q, k, v: flex_attend(q, k, v, bm)
    if backend == "dense":
        m = dense_block_mask(anchors, context_len, block_size, window)
        return lambda q, k, v: dense_attend(q, k, v, m)
    return lambda q, k, v: blockwise_attend(q, k, v, anchors, context_len, block_size, window)
