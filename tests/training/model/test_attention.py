"""The DFlash attention mask: BlockMask vs a dense reference, and the attention numerics."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from training.model import attention as A

torch.set_num_threads(2)


def _cases(seed: int, count: int) -> list[tuple[torch.Tensor, int, int, int | None]]:
    """Random (anchors, T, block_size, window): duplicates, neighbours, padding (-1) included."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(count):
        T = int(torch.randint(1, 70, (1,), generator=g))
        k = int(torch.randint(1, 9, (1,), generator=g))
        bs = [2, 4, 5][i % 3]
        window = [None, bs, bs + 1, 8][i % 4]  # a sliding window holds at least the block
        anchors = torch.randint(-1, T, (2, k), generator=g)
        anchors[0, 0] = max(T - 1, 0)
        if k > 1:
            anchors[1, 1] = min(int(anchors[1, 0].clamp(min=0)) + 1, T - 1)  # closer than B
        cases.append((anchors, T, bs, window))
    return cases


def _hand_rule(anchors: torch.Tensor, T: int, bs: int, window: int | None) -> torch.Tensor:
    """What a serving engine applies to one layer, one element at a time, in absolute positions.

    z-lab/dflash ``dflash/model.py`` (``_attention_mask``) and SGLang/vLLM: the block of anchor
    ``a`` decodes at positions ``a..a+B-1`` after a cache holding the context ``0..a-1``. A full
    layer (window None) is not causal: every block token sees the whole cache and the whole
    block. A sliding layer is causal with ``query_pos - key_pos < window``.
    """
    b_, k = anchors.shape
    q_len = k * bs
    out = torch.zeros(b_, q_len, T + q_len, dtype=torch.bool)
    for b in range(b_):
        for q in range(q_len):
            a = int(anchors[b, q // bs])
            q_pos = a + q % bs
            for j in range(T + q_len):
                in_cache = j < T and j < a  # context strictly before the anchor
                in_block = j >= T and (j - T) // bs == q // bs
                if not (in_cache or in_block):
                    continue
                k_pos = j if j < T else a + (j - T) % bs
                if window is None:
                    out[b, q, j] = True
                else:
                    out[b, q, j] = k_pos <= q_pos and q_pos - k_pos < window
    return out


def test_dense_reference_matches_the_rule_by_hand() -> None:
    for anchors, T, bs, window in _cases(0, 12):
        assert torch.equal(A.dense_block_mask(anchors, T, bs, window), _hand_rule(anchors, T, bs, window))


def test_hand_case_anchor_context_is_strictly_before() -> None:
    m = A.dense_block_mask(torch.tensor([[2, 3]]), 5, 2, None)
    # block 0 (anchor 2): context 0,1; own block keys 5,6. block 1 (anchor 3): context 0,1,2; keys 7,8.
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[0], expected)
    w = A.dense_block_mask(torch.tensor([[3]]), 5, 2, 2)
    # sliding window 2: offset 0 (position 3) sees context 2 and itself; offset 1 (position 4)
    # sees no context, offset 0 and itself (causal inside the block, per-token window)
    assert w[0].int().tolist() == [[0, 0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1]]


def test_each_layer_type_matches_the_engines_rule_for_sliding_and_full() -> None:
    anchors = torch.tensor([[6, 9, -1]])
    full = A.dense_block_mask(anchors, 12, 4, None)
    sliding = A.dense_block_mask(anchors, 12, 4, 5)
    assert torch.equal(full, _hand_rule(anchors, 12, 4, None))
    assert torch.equal(sliding, _hand_rule(anchors, 12, 4, 5))
    # full: the last block token sees the first (both ways); sliding: not the other way round
    assert bool(full[0, 0, 12 + 3]) and not bool(sliding[0, 0, 12 + 3]) and bool(sliding[0, 3, 12])


def _tiles(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    b_, h_, n_q = num.shape
    out = torch.zeros(b_, h_, n_q, n_kv, dtype=torch.bool)
    for b in range(b_):
        for h in range(h_):
            for q in range(n_q):
                for j in idx[b, h, q, : int(num[b, h, q])].tolist():
                    out[b, h, q, j] = True
    return out


@pytest.mark.parametrize("tile", [8, 16, 128])
def test_block_mask_equals_dense_reference(tile: int) -> None:
    for anchors, T, bs, window in _cases(1 + tile, 10):
        dense = A.dense_block_mask(anchors, T, bs, window)
        b_, q_len, kv_len = dense.shape
        mod = A.make_mask_mod(anchors, T, bs, window)
        assert torch.equal(create_mask(mod, b_, 1, q_len, kv_len, device="cpu")[:, 0], dense)
        bm: BlockMask = A.build_block_mask(anchors, T, bs, window, tile=tile)
        n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
        padded = torch.zeros(b_, n_q * tile, n_kv * tile, dtype=torch.bool)
        padded[:, :q_len, :kv_len] = dense
        per_tile = padded.view(b_, n_q, tile, n_kv, tile)
        any_true = per_tile.any(dim=(2, 4))
        inside = torch.zeros_like(padded)
        inside[:, :q_len, :kv_len] = True
        all_true = (per_tile | ~inside.view(b_, n_q, tile, n_kv, tile)).all(dim=(2, 4)) & any_true
        partial = _tiles(bm.kv_num_blocks, bm.kv_indices, n_kv)[:, 0]
        full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv)[:, 0]
        assert not (partial & full).any()
        assert torch.equal(partial | full, any_true), (anchors, T, bs, window)
        assert not (full & ~all_true).any(), "a tile marked full has masked entries"


def _qkv(b: int, hq: int, hkv: int, q_len: int, kv_len: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, q_len, d, generator=g),
        torch.randn(b, hkv, kv_len, d, generator=g),
        torch.randn(b, hkv, kv_len, d, generator=g),
    )


