"""Per-depth temperatures of the drafter's distributions for DDTree's tree build (no retraining).

DDTree ranks a tree's prefixes by the product of the drafter's per-depth marginals (arXiv
2604.12989 Prop. 1-2; ``liranringel/ddtree`` ``ddtree.py`` ``build_ddtree_tree`` takes the raw
logits). A block-diffusion drafter's marginals are miscalibrated, differently at each depth
(rmagur1203/vllm-ddtree ``docs/DDTREE-FINDINGS-EN.md`` section 8: a stated 0.218 against a
measured 0.473 at depth 2, rank 1), so the tree spends its budget on the wrong branches. The
cheapest fix is temperature scaling per depth (Guo et al. 2017, "On Calibration of Modern Neural
Networks": one scalar fitted by the NLL on held data; Luce exposes one as ``--ddtree-temp``):

    T_d = argmin_T  mean over anchors of  -log softmax(logits_d / T)[y_d]

where ``logits_d`` is the drafter's logits at depth ``d`` (block offset ``d`` after the anchor)
and ``y_d`` the target's greedy token there (the token a greedy verify accepts), both on training
rows. The NLL is convex in ``1/T`` (a log-sum-exp of functions linear in ``1/T`` minus a linear
one), so a golden-section search over ``1/T`` finds the minimum (``fit_temperature``).
``training.run.tree.draft_topk`` applies them (``temperatures``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from training.model.drafter import DFlashDrafter, block_labels, target_context
from training.run.core import autocast_dtype

GOLDEN = (math.sqrt(5) - 1) / 2
# The search range of T: 0.05 (near-greedy) to 20 (near-uniform) covers every calibration reported.
T_RANGE = (0.05, 20.0)
CHUNK_ROWS = 1024  # logits rows per chunk of the NLL (rows x vocab floats at a time)


def mean_nll(logits: Tensor, labels: Tensor, inverse_t: float) -> float:
    """Mean of -log softmax(logits * inverse_t)[labels] over the rows of ``logits`` [N, V]."""
    total = 0.0
    for start in range(0, logits.shape[0], CHUNK_ROWS):
        z = logits[start : start + CHUNK_ROWS].float() * inverse_t
        y = labels[start : start + CHUNK_ROWS]
        total += float((torch.logsumexp(z, dim=-1) - z.gather(1, y[:, None])[:, 0]).sum())
    return total / max(int(logits.shape[0]), 1)


def fit_temperature(
    logits: Tensor, labels: Tensor, *, t_range: tuple[float, float] = T_RANGE, tolerance: float = 1e-4
) -> float:
    """The T minimising ``mean_nll(logits, labels, 1 / T)`` in ``t_range`` (golden-section search
    over 1/T, where the NLL is convex); 1.0 when there are no rows."""
    if logits.shape[0] == 0:
        return 1.0
    lo, hi = 1.0 / t_range[1], 1.0 / t_range[0]
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    fa, fb = mean_nll(logits, labels, a), mean_nll(logits, labels, b)
    while hi - lo > tolerance * max(1.0, lo):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - GOLDEN * (hi - lo)
            fa = mean_nll(logits, labels, a)
        else:
            lo, a, fa = a, b, fb
            b = lo + GOLDEN * (hi - lo)
            fb = mean_nll(logits, labels, b)
    return 1.0 / ((lo + hi) / 2)


def fit_depth_temperatures(logits: Tensor, labels: Tensor, valid: Tensor) -> tuple[float, ...]:
    """One temperature per depth: ``logits`` [N, L, V] (N anchors, depths 1..L), ``labels`` [N, L],
    ``valid`` [N, L] bool (a depth past the row's end or outside its loss mask does not count)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2] or valid.shape != labels.shape:
        raise ValueError(
            f"fit_depth_temperatures: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and "
            f"valid {tuple(valid.shape)} must be [N, L, V], [N, L], [N, L]"
        )
    return tuple(
        fit_temperature(logits[valid[:, d], d], labels[valid[:, d], d]) for d in range(logits.shape[1])
    )


@torch.no_grad()
def depth_logits(
    target: torch.nn.Module,
    drafter: DFlashDrafter,
    batches: Iterable[tuple[Tensor, Tensor, Tensor]],
    max_anchors: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter's logits at every depth of anchors on training rows, with the target's greedy
    token there: (logits [N, L, V] in the target's dtype, labels [N, L], valid [N, L]); at most
    ``max_anchors`` anchors. ``batches``: (input_ids [B, T], loss_mask [B, T], anchors [B, K]), on
    the target's device (the trainer's own anchors of its batches). The target's greedy token at
    depth ``d`` of the anchor at ``a`` is its argmax after position ``a + d - 1`` under the row's
    true prefix: what a greedy verify of that block accepts."""
    was_training = drafter.training
    drafter.eval()
    layers = drafter.target_layer_ids
    bs = drafter.cfg.block_size
    device = next(iter(drafter.parameters())).device
    amp = autocast_dtype(device)
    found: list[tuple[Tensor, Tensor, Tensor]] = []
    count = 0
    try:
        for ids, loss_mask, anchors in batches:
            out = target(input_ids=ids, output_hidden_states=True)
            greedy = out.logits.argmax(dim=-1)  # [B, T]: the target's token after each position
            hidden = target_context(out.hidden_states, layers)
            del out
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                states = drafter.block_hidden(ids, hidden, anchors)  # [B, K*bs, H]
            b, k = anchors.shape
            states = states.view(b, k, bs, -1)[:, :, 1:]
            _, label_mask = block_labels(ids, loss_mask, anchors, bs)
            valid = label_mask.view(b, k, bs)[:, :, 1:]
            positions = (anchors.clamp(min=0)[:, :, None] + torch.arange(bs - 1, device=ids.device)).clamp(
                max=ids.shape[1] - 1
            )  # a + d - 1 for d = 1..L
            labels = greedy.gather(1, positions.view(b, -1)).view(b, k, bs - 1)
            keep = valid.any(dim=-1) & (anchors >= 0)
            left = max_anchors - count  # the lm_head only on the anchors kept: [N, L, V] is large
            rows, labels, valid = states[keep][:left], labels[keep][:left], valid[keep][:left]
            found.append((drafter.lm_head(rows.to(drafter.lm_head.weight.dtype)), labels, valid))
            count += int(rows.shape[0])
            if count >= max_anchors:
                break
    finally:
        drafter.train(was_training)
    if not found:
        raise ValueError("depth_logits: no anchor with a labelled depth in the batches")
    logits, labels, valid = (torch.cat(parts) for parts in zip(*found, strict=True))
    return logits, labels, valid


def temperatures_text(temperatures: Sequence[float]) -> str:
    """``depth 1: 1.23, depth 2: 1.41, ...``."""
    return ", ".join(f"depth {d}: {t:.3f}" for d, t in enumerate(temperatures, start=1))
