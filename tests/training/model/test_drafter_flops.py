"""The drafter step's FLOP model (training/model/flops.py) against torch's FlopCounterMode.

One real training step (forward + backward) of the real ``DFlashDrafter`` modules, on the CPU,
counted by FlopCounterMode. What the count can and cannot see:

- Attention runs the ``dense`` backend (a boolean mask over the whole [Q x (T + K*bs)] square)
  through SDPA's math path, which is written in matmuls the counter counts; the CPU's fused SDPA
  kernel and flex_attention are not counted by it. So the counter sees the dense square, and the
  model is asked for it (``dense_attention=True``); the model's real figure, the *visible* pairs,
  is checked separately against the mask itself (``dense_block_mask``'s True entries).
- The loss computes each lm_head chunk's input gradient in its forward (no recompute), so the
  counter sees exactly the model's lm_head: forward + input gradient.
- What the model says is *not* run is checked by the count: no input gradient for ``fc`` (its
  input, the target's hidden states, needs none) and no weight gradient for the frozen lm_head.
"""

from __future__ import annotations

import pytest
import torch
from testkit import tiny_qwen3
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from training.model.attention import dense_block_mask
from training.model.drafter import DFlashDrafter, DrafterConfig, block_labels, sample_anchors, target_context
from training.model.flops import AnchorStats, DrafterShape, drafter_step_flops

torch.set_num_threads(2)


def _drafter(backend: str = "dense") -> tuple[torch.nn.Module, DFlashDrafter, DrafterConfig]:
    target = tiny_qwen3(0)
    cfg = DrafterConfig(
        num_layers=3,
        block_size=4,
        num_anchors=6,
        sliding_window=5,
        full_attention_layers=(2,),
        num_target_layers=2,
        loss_chunk_size=7,
        attention_backend=backend,
        mask_token_id=255,  # a row of the tiny target's embedding, the MASK token (no FLOPs: a lookup)
    )
    torch.manual_seed(1)
    return (
        target,
        DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings()),
        cfg,
    )