@pytest.mark.parametrize("tile", [16, 128])
def test_flex_matches_dense_reference_numerically(tile: int) -> None:
    for i, (anchors, T, bs, window) in enumerate(_cases(7, 6)):
        q_len = anchors.shape[1] * bs
        q, k, v = _qkv(2, 4, 2, q_len, T + q_len, 8, i)
        ref = A.reference_attention(q, k, v, A.dense_block_mask(anchors, T, bs, window))
        bm = A.build_block_mask(anchors, T, bs, window, tile=tile)
        out = A.flex_attend(q, k, v, bm)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_blockwise_and_dense_match_reference_values_and_gradients() -> None:
    for i, (anchors, T, bs, window) in enumerate(_cases(11, 8)):
        q_len = anchors.shape[1] * bs
        base = _qkv(2, 4, 2, q_len, T + q_len, 8, 100 + i)
        mask = A.dense_block_mask(anchors, T, bs, window)
        ref = A.reference_attention(*base, mask)
        grads = []
        for attend in (
            A.make_attend(anchors, T, bs, window, backend="blockwise"),
            A.make_attend(anchors, T, bs, window, backend="dense"),
        ):
            q, k, v = (t.clone().requires_grad_(True) for t in base)
            out = attend(q, k, v)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            grads.append([t.grad for t in (q, k, v)])
        for g_block, g_dense in zip(*grads, strict=True):
            torch.testing.assert_close(g_block, g_dense, atol=2e-5, rtol=1e-4)


def test_auto_backend_on_cpu_is_blockwise_and_unknown_backend_is_refused() -> None:
    anchors = torch.tensor([[1, 2]])
    q, k, v = _qkv(1, 2, 2, 4, 7, 4, 0)
    auto = A.make_attend(anchors, 3, 2, None)(q, k, v)
    torch.testing.assert_close(auto, A.blockwise_attend(q, k, v, anchors, 3, 2, None))
    with pytest.raises(ValueError, match="backend"):
        A.make_attend(anchors, 3, 2, None, backend="sdpa")


def test_uncompiled_flex_off_cpu_is_refused() -> None:
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(RuntimeError, match="must not run uncompiled"):
        A.flex_attend(q, q, q, block_mask=None, compiled=False)  # type: ignore[arg-type]


def test_flex_training_on_cpu_is_refused_with_the_way_out() -> None:
    anchors = torch.tensor([[1, 2]])
    q, k, v = _qkv(1, 2, 2, 4, 7, 4, 0)
    bm = A.build_block_mask(anchors, 3, 2, None)
    with pytest.raises(RuntimeError, match="blockwise"):
        A.flex_attend(q.clone().requires_grad_(True), k, v, bm)
    A.flex_attend(q, k, v, bm)  # forward only is fine


