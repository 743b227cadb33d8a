"""The DFlash block loss: weighted cross-entropy on block offsets 1..B-1, chunked.

Block offset ``k`` (query ``k`` of a block anchored at ``a``) predicts the token at
``a + k``; offset 0 holds the given anchor token and has no loss. The loss weight of
offset ``k >= 1`` is ``exp(-(k - 1) / gamma)`` (offset 1 weighs 1). The loss is the
weighted mean over every labelled position in the batch:

    loss = sum_i w(k_i) * CE(logits_i, label_i) / sum_i w(k_i)

With label smoothing ``eps`` (``drafter.label_smoothing``; 0 = the plain CE above) each row's CE
is taken against ``(1 - eps) * onehot(label) + eps / V`` instead of the one-hot, PyTorch's
definition (``F.cross_entropy(..., label_smoothing=eps)``): ``(1 - eps) * CE(label) + eps *
mean_v(-log p_v)``, whose gradient w.r.t. the logits is ``softmax - ((1 - eps) * onehot + eps / V)``.
It spreads probability over the alternatives beyond the top-1, which DDTree's tree ranks
(``training/run/tree.py``); accuracy and the tau estimate below stay argmax figures.

The shared lm_head and the cross-entropy run in chunks of ``chunk_size`` positions, and each
chunk's gradient is computed in the same pass (``_LinearCrossEntropy``): only one chunk's
[chunk x vocab] logits exist at a time (its bf16 matmul output and one float32 copy, turned
into the softmax gradient in place), never the whole [tokens x vocab] matrix, and the backward
only scales the saved [tokens x hidden] gradient. The lm_head's matmul runs twice per chunk
(the logits, the input gradient), not three times as under activation checkpointing (forward,
recomputed forward, input gradient); the frozen lm_head's weight gradient is computed only
when it requires one. The softmax is taken in float32.

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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class BlockLoss:
    """Result of ``block_loss``: the scalar loss and per-offset counts (offsets 1..B-1)."""

    loss: Tensor  # scalar, differentiable
    correct: Tensor  # [B-1] long: argmax == label, per offset
    count: Tensor  # [B-1] long: labelled positions, per offset
    accepted: int = 0  # sum over blocks of the accepted length (module docstring)
    blocks: int = 0  # blocks with a labelled offset 1
    labelled: int = 0  # labelled positions (count.sum(), known on the host without a sync)

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


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(lm_head(h_i), y_i)`` (label-smoothed by ``smoothing``) over chunks of
    rows, with the gradients of ``h`` (and of the lm_head's weight and bias, where they require
    one) computed chunk by chunk in the forward; also returns the rows' ``argmax == label``
    flags (not differentiable).

    Per chunk: logits in the weight's dtype (the lm_head's own matmul), one float32 copy for
    logsumexp, label logit and argmax; then, when a gradient is needed, that copy becomes
    ``w * (softmax - onehot)`` in place (``onehot`` smoothed: ``(1 - eps) * onehot + eps / V``)
    and is multiplied back through the weight. The backward multiplies the saved gradients by
    the incoming scalar."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        row_weights: Tensor,
        chunk_size: int,
        want_grad: bool,
        compiled: str | None,
        smoothing: float,
    ) -> tuple[Tensor, Tensor]:
        need_h = want_grad and ctx.needs_input_grad[0]
        need_w = want_grad and ctx.needs_input_grad[1]
        need_b = want_grad and bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        # The compiled softmax serves the full chunks (one shape: no recompiles as the number of
        # labelled rows changes); the last, shorter chunk and a gradient of the weight or bias
        # (not the drafter's frozen lm_head) take the eager path below.
        fused = _compiled_chunk(compiled) if grad_w is None and grad_b is None else None
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:stop].to(weight.dtype)
            y = labels[start:stop, None]
            w = row_weights[start:stop, None].float()
            if fused is not None and stop - start == chunk_size:
                logits = F.linear(h, weight, bias)
                part, correct[start:stop], grad_logits = fused(logits, y, w, need_h, smoothing)
                total += part
                if grad_h is not None:
                    grad_h[start:stop] = grad_logits @ weight
                continue
            logits = F.linear(h, weight, bias).float()  # [c, V]: the one float32 copy
            correct[start:stop] = logits.argmax(dim=-1) == y[:, 0]
            picked = logits.gather(1, y)
            if smoothing:  # the target's mean logit: (1 - eps) * the label's + eps * the mean over V
                picked = picked.lerp_(logits.mean(dim=-1, keepdim=True), smoothing)
            top = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(top).exp_()  # in place: exp(logit - max)
            norm = exp.sum(dim=-1, keepdim=True)
            total += ((top + norm.log() - picked) * w).sum()  # logsumexp - the target's mean logit
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            if smoothing:  # w * (softmax - (1 - eps) * onehot - eps / V), in place
                grad = exp.mul_(w / norm).sub_(w * (smoothing / exp.shape[1]))
                grad.scatter_add_(1, y, w * (smoothing - 1.0))
            else:
                grad = exp.mul_(w / norm).scatter_add_(1, y, -w)  # w * (softmax - onehot), in place
            grad_logits = grad.to(weight.dtype)
            if grad_h is not None:
                grad_h[start:stop] = grad_logits @ weight
            if grad_w is not None:
                grad_w += (grad_logits.t() @ h).float()
            if grad_b is not None:
                grad_b += grad.sum(dim=0)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)))
        ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _grad_correct: Tensor | None) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        grads = [
            (g * grad_total).to(dtype) if present else None
            for g, present, dtype in zip(saved, ctx.present, ctx.dtypes, strict=True)
        ]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None


def softmax_chunk(
    logits: Tensor, labels: Tensor, row_weights: Tensor, want_grad: bool, smoothing: float = 0.0
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk of ``_LinearCrossEntropy`` after its lm_head matmul, written to be compiled:
    (``sum_i w_i * CE``, ``argmax == label`` [c], ``w * (softmax - onehot)`` in the logits' dtype
    or None), ``onehot`` smoothed to ``(1 - eps) * onehot + eps / V`` by ``smoothing`` = eps (a
    constant of the run: the compiled graph specialises on it). logits [c, V], labels [c, 1],
    row_weights [c, 1] float32. The float32 logits, the exponentials and the gradient are never
    all in memory: the compiler fuses them into a reduction pass and a pointwise pass over the
    logits."""
    lf = logits.float()
    correct = lf.argmax(dim=-1) == labels[:, 0]
    picked = lf.gather(1, labels)
    if smoothing:
        picked = picked.lerp(lf.mean(dim=-1, keepdim=True), smoothing)
    top = lf.amax(dim=-1, keepdim=True)
    exp = (lf - top).exp()
    norm = exp.sum(dim=-1, keepdim=True)
    total = ((top + norm.log() - picked) * row_weights).sum()
    if not want_grad:
        return total, correct, None
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == labels
    target = onehot.to(lf.dtype)
    if smoothing:
        target = target * (1.0 - smoothing) + smoothing / lf.shape[1]
    grad = (exp / norm - target) * row_weights
    return total, correct, grad.to(logits.dtype)


