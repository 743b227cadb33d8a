"""The DFlash block loss: offsets, weights, chunking under checkpointing, accuracy and tau."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.model.loss import block_loss, offset_weights, tau_from_accuracy

torch.set_num_threads(2)


def test_offset_weights_by_hand() -> None:
    w = offset_weights(4, 7.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


def test_hand_computed_loss_accuracy_and_counts() -> None:
    lm_head = nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    # two blocks of 3: offsets 0,1,2 | 0,1,2
    hidden = torch.tensor([[[9.0, 9.0], [2.0, 0.0], [0.0, 1.0], [9.0, 9.0], [1.0, 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[1, 0, 1, 2, 2, 0]])
    # offset 0 marked True must still be ignored; block 1 offset 2 unlabelled.
    mask = torch.tensor([[True, True, True, True, True, False]])
    out = block_loss(hidden, labels, mask, lm_head, block_size=3, gamma=2.0, chunk_size=2)
    ce1 = math.log(math.exp(2) + 2) - 2  # logits (2,0,0), label 0
    ce2 = math.log(2 + math.e) - 1  # logits (0,1,0), label 1
    ce3 = math.log(math.e + 2) - 0  # logits (1,0,0), label 2
    w2 = math.exp(-1 / 2)
    expected = (ce1 + w2 * ce2 + ce3) / (1 + w2 + 1)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.count.tolist() == [2, 1]
    assert out.correct.tolist() == [1, 1]
    assert out.acc_per_offset.tolist() == pytest.approx([0.5, 1.0])


def test_no_labelled_position_gives_zero_loss_with_a_graph() -> None:
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    out = block_loss(
        hidden,
        torch.zeros(1, 8, dtype=torch.long),
        torch.zeros(1, 8, dtype=torch.bool),
        nn.Linear(4, 5),
        block_size=4,
        gamma=7.0,
        chunk_size=3,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.count.tolist() == [0, 0, 0]
    assert out.acc_per_offset.tolist() == [0.0, 0.0, 0.0]


def _problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5 * 4, 16, generator=g)
    labels = torch.randint(0, 50, (2, 20), generator=g)
    mask = torch.rand(2, 20, generator=g) > 0.3
    lm_head = nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(50, 16, generator=g))
    return hidden, labels, mask, lm_head


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_loss_equals_unchunked_loss_and_gradients(chunk: int) -> None:
    hidden, labels, mask, lm_head = _problem(chunk)
    results = []
    for chunk_size, ckpt in ((10_000, False), (chunk, True), (chunk, False)):
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad()
        out = block_loss(
            h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=chunk_size, checkpointed=ckpt
        )
        out.loss.backward()
        results.append(
            (out.loss.detach(), h.grad.clone(), lm_head.weight.grad.clone(), out.correct, out.count)
        )
    ref = results[0]
    for other in results[1:]:
        torch.testing.assert_close(other[0], ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(other[1], ref[1], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(other[2], ref[2], rtol=1e-5, atol=1e-6)
        assert torch.equal(other[3], ref[3]) and torch.equal(other[4], ref[4])


def test_logits_exist_one_chunk_at_a_time_and_are_recomputed_in_backward() -> None:
    hidden, labels, mask, lm_head = _problem(0)
    rows: list[int] = []
    lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=4)
    forward_calls = len(rows)
    total = int(out.count.sum())
    assert forward_calls == math.ceil(total / 4) and max(rows) <= 4
    out.loss.backward()
    assert len(rows) == 2 * forward_calls  # checkpointing: logits recomputed, never stored


def test_tau_from_accuracy() -> None:
    assert tau_from_accuracy([1.0, 1.0, 1.0]) == 4.0  # perfect drafter: tau = block size
    assert tau_from_accuracy([0.5, 0.5]) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert tau_from_accuracy(torch.tensor([0.0, 1.0])) == 1.0  # a miss at offset 1 stops the round


def _spec_forge_accept_len(pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """SpecForge's ``compute_accept_len`` (specforge/algorithms/common/dflash_family_model.py),
    on [N, K, B-1] tensors: a block's run of correct drafts, unlabelled offsets count as correct."""
    correct = (pred == target) | (~valid)
    return (correct.long().cumprod(dim=2) * valid.long()).sum(dim=2).float()


def test_tau_estimate_is_the_per_block_run_of_correct_drafts() -> None:
    """Block A right at offsets 1 and 3, block B at 2 and 3: per-offset accuracies 0.5, 0.5, 1
    imply 1 + 0.5 + 0.25 + 0.25 = 2.0 (the old estimate); the blocks accept 1 and 0: tau 1.5."""
    vocab = 6
    lm_head = nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.eye(vocab))
    labels = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 4, 4, 4]])
    pred = torch.tensor([[0, 1, 5, 3, 0, 5, 2, 3, 0, 4, 5, 5]])  # block C: offset 3 unlabelled
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, [0, 4, 8, 11]] = False
    hidden = torch.nn.functional.one_hot(pred, vocab).float() * 10
    out = block_loss(hidden, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=5)
    offs = torch.arange(12) % 4 > 0
    ref = _spec_forge_accept_len(
        pred[:, offs].view(1, 3, 3), labels[:, offs].view(1, 3, 3), mask[:, offs].view(1, 3, 3)
    )
    assert ref.tolist() == [[1.0, 0.0, 1.0]]
    assert (out.accepted, out.blocks) == (2, 3)
    assert out.tau_estimate == pytest.approx(1.0 + float(ref.mean()))
    assert tau_from_accuracy(out.acc_per_offset) > out.tau_estimate  # the product overstates it