def test_configure_compile_makes_the_recompile_limit_an_error() -> None:
    cfg = torch._dynamo.config
    saved = (cfg.recompile_limit, cfg.accumulated_recompile_limit, cfg.fail_on_recompile_limit_hit)
    try:
        assert A.configure_compile(num_buckets=6, variants=2) == 14
        assert cfg.recompile_limit == 14 and cfg.fail_on_recompile_limit_hit is True
        assert A.configure_compile(num_buckets=1, variants=1) == 8  # never below Dynamo's default
        with pytest.raises(ValueError):
            A.configure_compile(num_buckets=0, variants=2)
        torch._dynamo.reset()

        def f(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        compiled = torch.compile(f, backend="eager", dynamic=False)
        for n in range(1, 9):  # 8 shapes: within the limit
            compiled(torch.ones(n))
        with pytest.raises(FailOnRecompileLimitHit):
            compiled(torch.ones(9))
    finally:
        cfg.recompile_limit, cfg.accumulated_recompile_limit, cfg.fail_on_recompile_limit_hit = saved
        torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_flex_on_cpu_matches_reference_without_recompiling_for_new_anchors() -> None:
    """The path a GPU takes (the eager block mask + compiled flex), here on the CPU inductor."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    A.set_cpu_compile(True)
    try:
        T, bs = 40, 4
        g = torch.Generator().manual_seed(3)
        for step in range(2):
            anchors = torch.randint(-1, T, (1, 6), generator=g).sort().values
            q, k, v = _qkv(1, 4, 2, 24, T + 24, 16, step)
            bm = A.build_block_mask(anchors, T, bs, 8)
            out = A.flex_attend(q, k, v, bm)
            ref = A.reference_attention(q, k, v, A.dense_block_mask(anchors, T, bs, 8))
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        # flex compiled once (the mask is eager): new anchor values of one shape reuse it
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        A.set_cpu_compile(False)
        torch._dynamo.reset()


def test_the_block_mask_is_built_without_compiling_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask is built eager on every device (its compile was most of a cold start): with the
    compiled path on, building masks for new anchors never reaches torch.compile."""

    def refuse(*args, **kwargs):
        raise AssertionError("build_block_mask compiled something")

    monkeypatch.setattr(A, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", refuse)
    A.set_cpu_compile(True)
    try:
        for anchors, T, bs, window in _cases(7, 4):
            A.build_block_mask(anchors, T, bs, window, tile=16)
    finally:
        A.set_cpu_compile(False)


@pytest.mark.parametrize("tile", [8, 128])
def test_block_mask_is_what_torch_create_block_mask_builds(tile: int) -> None:
    """The split builder (tile maps, then an eager sort) gives flex exactly the index tensors
    torch's own ``create_block_mask`` gives for the same mask_mod: both directions, partial and
    full tiles, lengths that are not multiples of the tile included."""
    for anchors, T, bs, window in _cases(11 + tile, 8):
        ours = A.build_block_mask(anchors, T, bs, window, tile=tile)
        q_len = anchors.shape[1] * bs
        mod = A.make_mask_mod(anchors, T, bs, window)
        ref = create_block_mask(mod, anchors.shape[0], 1, q_len, T + q_len, device="cpu", BLOCK_SIZE=tile)
        assert ours.seq_lengths == ref.seq_lengths
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name
        for num, idx in (
            ("kv_num_blocks", "kv_indices"),
            ("full_kv_num_blocks", "full_kv_indices"),
            ("q_num_blocks", "q_indices"),
            ("full_q_num_blocks", "full_q_indices"),
        ):
            n = getattr(ref, num)
            keep = torch.arange(getattr(ref, idx).shape[-1]) < n[..., None]  # entries past n are unused
            assert torch.equal(getattr(ours, idx)[keep], getattr(ref, idx)[keep]), idx


def test_tile_maps_at_the_real_block_size_match_create_block_mask_with_full_tiles() -> None:
    """Block size 16, tiles of 16 and 32, contexts of hundreds of positions, windows narrower and
    wider than a tile: many wholly visible tiles (the closed form's hardest part), and the maps
    equal the ones torch builds by evaluating ``mask_mod`` at every position."""
    g = torch.Generator().manual_seed(5)
    fulls = 0
    for i in range(8):
        T = int(torch.randint(100, 400, (1,), generator=g))
        k = int(torch.randint(3, 12, (1,), generator=g))
        window = [None, 16, 40, 100][i % 4]
        tile = [16, 32][i % 2]
        anchors = torch.randint(-1, T, (2, k), generator=g).sort(dim=1).values
        partial, full = A.tile_maps(anchors, T, 16, window, tile)
        ref = create_block_mask(
            A.make_mask_mod(anchors, T, 16, window), 2, 1, k * 16, T + k * 16, device="cpu", BLOCK_SIZE=tile
        )
        n_kv = -(-(T + k * 16) // tile)
        assert torch.equal(partial, _tiles(ref.kv_num_blocks, ref.kv_indices, n_kv)), (i, window, tile)
        assert torch.equal(full, _tiles(ref.full_kv_num_blocks, ref.full_kv_indices, n_kv)), (i, window, tile)
        fulls += int(full.sum())
    assert fulls > 50  # the cases do exercise wholly visible tiles