_COMPILED_CHUNK: dict[str, Any] = {}  # per compile mode, built once per process


def _compiled_chunk(mode: str | None) -> Any:
    """``softmax_chunk`` compiled (``dynamic=False``: the chunk's one shape), None when eager."""
    if mode is None:
        return None
    if mode not in _COMPILED_CHUNK:
        _COMPILED_CHUNK[mode] = torch.compile(
            softmax_chunk, dynamic=False, mode=None if mode == "default" else mode
        )
    return _COMPILED_CHUNK[mode]


def linear_cross_entropy(
    hidden: Tensor,
    lm_head: nn.Module,
    labels: Tensor,
    row_weights: Tensor,
    chunk_size: int,
    compiled: str | None = None,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(``sum_i w_i * CE(lm_head(h_i), y_i)`` float32 scalar, [M] bool ``argmax == y``) of rows
    ``hidden`` [M, H], ``chunk_size`` rows at a time (``_LinearCrossEntropy``); ``compiled``: a
    compile mode for the full chunks' softmax (``softmax_chunk``), None = eager;
    ``label_smoothing``: eps of the smoothed CE (module docstring), 0 = plain CE."""
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
    want_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)  # not in eval/no_grad
    args = (hidden, weight, bias, labels, row_weights, chunk_size, want_grad, compiled, label_smoothing)
    return _LinearCrossEntropy.apply(*args)


def block_loss(
    hidden: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    lm_head: nn.Module,
    *,
    block_size: int,
    gamma: float,
    chunk_size: int,
    compiled: str | None = None,
    label_smoothing: float = 0.0,
) -> BlockLoss:
    """Weighted, chunked block CE.

    hidden [N, Q, H] (Q = K*block_size, block-major), labels [N, Q] long, label_mask [N, Q]
    bool (offset 0 and unlabelled positions False). ``chunk_size`` counts positions.
    ``lm_head``: a linear layer (``weight`` [V, H], optional ``bias``). ``label_smoothing``: eps
    in [0, 1) of the smoothed CE (module docstring); 0 = plain CE.
    """
    if chunk_size < 1:
        raise ValueError(f"block_loss: chunk_size={chunk_size} must be >= 1")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"block_loss: label_smoothing={label_smoothing} must be in [0, 1)")
    n, q_len, _ = hidden.shape
    offsets = (torch.arange(q_len, device=hidden.device) % block_size).expand(n, q_len)
    mask = label_mask.bool() & (offsets > 0)
    rows = mask.reshape(-1).nonzero().squeeze(1)  # the labelled positions, row-major: one host sync
    flat_h = hidden.reshape(n * q_len, -1).index_select(0, rows)  # [M, H]
    flat_labels = labels.reshape(-1).index_select(0, rows)
    flat_off = offsets.reshape(-1).index_select(0, rows)
    w_table = offset_weights(block_size, gamma, hidden.device)
    flat_w = w_table[flat_off]
    count = torch.bincount(flat_off - 1, minlength=block_size - 1)[: block_size - 1]
    m = flat_h.shape[0]
    if m == 0:
        zero = hidden.sum() * 0.0
        return BlockLoss(loss=zero, correct=torch.zeros_like(count), count=count)
    total, correct_flags = linear_cross_entropy(
        flat_h, lm_head, flat_labels, flat_w, chunk_size, compiled, label_smoothing
    )
    correct = torch.bincount(flat_off[correct_flags] - 1, minlength=block_size - 1)[: block_size - 1]
    loss = total / flat_w.sum()
    accepted, blocks = accept_lengths(mask, correct_flags, block_size)
    return BlockLoss(loss=loss, correct=correct, count=count, accepted=accepted, blocks=blocks, labelled=m)


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
    accepted, blocks = torch.stack([(run.sum(dim=-1) * counted).sum(), counted.sum()]).tolist()  # one sync
    return int(accepted), int(blocks)
