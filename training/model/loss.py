"""The DFlash block loss: weighted cross-entropy on block offsets 1..B-1, chunked.

Block offset ``k`` (query ``k`` of a block anchored at ``a``) predicts the token at
``a + k``; offset 0 holds the given anchor token and has no loss. The loss weight of
offset ``k >= 1`` is ``exp(-(k - 1) / gamma)`` (offset 1 weighs 1). The loss is the
weighted mean over every labelled position in the batch:

    loss = sum_i w(k_i) * CE(logits_i, label_i) / sum_i w(k_i)

The shared lm_head and the cross-entropy run in chunks of ``chunk_size`` positions, each
under ``torch.utils.checkpoint(use_reentrant=False)``: only one chunk's [chunk x vocab]
logits exist at a time, in the forward and again in the backward (recomputed), never the
whole [tokens x vocab] matrix. Logits are computed in float32 for the softmax.

Accuracy per offset: the share of labelled positions at offset ``k`` whose argmax equals
the label; offsets with no labelled position report 0.

Acceptance estimate: per block, the length of its run of correct argmaxes from offset 1
(unlabelled offsets count as correct, so a block cut by the sequence end is not penalised),
as SpecForge's ``compute_accept_len`` (``specforge/algorithms/common/dflash_family_model.py``:
``(pred == target) | ~valid``, ``cumprod``, times ``valid``, summed); ``tau = 1 + mean over
blocks``. Unlike a product of per-offset accuracies, this keeps which drafts fail together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class BlockLoss:
    """Result of ``block_loss``: the scalar loss and per-offset counts (offsets 1..B-1)."""

    loss: Tensor  # scalar, differentiable
    correct: Tensor  # [B-1] long: argmax == label, per offset
    count: Tensor  # [B-1] long: labelled positions, per offset
    accepted: int = 0  # sum over blocks of the accepted length (module docstring)
    blocks: int = 0  # blocks with a labelled offset 1

    @property
    def tau_estimate(self) -> float:
        """1 + the mean accepted length per block (1.0 with no block)."""
        return 1.0 + self.accepted / max(self.blocks, 1)

    @property
    def acc_per_offset(self) -> Tensor:
        """[B-1] float accuracy per offset (0 where an offset has no labelled position)."""
        return self.correct.double().div(self.count.clamp(min=1).double()).float()


def offset_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """[block_size] float: 0 for offset 0, exp(-(k-1)/gamma) for offset k >= 1."""
    k = torch.arange(block_size, dtype=torch.float64, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.float()


def tau_from_accuracy(acc: Tensor | list[float]) -> float:
    """Expected acceptance length implied by per-offset accuracies (offsets 1..B-1).

    ``tau = 1 + sum_{k=1}^{B-1} prod_{j<=k} acc_j``: a round accepts draft k only when
    drafts 1..k all match (treating offsets as independent), and every round yields one
    bonus token from the target. Range [1, B], the same scale as the real tau of ``training.run.eval``.
    """
    values = [float(x) for x in (acc.tolist() if isinstance(acc, Tensor) else acc)]
    total, run = 1.0, 1.0
    for a in values:
        run *= a
        total += run
    return total


def _chunk_loss(hidden: Tensor, labels: Tensor, weights: Tensor, lm_head: nn.Module) -> tuple[Tensor, Tensor]:
    weight = getattr(lm_head, "weight", None)
    logits = lm_head(hidden if weight is None else hidden.to(weight.dtype)).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(dim=-1) == labels
    return (ce * weights).sum(), correct


def block_loss(
    hidden: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    lm_head: nn.Module,
    *,
    block_size: int,
    gamma: float,
    chunk_size: int,
    checkpointed: bool = True,
) -> BlockLoss:
    """Weighted, chunked block CE.

    hidden [N, Q, H] (Q = K*block_size, block-major), labels [N, Q] long, label_mask [N, Q]
    bool (offset 0 and unlabelled positions False). ``chunk_size`` counts positions.
    ``checkpointed=False`` computes the same chunks without recomputation (test reference).
    """
    if chunk_size < 1:
        raise ValueError(f"block_loss: chunk_size={chunk_size} must be >= 1")
    n, q_len, _ = hidden.shape
    offsets = (torch.arange(q_len, device=hidden.device) % block_size).expand(n, q_len)
    mask = label_mask.bool() & (offsets > 0)
    flat_h = hidden[mask]  # [M, H]
    flat_labels = labels[mask]
    flat_off = offsets[mask]
    w_table = offset_weights(block_size, gamma, hidden.device)
    flat_w = w_table[flat_off]
    count = torch.bincount(flat_off - 1, minlength=block_size - 1)[: block_size - 1]
    m = flat_h.shape[0]
    if m == 0:
        zero = hidden.sum() * 0.0
        return BlockLoss(loss=zero, correct=torch.zeros_like(count), count=count)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct_parts: list[Tensor] = []
    for start in range(0, m, chunk_size):
        stop = min(start + chunk_size, m)
        args = (flat_h[start:stop], flat_labels[start:stop], flat_w[start:stop], lm_head)
        if checkpointed and torch.is_grad_enabled() and flat_h.requires_grad:
            part, corr = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            part, corr = _chunk_loss(*args)
        total = total + part
        correct_parts.append(corr)
    correct_flags = torch.cat(correct_parts)
    correct = torch.bincount(flat_off[correct_flags] - 1, minlength=block_size - 1)[: block_size - 1]
    loss = total / flat_w.sum()
    accepted, blocks = accept_lengths(mask, correct_flags, block_size)
    return BlockLoss(loss=loss, correct=correct, count=count, accepted=accepted, blocks=blocks)


def accept_lengths(mask: Tensor, correct_flags: Tensor, block_size: int) -> tuple[int, int]:
    """(sum of accepted lengths, blocks counted): ``mask`` [N, K*B] labelled positions (offset 0
    False), ``correct_flags`` [M] argmax == label of the labelled positions in ``mask`` order."""
    n, q_len = mask.shape
    grid = torch.zeros(n, q_len, dtype=torch.bool, device=mask.device)
    grid[mask] = correct_flags.to(mask.device)
    valid = mask.view(n, q_len // block_size, block_size)[..., 1:]
    ok = grid.view(n, q_len // block_size, block_size)[..., 1:] | ~valid
    run = ok.long().cumprod(dim=-1) * valid.long()
    counted = valid[..., 0]  # a block whose first draft is labelled
    return int(run.sum(dim=-1)[counted].sum().item()), int(counted.sum().item())
