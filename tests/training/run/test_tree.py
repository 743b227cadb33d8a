"""DDTree's tree (training.run.tree) against independent implementations of its rules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from training.run.tree import (
    DraftTree,
    accepted_along,
    build_tree,
    draft_topk,
    follow_tree,
    tree_attention_mask,
    tree_position_ids,
)


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Every node's root-to-node token path, in node order."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents, strict=True):
        out.append((*(out[parent - 1] if parent else ()), int(token)))
    return out


def brute_force_top(logprobs: Tensor, budget: int) -> list[tuple[int, ...]]:
    """Every token prefix of length 1..L scored by its summed log-probabilities, best first:
    the top ``budget`` (no heap, no ranks, the whole vocabulary)."""
    L, V = logprobs.shape
    lp = logprobs.double().tolist()
    scored = [
        (sum(lp[d][t] for d, t in enumerate(prefix)), prefix)
        for depth in range(1, L + 1)
        for prefix in itertools.product(range(V), repeat=depth)
    ]
    scored.sort(key=lambda item: -item[0])
    return [prefix for _, prefix in scored[:budget]]


@pytest.mark.parametrize(("seed", "L", "V"), [(0, 3, 4), (1, 4, 3), (2, 2, 6)])
def test_the_heap_tree_is_the_brute_force_top_b(seed: int, L: int, V: int) -> None:
    """Distinct random log-probabilities (ties have probability 0): for every budget up to all
    prefixes, the nodes are the top-B prefixes, popped best first (so parents come first)."""
    logits = torch.randn(L, V, generator=torch.Generator().manual_seed(seed)) * 2
    logprobs = torch.log_softmax(logits, dim=-1)
    every = sum(V**d for d in range(1, L + 1))
    for budget in range(1, every + 2):
        top_lp, top_tok = draft_topk(logits, k=budget)
        tree = build_tree(top_lp, top_tok, budget)
        assert paths(tree) == brute_force_top(logprobs, budget), budget
        assert tree.size == min(budget, every)
        assert all(p < i + 1 for i, p in enumerate(tree.parents))
        assert tree.depths == tuple(len(p) for p in paths(tree))


def test_ties_pop_the_smaller_rank_tuple_first() -> None:
    """The documented tie rule (the reference's heap key (-logw, ranks)): a uniform drafter over
    two tokens, ranks = the tokens' order in ``top_tokens``."""
    lp = torch.full((2, 2), math.log(0.5))
    tree = build_tree(lp, torch.tensor([[7, 3], [5, 9]]), budget=6)
    assert paths(tree) == [(7,), (3,), (7, 5), (7, 9), (3, 5), (3, 9)]


def test_budget_zero_is_the_top1_chain() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3))
    tree = build_tree(*draft_topk(logits, k=4), budget=0)
    assert tree.tokens.tolist() == logits.argmax(-1).tolist()
    assert tree.parents == (0, 1, 2, 3, 4) and tree.depths == (1, 2, 3, 4, 5)


def test_temperatures_divide_each_depths_logits() -> None:
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(4))
    lp, tok = draft_topk(logits, k=5, temperatures=[1.0, 2.0, 0.5])
    want = torch.log_softmax(logits / torch.tensor([[1.0], [2.0], [0.5]]), dim=-1)
    assert torch.allclose(lp, want.gather(1, tok), atol=1e-6)
    assert torch.equal(tok, want.topk(5, dim=-1).indices)
    with pytest.raises(ValueError, match="one > 0 per depth"):
        draft_topk(logits, k=5, temperatures=[1.0, 2.0])


def visible_by_walking(parents: tuple[int, ...], i: int, j: int) -> bool:
    """Whether index j is index i or an ancestor of it, walking up the parents."""
    while True:
        if i == j:
            return True
        if i == 0:
            return False
        i = parents[i - 1]


def test_mask_and_positions_follow_the_ancestors() -> None:
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(5))
    tree = build_tree(*draft_topk(logits, k=12), budget=12)
    past = 3
    mask = tree_attention_mask(tree, past, torch.float16, "cpu")
    n = tree.size + 1
    assert mask.shape == (1, 1, n, past + n) and mask.dtype == torch.float16
    low = torch.finfo(torch.float16).min
    for i in range(n):
        assert (mask[0, 0, i, :past] == 0).all()
        for j in range(n):
            assert mask[0, 0, i, past + j] == (0 if visible_by_walking(tree.parents, i, j) else low)
    assert tree_position_ids(tree, 10).tolist() == [[10, *(10 + d for d in tree.depths)]]


def hand_tree() -> DraftTree:
    """root -> a(1) -> c(3) -> e(5);  root -> b(2) -> d(4); a -> f(6)."""
    return DraftTree(torch.tensor([10, 20, 30, 40, 50, 60]), (0, 0, 1, 2, 3, 1), (1, 1, 2, 2, 3, 2))


def test_follow_descends_while_the_target_picks_a_child() -> None:
    tree = hand_tree()
    # target token after: root, a, b, c, d, e, f
    assert follow_tree(tree, [10, 30, 99, 50, 98, 77, 97]) == ([0, 1, 3, 5], 77)
    assert follow_tree(tree, [20, 30, 40, 50, 98, 77, 97]) == ([0, 2, 4], 98)
    assert follow_tree(tree, torch.tensor([10, 60, 0, 0, 0, 0, 5])) == ([0, 1, 6], 5)
    assert follow_tree(tree, [11, 30, 40, 50, 98, 77, 97]) == ([0], 11)
    with pytest.raises(ValueError, match="root \\+ nodes"):
        follow_tree(tree, [10, 30])


def test_accepted_along_counts_the_matching_path() -> None:
    tree = hand_tree()
    assert accepted_along(tree, [10, 30, 50, 1]) == 3
    assert accepted_along(tree, [10, 60, 50]) == 2
    assert accepted_along(tree, [20, 40]) == 2
    assert accepted_along(tree, [30]) == 0
    assert accepted_along(tree, []) == 0
    # the walk and the replay agree when the target's token at each node of the path is the
    # continuation's next one (0 elsewhere: no node's token)
    for continuation in ([10, 30, 50, 1], [20, 7], [60], [10, 60, 3]):
        target, index = [0] * (tree.size + 1), 0
        for token in continuation:
            target[index] = token
            index = tree.children[index].get(token)
            if index is None:
                break
        path, bonus = follow_tree(tree, target)
        assert len(path) - 1 == accepted_along(tree, continuation)
        assert bonus == continuation[len(path) - 1]


def test_a_malformed_tree_is_refused() -> None:
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        DraftTree(torch.tensor([1, 2]), (0, 2), (1, 2))
    with pytest.raises(ValueError, match="depth 3"):
        DraftTree(torch.tensor([1, 2]), (0, 1), (1, 3))
    with pytest.raises(ValueError, match="budget=-1"):
        build_tree(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), -1)