def _batch(target: torch.nn.Module, drafter: DFlashDrafter, cfg: DrafterConfig, rows: int, T: int):
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (rows, T))
    lengths = torch.tensor([T, T - 9][:rows])
    loss_mask = torch.arange(T)[None, :] < lengths[:, None]
    loss_mask[0, :3] = False  # a prompt without loss
    anchors = sample_anchors(loss_mask, lengths, cfg.num_anchors, torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    hidden = target_context(out.hidden_states, drafter.target_layer_ids)
    return ids, loss_mask, lengths, anchors, hidden


def _shape(target: torch.nn.Module, drafter: DFlashDrafter, cfg: DrafterConfig) -> DrafterShape:
    return DrafterShape.from_configs(target.config, cfg, len(drafter.target_layer_ids))


def _counted_step(drafter: DFlashDrafter, ids, hidden, loss_mask, anchors) -> tuple[int, dict, int]:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = drafter(ids, hidden, loss_mask, anchors)
        out.loss.backward()
    return counter.get_total_flops(), counter.get_flop_counts(), out.num_tokens


@pytest.mark.parametrize("rows", [1, 2])
def test_drafter_step_flops_match_flop_counter(rows: int) -> None:
    target, drafter, cfg = _drafter()
    T = 40
    ids, loss_mask, _, anchors, hidden = _batch(target, drafter, cfg, rows, T)
    assert not hidden.requires_grad
    total, by_module, labelled = _counted_step(drafter, ids, hidden, loss_mask, anchors)
    shape = _shape(target, drafter, cfg)
    _, label_mask = block_labels(ids, loss_mask, anchors, cfg.block_size)
    stats = AnchorStats.from_tensors(anchors, label_mask, drafter.windows)
    assert stats.labelled == labelled > 0
    terms = drafter_step_flops(shape, T, stats, dense_attention=True)
    assert total == terms["total"]  # the lm_head is not recomputed: what runs is what is counted

    # term by term, by op: the attention is the only batched matmul (SDPA's math path). By module
    # only fc (the loss runs the lm_head's weight itself, so its matmuls are the remainder): the
    # backward's attribution among the layers and their submodules is not exact.
    def ops(name: str) -> dict[str, int]:
        return {str(op).split(".")[1]: n for op, n in by_module[name].items()}

    assert ops("DFlashDrafter.fc") == {"mm": terms["fc"]}  # forward + weight gradient: no input gradient
    assert ops("Global") == {
        "mm": terms["fc"] + terms["attention_projections"] + terms["mlp"] + terms["lm_head"],
        "bmm": terms["attention_scores"],
    }


def test_visible_pairs_are_the_masks_true_entries() -> None:
    """The model's attention counts the (query, key) pairs the DFlash mask lets through."""
    target, drafter, cfg = _drafter()
    T = 40
    ids, loss_mask, _, anchors, _ = _batch(target, drafter, cfg, 2, T)
    anchors = torch.cat([anchors, torch.full((2, 1), -1)], dim=1)  # a padded anchor: its own block only
    _, label_mask = block_labels(ids, loss_mask, anchors, cfg.block_size)
    shape = _shape(target, drafter, cfg)
    stats = AnchorStats.from_tensors(anchors, label_mask, drafter.windows)
    visible = sum(int(dense_block_mask(anchors, T, cfg.block_size, w).sum()) for w in drafter.windows)
    terms = drafter_step_flops(shape, T, stats)
    assert terms["attention_scores"] == 3 * 4 * shape.heads * shape.head_dim * visible
    dense = drafter_step_flops(shape, T, stats, dense_attention=True)
    assert terms["attention_scores"] < dense["attention_scores"]
    assert {k: v for k, v in terms.items() if "attention_scores" != k and k not in ("total", "forward")} == {
        k: v for k, v in dense.items() if "attention_scores" != k and k not in ("total", "forward")
    }


@pytest.mark.parametrize(("length", "window"), [(40, 5), (40, None), (12, 30), (3, 5), (1, 5)])
def test_expected_anchor_stats_by_enumeration(length: int, window: int | None) -> None:
    """``AnchorStats.expected`` against the mean over every eligible anchor, written out."""
    K, bs = 6, 4
    eligible = list(range(max(length - 1, 0)))
    real = min(K, len(eligible))

    def visible(a: int) -> int:  # block offset i of anchor a: full sees a keys, sliding min(a, W - 1 - i)
        return sum(a if window is None else max(0, min(a, window - 1 - i)) for i in range(bs))

    keys = real * (sum(visible(a) for a in eligible) / len(eligible) if eligible else 0)
    labels = sum(sum(1 for i in range(1, bs) if a + i < length) for a in eligible)
    labels = real * (labels / len(eligible) if eligible else 0)
    stats = AnchorStats.expected(3, length, K, bs, [window])
    assert stats.context_keys[window] == pytest.approx(3 * keys)
    assert stats.labelled == pytest.approx(3 * labels)


def test_expected_anchor_stats_match_sampled_anchors() -> None:
    """The expectation against sample_anchors' own draws (full loss, one length)."""
    rows, T, K, bs, windows = 64, 300, 40, 8, (50, None)
    loss_mask = torch.ones(rows, T, dtype=torch.bool)
    lengths = torch.full((rows,), T)
    anchors = sample_anchors(loss_mask, lengths, K, torch.Generator().manual_seed(0))
    ids = torch.zeros(rows, T, dtype=torch.long)
    _, label_mask = block_labels(ids, loss_mask, anchors, bs)
    drawn = AnchorStats.from_tensors(anchors, label_mask, windows)
    expected = AnchorStats.expected(rows, T, K, bs, windows)
    for w in windows:
        assert drawn.context_keys[w] == pytest.approx(expected.context_keys[w], rel=0.03)
    assert drawn.labelled == pytest.approx(expected.labelled, rel=0.01)


def test_qwen3_8b_one_plus_one_step() -> None:
    """The 1+1 benchmark shape (4 x 4096, 512 anchors, block 16, 5 layers, one full): ~289 TFLOP a
    step; the old count (3x everything, lm_head on every block position, no context K/V, attention
    over min(W, T/2)) said 336.9."""
    from types import SimpleNamespace

    target = SimpleNamespace(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    )
    drafter = SimpleNamespace(num_layers=5, block_size=16, sliding_window=2048, full_attention_layers=(4,))
    shape = DrafterShape.from_configs(target, drafter, 5)
    stats = AnchorStats.expected(4, 4096, 512, 16, shape.windows)
    terms = drafter_step_flops(shape, 4096, stats)
    assert 288.5e12 < terms["total"] < 289.5e12
    # the terms the old count missed or over-counted, written out
    q, t = 4 * 512 * 16, 4 * 4096
    assert terms["fc"] == 2 * 2 * t * 5 * 4096 * 4096
    assert terms["attention_projections"] == 5 * 3 * 2 * (2 * q * 4096 * 4096 + 2 * (t + q) * 4096 * 1024)
    assert terms["lm_head"] == pytest.approx(
        2 * 2 * 4096 * 151936 * 4 * 512 * (15 * 16 / 2 + 4080 * 15) / 4095
    )

    def mean_min(c: int) -> float:  # E[min(a, c)], a uniform on 0..4094
        return (c * (c - 1) / 2 + (4095 - c) * c) / 4095

    # sliding: offset i sees min(a, 2047 - i) context keys and its block causally; full: a and bs
    sliding = 4 * 512 * sum(mean_min(2047 - i) for i in range(16)) + q * 17 / 2
    full = 4 * 512 * 16 * 4094 / 2 + q * 16
    pairs = 4 * sliding + full
    assert terms["attention_scores"] == pytest.approx(3 * 4 * 32 * 128 * pairs)
