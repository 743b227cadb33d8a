"""The DFlash drafter: layer choice, anchors, labels, visibility, and that it learns."""

from __future__ import annotations

import pytest
import torch
from testkit import tiny_qwen3
from transformers import Qwen3ForCausalLM

from training.model.drafter import (
    DFlashDrafter,
    DrafterConfig,
    block_labels,
    sample_anchors,
    select_target_layers,
    target_context,
)

torch.set_num_threads(2)
MASK_ID = 255  # a row of the tiny target's 256-row embedding that no test sequence uses


def tiny_target(seed: int = 0) -> Qwen3ForCausalLM:
    return tiny_qwen3(seed)


def tiny_drafter(target: Qwen3ForCausalLM, **overrides: object) -> DFlashDrafter:
    fields: dict[str, object] = {
        "num_layers": 2,
        "block_size": 4,
        "num_anchors": 8,
        "sliding_window": 6,
        "full_attention_layers": (1,),
        "num_target_layers": 2,
        "loss_chunk_size": 16,
        "mask_token_id": MASK_ID,
    }
    fields.update(overrides)
    cfg = DrafterConfig(**fields)  # type: ignore[arg-type]
    torch.manual_seed(1)
    return DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())


def hidden_of(target: Qwen3ForCausalLM, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return target_context(out.hidden_states, layer_ids)


def test_select_target_layers_follows_dflash() -> None:
    assert select_target_layers(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert select_target_layers(64) == [1, 16, 31, 46, 61]
    assert select_target_layers(36, 1) == [18]
    assert select_target_layers(4, 2) == [0, 3]  # too shallow for 1..L-3: spread over 0..L-1
    assert select_target_layers(2, 5) == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        select_target_layers(0)


def test_config_validation_and_explicit_target_layers() -> None:
    with pytest.raises(ValueError, match="full_attention_layers"):
        DrafterConfig(num_layers=2, full_attention_layers=(2,))
    with pytest.raises(ValueError, match="attention_backend"):
        DrafterConfig(attention_backend="sdpa")
    assert DrafterConfig(target_layer_ids=(0, 1)).resolved_target_layers(2) == [0, 1]
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig(target_layer_ids=(0, 5)).resolved_target_layers(2)


def test_block_labels_by_hand() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    labels, mask = block_labels(ids, loss_mask, torch.tensor([[1, 4, -1]]), block_size=3)
    # anchor 1 -> positions 1,2,3; anchor 4 -> 4,5,(6 out of range); padded anchor -> nothing
    assert labels[0, :6].tolist() == [11, 12, 13, 14, 15, 15]
    assert mask[0].tolist() == [False, True, True, False, False, False, False, False, False]


def test_sample_anchors_follow_specforge_a_fixed_number_per_row() -> None:
    """Eligible = a <= T-2 with loss on a and a+1 (SpecForge's _sample_anchor_positions); the
    same width in every row; before, a block only needed loss somewhere in a+1..a+B-1."""
    T = 40
    loss_mask = torch.zeros(3, T, dtype=torch.bool)
    loss_mask[0, 20:30] = True  # completion-only loss
    loss_mask[1, :] = True
    loss_mask[2, 5:7] = True
    lengths = torch.tensor([35, 12, 40])
    a1 = sample_anchors(loss_mask, lengths, 16, torch.Generator().manual_seed(5))
    a2 = sample_anchors(loss_mask, lengths, 16, torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2) and a1.shape == (3, 16) and a1.dtype == torch.long
    for row in range(3):
        got = [a for a in a1[row].tolist() if a >= 0]
        eligible = [
            a
            for a in range(T - 1)
            if a + 1 < int(lengths[row]) and bool(loss_mask[row, a]) and bool(loss_mask[row, a + 1])
        ]
        assert got == sorted(set(got)) and set(got) <= set(eligible)
        assert len(got) == min(16, len(eligible))
        assert a1[row].tolist()[len(got) :] == [-1] * (16 - len(got))
    assert [a for a in a1[2].tolist() if a >= 0] == [5]  # the only a with loss on a and a+1
    assert len([a for a in a1[0].tolist() if a >= 0]) == 9  # 20..28
    wide = sample_anchors(torch.ones(1, 10, dtype=torch.bool), torch.tensor([10]), 512, None)
    assert wide.shape == (1, 9) and wide[0].tolist() == list(range(9))  # capped at T-1, closer than B


def test_the_anchor_count_is_the_same_in_every_bucket() -> None:
    """512 anchors per row at T=1344 as at T=4096 (before: ceil(512 * T / max_length) = 168)."""
    ones = torch.ones(2, 1344, dtype=torch.bool)
    short = sample_anchors(ones, torch.tensor([1344, 1344]), 512, torch.Generator().manual_seed(0))
    assert short.shape == (2, 512) and bool((short >= 0).all())
    from training.config import load_config
    from training.data.buckets import Position
    from training.run.core import batch_anchors

    config = load_config("qwen3-8b-h200", [])
    anchors = batch_anchors(config, ones, torch.tensor([1344, 1344]), Position(epoch=0, index=0))
    assert anchors.shape == (2, 512)
    # the memory of many short rows is capped by rows per micro-batch, not by fewer anchors
    assert config.data.max_batch_size * config.drafter.num_anchors * 16 <= 4 * 512 * 16


def test_shared_embedding_and_head_are_frozen_and_not_in_the_state_dict() -> None:
    target = tiny_target()
    before = (target.get_input_embeddings().weight.clone(), target.get_output_embeddings().weight.clone())
    drafter = tiny_drafter(target)
    assert torch.equal(before[0], target.get_input_embeddings().weight)  # init leaves them alone
    assert torch.equal(before[1], target.get_output_embeddings().weight)
    state = drafter.state_dict()
    names = set(state)
    shared = {
        target.get_input_embeddings().weight.data_ptr(),
        target.get_output_embeddings().weight.data_ptr(),
    }
    assert not any(t.data_ptr() in shared for t in state.values())
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert "fc.weight" in names and not any("mask" in n for n in names)  # MASK is a token id
    assert drafter.fc.weight.shape == (64, 2 * 64)
    assert not target.get_input_embeddings().weight.requires_grad
    assert all(p.requires_grad for p in drafter.parameters())


def test_a_block_sees_only_context_before_its_anchor_and_itself() -> None:
    target = tiny_target()
    drafter = tiny_drafter(target, sliding_window=64).eval()
    T = 30
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    th = hidden_of(target, ids, drafter.target_layer_ids)
    anchors = torch.tensor([[10, 12, 20]])  # blocks 0 and 1 overlap (closer than B)
    with torch.no_grad():
        base = drafter.block_hidden(ids, th, anchors).view(1, 3, 4, -1)
        th2 = th.clone()
        th2[:, 10:] += 1.0  # context at and after anchor 10
        moved = drafter.block_hidden(ids, th2, anchors).view(1, 3, 4, -1)
        ids2 = ids.clone()
        ids2[0, 12] = (ids[0, 12] + 1) % 256  # the anchor token of block 1 only
        other = drafter.block_hidden(ids2, th, anchors).view(1, 3, 4, -1)
    torch.testing.assert_close(moved[:, 0], base[:, 0])
    assert not torch.allclose(moved[:, 1], base[:, 1]) and not torch.allclose(moved[:, 2], base[:, 2])
    torch.testing.assert_close(other[:, 0], base[:, 0])
    torch.testing.assert_close(other[:, 2], base[:, 2])
    assert not torch.allclose(other[:, 1], base[:, 1])


def test_sliding_layers_ignore_context_outside_the_window() -> None:
    target = tiny_target()
    drafter = tiny_drafter(target, full_attention_layers=(), sliding_window=5).eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    th = hidden_of(target, ids, drafter.target_layer_ids)
    anchors = torch.tensor([[20]])
    th2 = th.clone()
    th2[:, :16] += 3.0  # offset 0 of anchor 20 sees context 16..19 (the window counts the query)
    with torch.no_grad():
        torch.testing.assert_close(
            drafter.block_hidden(ids, th2, anchors), drafter.block_hidden(ids, th, anchors)
        )
        th2[:, 16] += 3.0
        assert not torch.allclose(
            drafter.block_hidden(ids, th2, anchors), drafter.block_hidden(ids, th, anchors)
        )


def test_flex_backend_gives_the_same_loss_as_blockwise() -> None:
    target = tiny_target()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    loss_mask = torch.ones(2, 40, dtype=torch.bool)
    anchors = sample_anchors(loss_mask, torch.tensor([40, 33]), 8, torch.Generator().manual_seed(0))
    losses = []
    for backend in ("blockwise", "flex", "dense"):
        drafter = tiny_drafter(target, attention_backend=backend, flex_tile=16)
        th = hidden_of(target, ids, drafter.target_layer_ids)
        with torch.no_grad():
            losses.append(drafter(ids, th, loss_mask, anchors).loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-5, atol=1e-5)


def test_the_run_configs_label_smoothing_reaches_the_drafters_loss() -> None:
    """[drafter] label_smoothing -> DrafterConfig (training.run.core.drafter_config) -> the
    block loss of the drafter's forward; a value outside [0, 1) names the key (a run config's:
    tests/training/test_config.py)."""
    from training.config import load_config
    from training.model.loss import block_loss
    from training.run.core import drafter_config

    assert drafter_config(load_config("tiny-cpu", ["--drafter.label_smoothing=0.1"])).label_smoothing == 0.1
    with pytest.raises(ValueError, match=r"drafter\.label_smoothing=1\.0"):
        DrafterConfig(label_smoothing=1.0)
    target = tiny_target()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones(2, 24, dtype=torch.bool)
    anchors = sample_anchors(loss_mask, torch.tensor([24, 20]), 8, torch.Generator().manual_seed(0))
    losses = {}
    with torch.no_grad():
        for eps in (0.0, 0.1):
            drafter = tiny_drafter(target, label_smoothing=eps)
            th = hidden_of(target, ids, drafter.target_layer_ids)
            losses[eps] = drafter(ids, th, loss_mask, anchors).loss
        labels, label_mask = block_labels(ids, loss_mask, anchors, 4)
        hidden = drafter.block_hidden(ids, th, anchors)
        ref = block_loss(
            hidden,
            labels,
            label_mask,
            drafter.lm_head,
            block_size=4,
            gamma=drafter.cfg.gamma,
            chunk_size=16,
            label_smoothing=0.1,
        )
    torch.testing.assert_close(losses[0.1], ref.loss)
    assert abs(losses[0.1].item() - losses[0.0].item()) > 1e-3


def test_drafter_fits_a_fixed_tiny_batch() -> None:
    target = tiny_target()
    drafter = tiny_drafter(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 48), generator=g)
    loss_mask = torch.ones(2, 48, dtype=torch.bool)
    loss_mask[:, :8] = False
    anchors = sample_anchors(loss_mask, torch.tensor([48, 48]), 8, g)
    th = hidden_of(target, ids, drafter.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        out = drafter(ids, th, loss_mask, anchors)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert out.num_tokens == int(out.count_per_offset.sum()) > 0
    assert out.acc_per_offset.shape == (3,) and out.tau_estimate > 1.0
    assert target.get_input_embeddings().weight.grad is None  # frozen, shared


def test_propose_returns_a_block_of_tokens() -> None:
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    th = hidden_of(target, ids, drafter.target_layer_ids)
    draft = drafter.propose(th, ids[:, -1])
    assert draft.shape == (2, 3) and draft.dtype == torch.long
    assert int(draft.min()) >= 0 and int(draft.max()) < 256


def test_mask_is_the_targets_embedding_of_the_mask_token() -> None:
    """The block is [x_a, MASK...] embedded by the target's frozen table: changing that table's
    row mask_token_id changes the drafts, no drafter weight does (before: a learned vector)."""
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(6))
    th = hidden_of(target, ids, drafter.target_layer_ids)
    anchors = torch.tensor([[8, 12]])
    with torch.no_grad():
        base = drafter.block_hidden(ids, th, anchors)
        target.get_input_embeddings().weight[MASK_ID + -1] += 5.0  # another unused row: no effect
        torch.testing.assert_close(drafter.block_hidden(ids, th, anchors), base)
        target.get_input_embeddings().weight[MASK_ID] += 5.0
        assert not torch.allclose(drafter.block_hidden(ids, th, anchors), base)
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_drafter(target, mask_token_id=-1)


def test_resolve_mask_token_id_order() -> None:
    from types import SimpleNamespace

    from training.model.drafter import resolve_mask_token_id

    class Tok:
        def __init__(self, n: int, mask: int | None) -> None:
            self.n, self.mask_token_id = n, mask

        def __len__(self) -> int:
            return self.n

    cfg = SimpleNamespace(vocab_size=151936)
    assert resolve_mask_token_id(7, Tok(151669, 3), cfg) == 7  # the config key wins
    assert resolve_mask_token_id(-1, Tok(151669, 3), cfg) == 3  # the tokenizer's mask token
    assert resolve_mask_token_id(-1, Tok(151669, None), cfg) == 151669  # z-lab's Qwen3 drafters' id
    with_id = SimpleNamespace(vocab_size=248320, mask_token_id=248070)
    assert resolve_mask_token_id(-1, Tok(248044, None), with_id) == 248070
    with pytest.raises(ValueError, match="no spare row"):
        resolve_mask_token_id(-1, Tok(256, None), SimpleNamespace(vocab_size=256))
    with pytest.raises(ValueError, match="not a row"):
        resolve_mask_token_id(300, Tok(10, None), SimpleNamespace(vocab_size=256))


def test_the_tiny_default_reserves_a_mask_token(tmp_path) -> None:
    from training.model.tinymodel import MASK_TOKEN, train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return x\n"] * 20, 300)
    assert tok.mask_token == MASK_TOKEN and tok.mask_token_id is not None and len(tok) <= 300
    assert MASK_TOKEN not in tok.decode(tok("def f(x): return <mask>")["input_ids"])


def test_drafter_config_defaults_are_the_run_configs() -> None:
    """One default per value: the fields DrafterConfig shares with [drafter] default to its values."""
    from dataclasses import fields

    from training.config import DrafterSection

    shared = {f.name for f in fields(DrafterConfig)} & {f.name for f in fields(DrafterSection)}
    assert {"loss_chunk_size", "num_anchors", "block_size", "num_target_layers"} <= shared
    section, config = DrafterSection(), DrafterConfig()
    assert {n: getattr(config, n) for n in shared} == {n: getattr(section, n) for n in shared}
    assert len(select_target_layers(36)) == section.num_target_layers


def test_the_drafter_layout_comes_from_the_drafter_config() -> None:
    """Heads, KV heads, head_dim and MLP width from [drafter] (a published drafter's layout, e.g.
    z-lab's Qwen3.6 drafters: 32 x 128 heads, 8 KV heads); 0 = the target's (before: always)."""
    target = tiny_target()  # 4 heads of 16, 2 KV heads, MLP 128, hidden 64
    same = tiny_drafter(target)
    assert same.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 64)
    own = tiny_drafter(
        target, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=96
    )
    attn = own.layers[0].self_attn
    assert attn.q_proj.weight.shape == (8 * 32, 64) and attn.k_proj.weight.shape == (2 * 32, 64)
    assert attn.o_proj.weight.shape == (64, 8 * 32) and own.layers[1].mlp.gate_proj.weight.shape == (96, 64)
    assert own.fc.weight.shape == (64, 2 * 64)  # the width stays the target's
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(8))
    th = hidden_of(target, ids, own.target_layer_ids)
    with torch.no_grad():
        assert own.block_hidden(ids, th, torch.tensor([[3, 7]])).shape == (1, 8, 64)
    with pytest.raises(ValueError, match="multiple of"):
        tiny_drafter(target, num_attention_heads=6, num_key_value_heads=4)


