"""The DFlash block loss: offsets, weights, chunking, the gradient computed in the forward
(equal to the previous checkpointed implementation, kept here as the reference), accuracy and tau."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from training.model.loss import accept_lengths, block_loss, offset_weights, tau_from_accuracy

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


def _problem(
    seed: int, bias: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5 * 4, 16, generator=g)
    labels = torch.randint(0, 50, (2, 20), generator=g)
    mask = torch.rand(2, 20, generator=g) > 0.3
    lm_head = nn.Linear(16, 50, bias=bias, dtype=dtype)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(50, 16, generator=g))
        if bias:
            lm_head.bias.copy_(torch.randn(50, generator=g))
    return hidden, labels, mask, lm_head


def _previous_chunk_loss(
    hidden: Tensor, labels: Tensor, weights: Tensor, lm_head: nn.Module
) -> tuple[Tensor, Tensor]:
    weight = getattr(lm_head, "weight", None)
    logits = lm_head(hidden if weight is None else hidden.to(weight.dtype)).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(dim=-1) == labels


def previous_block_loss(
    hidden: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    lm_head: nn.Module,
    *,
    block_size: int,
    gamma: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """The implementation before the gradient moved into the forward: F.cross_entropy on float32
    logits, each chunk under non-reentrant activation checkpointing. (loss, correct, count,
    accepted, blocks)."""
    n, q_len, _ = hidden.shape
    offsets = (torch.arange(q_len) % block_size).expand(n, q_len)
    mask = label_mask.bool() & (offsets > 0)
    flat_h, flat_labels, flat_off = hidden[mask], labels[mask], offsets[mask]
    flat_w = offset_weights(block_size, gamma)[flat_off]
    count = torch.bincount(flat_off - 1, minlength=block_size - 1)[: block_size - 1]
    total = hidden.new_zeros((), dtype=torch.float32)
    parts = []
    for start in range(0, flat_h.shape[0], chunk_size):
        stop = min(start + chunk_size, flat_h.shape[0])
        args = (flat_h[start:stop], flat_labels[start:stop], flat_w[start:stop], lm_head)
        part, corr = checkpoint(_previous_chunk_loss, *args, use_reentrant=False)
        total = total + part
        parts.append(corr)
    flags = torch.cat(parts)
    correct = torch.bincount(flat_off[flags] - 1, minlength=block_size - 1)[: block_size - 1]
    accepted, blocks = accept_lengths(mask, flags, block_size)
    return total / flat_w.sum(), correct, count, accepted, blocks


@pytest.mark.parametrize(
    ("chunk", "bias", "frozen"), [(1, False, True), (3, False, False), (7, True, False), (10_000, True, True)]
)
def test_loss_and_gradients_equal_the_previous_checkpointed_implementation(
    chunk: int, bias: bool, frozen: bool
) -> None:
    hidden, labels, mask, lm_head = _problem(chunk, bias)
    lm_head.requires_grad_(not frozen)
    results = []
    for loss_fn in (block_loss, previous_block_loss):
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad(set_to_none=True)
        out = loss_fn(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=chunk)
        loss, correct, count, accepted, blocks = (
            (out.loss, out.correct, out.count, out.accepted, out.blocks) if loss_fn is block_loss else out
        )
        (loss * 3.0).backward()  # a scale on the way back: the saved gradients are multiplied
        grads = [None if p.grad is None else p.grad.clone() for p in lm_head.parameters()]
        results.append((loss.detach(), h.grad.clone(), grads, correct, count, (accepted, blocks)))
    new, ref = results
    torch.testing.assert_close(new[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new[1], ref[1], rtol=1e-5, atol=1e-6)
    for got, want in zip(new[2], ref[2], strict=True):
        assert (got is None) == (want is None) == frozen
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(new[3], ref[3]) and torch.equal(new[4], ref[4]) and new[5] == ref[5]


def test_bf16_lm_head_matches_the_previous_implementation_within_bf16_rounding() -> None:
    """The drafter's case: a frozen bf16 lm_head, float32 hidden states."""
    hidden, labels, mask, lm_head = _problem(5, dtype=torch.bfloat16)
    lm_head.requires_grad_(False)
    outs = []
    for loss_fn in (block_loss, previous_block_loss):
        h = hidden.clone().requires_grad_(True)
        out = loss_fn(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=3)
        loss = out.loss if loss_fn is block_loss else out[0]
        loss.backward()
        assert h.grad.dtype == torch.float32
        outs.append((loss.detach(), h.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=2e-2, atol=1e-4)


def test_chunked_loss_equals_unchunked_loss_and_gradients() -> None:
    hidden, labels, mask, lm_head = _problem(0)
    results = []
    for chunk_size in (10_000, 1, 3, 7):
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad()
        out = block_loss(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=chunk_size)
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


class _Matmuls(TorchDispatchMode):
    """The output shapes of every matmul run."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.shapes.append(tuple(out.shape))
        return out


def test_logits_exist_one_chunk_at_a_time_and_a_frozen_head_runs_two_matmuls_per_chunk() -> None:
    hidden, labels, mask, lm_head = _problem(0)
    lm_head.requires_grad_(False)
    h = hidden.clone().requires_grad_(True)
    with _Matmuls() as forward:
        out = block_loss(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=4)
    chunks = math.ceil(int(out.count.sum()) / 4)
    logits = [s for s in forward.shapes if s[-1] == 50]
    assert len(logits) == chunks and max(s[0] for s in logits) <= 4  # [<=4, V]: one chunk at a time
    assert len(forward.shapes) == 2 * chunks  # the logits and the input gradient; nothing else
    with _Matmuls() as backward:
        out.loss.backward()
    assert backward.shapes == []  # no recomputation: the backward scales the saved gradient
    with torch.no_grad(), _Matmuls() as no_grad:
        block_loss(h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=4)
    assert len(no_grad.shapes) == chunks  # no gradient work without grad mode


def test_the_fused_softmax_chunk_equals_cross_entropy_and_its_autograd_gradient() -> None:
    """``softmax_chunk`` (the loss chunk written for the compiler) against F.cross_entropy and the
    gradient autograd gives it, in float32 and from bf16 logits."""
    from training.model.loss import softmax_chunk

    g = torch.Generator().manual_seed(3)
    for dtype, tol in (
        (torch.float32, {"rtol": 1e-5, "atol": 1e-6}),
        (torch.bfloat16, {"rtol": 1e-2, "atol": 1e-3}),
    ):
        logits = (torch.randn(9, 50, generator=g) * 4).to(dtype)
        labels = torch.randint(0, 50, (9, 1), generator=g)
        weights = torch.rand(9, 1, generator=g)
        total, correct, grad = softmax_chunk(logits, labels, weights, True)
        ref_logits = logits.float().requires_grad_(True)
        ce = F.cross_entropy(ref_logits, labels[:, 0], reduction="none")
        ref_total = (ce * weights[:, 0]).sum()
        ref_total.backward()
        torch.testing.assert_close(total, ref_total.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(correct, ref_logits.argmax(dim=-1) == labels[:, 0])
        assert grad is not None and grad.dtype == dtype
        torch.testing.assert_close(grad.float(), ref_logits.grad, **tol)
        assert softmax_chunk(logits, labels, weights, False)[2] is None


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


def _smoothed_reference(
    hidden: Tensor, labels: Tensor, label_mask: Tensor, lm_head: nn.Module, eps: float
) -> Tensor:
    """The smoothed block loss in one piece: ``F.cross_entropy(..., label_smoothing=eps)`` of every
    labelled position's float32 logits, weighted by offset and normalised as ``block_loss``."""
    offsets = (torch.arange(labels.shape[1]) % 4).expand_as(labels)
    mask = label_mask & (offsets > 0)
    logits = lm_head(hidden[mask]).float()
    ce = F.cross_entropy(logits, labels[mask], reduction="none", label_smoothing=eps)
    weights = offset_weights(4, 7.0)[offsets[mask]]
    return (ce * weights).sum() / weights.sum()


@pytest.mark.parametrize(
    ("eps", "bias", "frozen"),
    [(0.0, False, True), (0.1, False, True), (0.0, True, False), (0.1, True, False)],
)
def test_label_smoothing_equals_torch_cross_entropy_and_its_gradients(
    eps: float, bias: bool, frozen: bool
) -> None:
    """``label_smoothing`` = eps: the loss and the gradients of the hidden states and (when it
    needs one) the lm_head are those autograd gives ``F.cross_entropy(label_smoothing=eps)``;
    chunks of 7 leave a shorter last chunk."""
    hidden, labels, mask, lm_head = _problem(11, bias)
    lm_head.requires_grad_(not frozen)
    results = []
    for smoothed in (True, False):
        h = hidden.clone().requires_grad_(True)
        lm_head.zero_grad(set_to_none=True)
        if smoothed:
            out = block_loss(
                h, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=7, label_smoothing=eps
            )
            assert out.labelled % 7 != 0 and out.labelled > 7
            loss = out.loss
        else:
            loss = _smoothed_reference(h, labels, mask, lm_head, eps)
        (loss * 3.0).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in lm_head.parameters()]
        results.append((loss.detach(), h.grad.clone(), grads))
    (loss, grad_h, grads), (ref_loss, ref_grad_h, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h, ref_grad_h, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got is None) == (want is None) == frozen
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_label_smoothing_changes_the_loss_not_the_accuracy() -> None:
    """Smoothing raises the loss of a confident drafter (it pays for the mass it keeps off the
    alternatives), and the argmax figures stay those of the unsmoothed loss."""
    hidden, labels, mask, lm_head = _problem(12)
    plain, smoothed = (
        block_loss(hidden, labels, mask, lm_head, block_size=4, gamma=7.0, chunk_size=5, label_smoothing=eps)
        for eps in (0.0, 0.2)
    )
    assert smoothed.loss.item() != pytest.approx(plain.loss.item(), rel=1e-3)
    assert torch.equal(smoothed.correct, plain.correct) and torch.equal(smoothed.count, plain.count)
    assert (smoothed.accepted, smoothed.blocks) == (plain.accepted, plain.blocks)


def test_the_fused_softmax_chunk_with_label_smoothing_equals_cross_entropy() -> None:
    """``softmax_chunk``'s smoothed loss and gradient (what the compiled full chunks run) against
    ``F.cross_entropy(label_smoothing=0.1)`` and the gradient autograd gives it, in float32."""
    from training.model.loss import softmax_chunk

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 50, generator=g) * 4
    labels = torch.randint(0, 50, (9, 1), generator=g)
    weights = torch.rand(9, 1, generator=g)
    total, correct, grad = softmax_chunk(logits, labels, weights, True, 0.1)
    ref_logits = logits.clone().requires_grad_(True)
    ce = F.cross_entropy(ref_logits, labels[:, 0], reduction="none", label_smoothing=0.1)
    ref_total = (ce * weights[:, 0]).sum()
    ref_total.backward()
    torch.testing.assert_close(total, ref_total.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, logits.argmax(dim=-1) == labels[:, 0])
    assert grad is not None
    torch.testing.assert_close(grad, ref_logits.grad, rtol=1e-5, atol=1e-6)
