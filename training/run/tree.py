"""DDTree's draft tree: built from the drafter's per-position distributions, verified in one pass.

DDTree (Ringel & Romano, arXiv 2604.12989; reference code ``liranringel/ddtree`` ``ddtree.py``)
turns one DFlash round's ``L`` per-position distributions after the root (the anchor, the
previous round's bonus token) into a tree of at most ``B`` nodes:

- ``build_tree`` is Algorithm 1 as ``build_ddtree_tree`` runs it: a best-first heap over rank
  tuples pops the ``B`` prefixes with the largest summed log-probability (the root is not counted
  in ``B``); nodes are numbered in pop order, so a parent's index is below its children's. Ties in
  the summed log-probability pop the lexicographically smaller rank tuple first (the reference's
  heap key is ``(-logw, ranks)``), and the sums are accumulated in the reference's order
  (``sibling = logw - lp[rank] + lp[rank + 1]``, ``child = logw + lp[depth][0]``) so near-ties
  pop as they do there. Budget 0 is the chain: the top-1 token at every depth (DFlash's block).
- ``tree_attention_mask`` / ``tree_position_ids`` are ``compile_ddtree_tree``'s verify inputs: the
  target runs on ``[root, node 1..N]`` at positions ``start + depth`` with an additive mask where
  every tree token sees the whole verified prefix, and inside the tree its ancestors and itself.
- ``follow_tree`` is ``follow_verified_tree``: from the root, descend while the target's token at
  the current node is one of its children; the first token that is not is the bonus.
- ``accepted_along`` is the same walk against a known greedy continuation (greedy replay: at
  temperature 0 the committed tokens are the target's greedy continuation whatever the tree).

Pure and torch-only: no model here (``training.run.eval`` runs the rounds).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

ROOT = 0  # the root's index in parents: node i of ``tokens`` is index i + 1


@dataclass(frozen=True, eq=False)  # eq below: tokens is a tensor
class DraftTree:
    """One round's draft tree, the root (the anchor) excluded.

    ``tokens[i]`` is node ``i + 1``'s token; ``parents[i]`` its parent's index in
    ``[root = 0, node 1, ..., node N]`` (always below ``i + 1``); ``depths[i]`` its depth
    (1..L: the root is depth 0)."""

    tokens: Tensor  # [N] long, on the CPU
    parents: tuple[int, ...]
    depths: tuple[int, ...]

    def __post_init__(self) -> None:
        n = int(self.tokens.numel())
        if self.tokens.dim() != 1 or len(self.parents) != n or len(self.depths) != n:
            raise ValueError(
                f"DraftTree: tokens {tuple(self.tokens.shape)}, {len(self.parents)} parents and "
                f"{len(self.depths)} depths must all be N long"
            )
        for i, (parent, depth) in enumerate(zip(self.parents, self.depths, strict=True)):
            parent_depth = 0 if parent == ROOT else self.depths[parent - 1] if 0 < parent <= i else -1
            if parent_depth < 0 or depth != parent_depth + 1:
                raise ValueError(f"DraftTree: node {i + 1} has parent {parent} and depth {depth}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        return (
            self.parents == other.parents
            and self.depths == other.depths
            and torch.equal(self.tokens.cpu(), other.tokens.cpu())
        )

    @property
    def size(self) -> int:
        """N: the nodes besides the root."""
        return len(self.parents)

    @cached_property
    def children(self) -> tuple[dict[int, int], ...]:
        """Per index (root = 0): child token -> child index (``build_ddtree_tree``'s child_maps)."""
        maps: list[dict[int, int]] = [{} for _ in range(self.size + 1)]
        for i, (token, parent) in enumerate(zip(self.tokens.tolist(), self.parents, strict=True)):
            maps[parent][int(token)] = i + 1
        return tuple(maps)


def draft_topk(logits: Tensor, k: int, temperatures: Sequence[float] | None = None) -> tuple[Tensor, Tensor]:
    """The top-``k`` log-probabilities and tokens of every depth: logits [..., L, V] -> two
    [..., L, min(k, V)] tensors (float32 and long, on ``logits``' device).

    As ``build_ddtree_tree``: ``topk`` of the float32 logits minus their ``logsumexp`` (the
    log-softmax at the top ``k``). ``temperatures`` (one per depth, > 0): depth ``d``'s logits are
    divided by ``temperatures[d]`` first, a calibration of the drafter's marginals; None = the raw
    logits, as the reference (the drafter is not temperature-scaled there)."""
    if k < 1:
        raise ValueError(f"draft_topk: k={k} must be >= 1")
    scaled = logits.float()
    if temperatures is not None:
        if len(temperatures) != scaled.shape[-2] or any(t <= 0 for t in temperatures):
            raise ValueError(
                f"draft_topk: {len(temperatures)} temperatures for {scaled.shape[-2]} depths; "
                "give one > 0 per depth"
            )
        scale = torch.tensor(list(temperatures), dtype=torch.float32, device=scaled.device)
        scaled = scaled / scale[:, None]
    top, tokens = torch.topk(scaled, k=min(k, scaled.shape[-1]), dim=-1)
    return top - torch.logsumexp(scaled, dim=-1, keepdim=True), tokens


def build_tree(top_logprobs: Tensor, top_tokens: Tensor, budget: int) -> DraftTree:
    """Algorithm 1 (``build_ddtree_tree``): the ``budget`` most probable prefixes of the drafter's
    factorised distribution, from its top-``K`` log-probabilities and tokens per depth ([L, K],
    ranks in descending order, as ``draft_topk`` gives). Only ranks below ``min(budget, K)`` are
    used (Lemma 1: no deeper rank can be among the top ``budget``). ``budget`` 0: the chain of the
    top-1 tokens, L nodes."""
    if top_logprobs.dim() != 2 or top_logprobs.shape != top_tokens.shape:
        raise ValueError(
            f"build_tree: top_logprobs {tuple(top_logprobs.shape)} and top_tokens "
            f"{tuple(top_tokens.shape)} must both be [L, K]"
        )
    if budget < 0:
        raise ValueError(f"build_tree: budget={budget} must be >= 0")
    depth_limit = int(top_tokens.shape[0])
    tokens = top_tokens.detach().to("cpu", torch.long)
    if budget == 0 or depth_limit == 0:
        n = depth_limit if budget == 0 else 0
        return DraftTree(tokens[:n, 0].clone(), tuple(range(n)), tuple(range(1, n + 1)))
    topk = min(budget, int(top_tokens.shape[1]))
    lp = top_logprobs.detach().to("cpu", torch.float32)[:, :topk].tolist()
    ids = tokens[:, :topk].tolist()
    first = float(lp[0][0])
    # (-logw, ranks, parent index, depth, rank, logw): the reference's heap entry and order
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-first, (0,), ROOT, 1, 0, first)]
    node_tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    while heap and len(node_tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        node_tokens.append(int(ids[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        index = len(node_tokens)
        if rank + 1 < topk:
            sibling = logw - float(lp[depth - 1][rank]) + float(lp[depth - 1][rank + 1])
            heapq.heappush(heap, (-sibling, (*ranks[:-1], rank + 1), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = logw + float(lp[depth][0])
            heapq.heappush(heap, (-child, (*ranks, 0), index, depth + 1, 0, child))
    return DraftTree(torch.tensor(node_tokens, dtype=torch.long), tuple(parents), tuple(depths))


def tree_visibility(tree: DraftTree) -> Tensor:
    """[N+1, N+1] bool: row ``i`` sees column ``j`` iff ``j`` is ``i`` or one of its ancestors
    (``build_ddtree_tree``'s visibility: a node's row is its parent's plus itself)."""
    n = tree.size + 1
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[0, 0] = True
    for index, parent in enumerate(tree.parents, start=1):
        visible[index, :index] = visible[parent, :index]
        visible[index, index] = True
    return visible


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """The verify pass's additive mask [1, 1, N+1, past+N+1] (``compile_ddtree_tree``): 0 where a
    query of ``[root, nodes]`` may attend, the dtype's minimum elsewhere; every query sees the
    ``past`` verified tokens, and inside the tree its ancestors and itself."""
    n = tree.size + 1
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~tree_visibility(tree), torch.finfo(dtype).min)
    return mask.to(device)


def tree_position_ids(tree: DraftTree, start: int) -> Tensor:
    """[1, N+1] long: the root at ``start``, each node at ``start + depth``."""
    return torch.tensor([[start, *(start + d for d in tree.depths)]], dtype=torch.long)


def follow_tree(tree: DraftTree, target_tokens: Sequence[int] | Tensor) -> tuple[list[int], int]:
    """The accepted path and the bonus token (``follow_verified_tree``).

    ``target_tokens[i]`` (N+1 of them): the target's token after index ``i`` of ``[root, nodes]``
    (its greedy or sampled choice at that query of the verify pass). Returns the accepted indices
    root first, the root (0) included, so ``len`` is the round's tau (accepted drafts + 1); and the
    target's token after the last of them: the next round's root."""
    chosen = target_tokens.tolist() if isinstance(target_tokens, Tensor) else list(target_tokens)
    if len(chosen) != tree.size + 1:
        raise ValueError(
            f"follow_tree: {len(chosen)} target tokens for a tree of {tree.size + 1} (root + nodes)"
        )
    path = [ROOT]
    nxt = int(chosen[ROOT])
    while nxt in tree.children[path[-1]]:
        path.append(tree.children[path[-1]][nxt])
        nxt = int(chosen[path[-1]])
    return path, nxt


def accepted_along(tree: DraftTree, continuation: Sequence[int] | Tensor) -> int:
    """How many nodes of ``tree`` the greedy ``continuation`` (the tokens after the root, in order)
    follows as a root-to-node path: the round's accepted drafts (tau - 1) when the target's greedy
    choices are ``continuation``."""
    tokens = continuation.tolist() if isinstance(continuation, Tensor) else continuation
    index, accepted = ROOT, 0
    for token in tokens:
        child = tree.children[index].get(int(token))
        if child is None:
            break
        index, accepted = child, accepted + 1
    return accepted