def _previous_attention_forward(self, x, ctx, rope_q, rope_kv, attend):
    """The drafter attention before the k/v projections were split (the reference): one
    [context ; block] concatenation at the hidden width, autocast casting per projection."""
    from training.model.drafter import _apply_rope

    b, q_len, _ = x.shape
    q = self.q_norm(self._heads(self.q_proj(x), self.heads)).transpose(1, 2)
    kv_in = torch.cat([ctx, x], dim=1)
    k = self.k_norm(self._heads(self.k_proj(kv_in), self.kv_heads)).transpose(1, 2)
    v = self._heads(self.v_proj(kv_in), self.kv_heads).transpose(1, 2)
    q = _apply_rope(q, *rope_q)
    k = _apply_rope(k, *rope_kv)
    out = attend(q, k, v)
    return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


def _previous_mlp_forward(self, x):
    """``DrafterMLP.forward`` before its input was cast once (autocast casting per projection)."""
    return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _previous_blocks(self, ctx, first_tokens, anchors, attends, regions=None):
    """``DFlashDrafter._blocks`` before the layers were split around the attention kernel: each
    layer one module call (pre-norm attention and MLP with their residuals)."""
    from training.model.drafter import _rope

    bsz, k = first_tokens.shape
    bs = self.cfg.block_size
    ids = torch.full((bsz, k, bs), self.cfg.mask_token_id, dtype=torch.long)
    ids[:, :, 0] = first_tokens
    h = self.embed_tokens(ids.reshape(bsz, k * bs)).to(self.fc.weight.dtype)
    q_pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(bs)).reshape(bsz, k * bs)
    kv_pos = torch.cat([torch.arange(ctx.shape[1]).expand(bsz, -1), q_pos], dim=1)
    rope_q = _rope(q_pos, self.head_dim, self.cfg.rope_theta)
    rope_kv = _rope(kv_pos, self.head_dim, self.cfg.rope_theta)
    for layer, window in zip(self.layers, self.windows, strict=True):
        x = layer.input_layernorm(h)
        h = h + _previous_attention_forward(layer.self_attn, x, ctx, rope_q, rope_kv, attends[window])
        h = h + _previous_mlp_forward(layer.mlp, layer.post_attention_layernorm(h))
    return self.norm(h)


@pytest.mark.parametrize("autocast", [False, True])
def test_split_kv_projections_equal_the_previous_attention(
    autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loss, accuracy, tau and every gradient of a training step equal the previous attention's and
    MLP's, in float32 and under bf16 autocast (the GPU's setting, here on the CPU: the same casts)."""
    from training.model.drafter import DFlashDrafter

    target = tiny_target()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 200, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.bool)
    results, counts = [], []
    for previous in (False, True):
        if previous:
            monkeypatch.setattr(DFlashDrafter, "_blocks", _previous_blocks)
        drafter = tiny_drafter(target, attention_backend="blockwise")
        hidden = hidden_of(target, ids, drafter.target_layer_ids)
        anchors = sample_anchors(mask, torch.tensor([24, 24]), 8, torch.Generator().manual_seed(5))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = drafter(ids, hidden, mask, anchors)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}))
        counts.append((out.num_tokens, out.count_per_offset.tolist()))
    (loss, grads), (ref_loss, ref_grads) = results
    assert counts[0] == counts[1] and counts[0][0] == sum(counts[0][1]) > 0
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_compiled_regions_give_the_eager_loss_accuracy_and_gradients() -> None:
    """``compile_regions``: the code between the attention kernels and the loss's softmax
    compiled (what a run that compiles uses) gives the eager drafter's loss, counts and every
    gradient; the loss's chunk size leaves full chunks (compiled) and a shorter last one (eager)."""
    target = tiny_target()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 200, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.bool)
    anchors = sample_anchors(mask, torch.tensor([24, 20]), 8, torch.Generator().manual_seed(7))
    results = []
    for compiled in (False, True):
        drafter = tiny_drafter(target, attention_backend="blockwise", loss_chunk_size=10)
        if compiled:
            drafter.compile_regions()
        hidden = hidden_of(target, ids, drafter.target_layer_ids)
        out = drafter(ids, hidden, mask, anchors)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        results.append((out.loss.detach(), grads, out.num_tokens, out.correct_per_offset.tolist()))
    (loss, grads, n, correct), (ref_loss, ref_grads, ref_n, ref_correct) = results[1], results[0]
    assert n == ref_n and n % 10 != 0 and n > 10  # full chunks and a shorter last one
    assert correct == ref_correct
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
