"""Real acceptance length: drafts verified greedily by a real (tiny) transformers target."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from testkit import tiny_qwen3, tiny_qwen3_config
from torch import Tensor
from transformers import Qwen3ForCausalLM

from training.model.drafter import DFlashDrafter, DrafterConfig
from training.run.eval import evaluate_acceptance

BS = 4


def markov_target() -> tuple[Qwen3ForCausalLM, Tensor]:
    """A real Qwen3 model whose greedy next token depends on the current token only.

    Every attention and MLP output projection is zeroed, so each position's residual stream
    is its own token embedding: next = argmax(lm_head(norm(embed(x)))) =: next_of[x].
    """
    model = tiny_qwen3(seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        next_of = model(input_ids=torch.arange(256)[:, None]).logits[:, 0].argmax(-1)
    return model, next_of


class ChainDrafter(DFlashDrafter):
    """Proposes the target's own greedy chain for the first ``right`` offsets, then a wrong token."""

    def __init__(self, target: Qwen3ForCausalLM, next_of: Tensor, right: int) -> None:
        cfg = DrafterConfig(
            num_layers=1, block_size=BS, full_attention_layers=(0,), num_target_layers=2, mask_token_id=255
        )
        super().__init__(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())
        self.next_of = next_of
        self.right = right

    def propose(self, target_hidden: Tensor, last_token: Tensor) -> Tensor:
        tokens, cur = [], last_token.long()
        for i in range(BS - 1):
            cur = self.next_of[cur]
            tokens.append(cur if i < self.right else (cur + 1) % 256)
        return torch.stack(tokens, dim=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]


def test_the_test_target_is_markov() -> None:
    target, next_of = markov_target()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        greedy = target(input_ids=ids).logits[0].argmax(-1)
    assert torch.equal(greedy, next_of[ids[0]])
    assert len(set(next_of.tolist())) > 16  # not a constant map: random drafts rarely match


def test_a_drafter_that_copies_the_target_reaches_the_block_size() -> None:
    target, next_of = markov_target()
    drafter = ChainDrafter(target, next_of, right=BS - 1)
    res = evaluate_acceptance(target, drafter, _prompts(), [0, 1], max_new_tokens=10)
    per_prompt = math.ceil(10 / BS)
    assert res.tau_mean == BS
    assert res.rounds == 3 * per_prompt and res.prompts == 3
    assert res.hist == (0, 0, 0, res.rounds)
    assert res.new_tokens == 3 * per_prompt * BS


@pytest.mark.parametrize("right", [0, 1, 2])
def test_accepted_length_is_matching_prefix_plus_bonus(right: int) -> None:
    target, next_of = markov_target()
    drafter = ChainDrafter(target, next_of, right=right)
    res = evaluate_acceptance(target, drafter, _prompts(), [0, 1], max_new_tokens=7)
    assert res.tau_mean == right + 1
    assert res.hist[right] == res.rounds and sum(res.hist) == res.rounds


def test_an_untrained_drafter_gets_a_small_tau() -> None:
    target, _ = markov_target()
    torch.manual_seed(3)
    cfg = DrafterConfig(
        num_layers=2, block_size=BS, full_attention_layers=(1,), num_target_layers=2, mask_token_id=255
    )
    drafter = DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())
    drafter.train()
    res = evaluate_acceptance(target, drafter, _prompts(), drafter.target_layer_ids, max_new_tokens=12)
    assert 1.0 <= res.tau_mean < 1.5
    assert res.hist[0] > res.rounds // 2
    assert drafter.training  # the mode is restored


def test_eos_stops_a_prompt_early() -> None:
    target, next_of = markov_target()
    drafter = ChainDrafter(target, next_of, right=BS - 1)
    prompt = [7]
    chain, cur = [], 7
    for _ in range(12):
        cur = int(next_of[cur])
        chain.append(cur)
    eos = chain[5]  # produced in the second round
    res = evaluate_acceptance(target, drafter, [prompt], [0, 1], max_new_tokens=40, eos_token_id=eos)
    # chain[0] is the prefill's token, round r emits chain[4r-3 .. 4r] (drafts + bonus)
    assert res.rounds == math.ceil(chain.index(eos) / BS) >= 1


def test_bad_arguments_are_refused() -> None:
    target, next_of = markov_target()
    drafter = ChainDrafter(target, next_of, right=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate_acceptance(target, drafter, [[1]], [0, 1], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompts"):
        evaluate_acceptance(target, drafter, [[]], [0, 1], max_new_tokens=4)


def test_eval_reads_the_same_hidden_states_the_trainer_trains_on() -> None:
    """eval uses ``output_hidden_states``; the trainer uses training.model.target's hooks: same tensors."""
    from training.model.drafter import target_context
    from training.model.target import target_forward

    target, _ = markov_target()
    with torch.no_grad():
        for i, layer in enumerate(target.model.layers):  # undo the zeroing: a mixing target
            torch.nn.init.normal_(
                layer.self_attn.o_proj.weight, std=0.3, generator=torch.Generator().manual_seed(i)
            )
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(5))
    for layer_ids in ([0, 1], [1], [0, 0]):
        with torch.no_grad():
            ours = target_context(target(input_ids=ids, output_hidden_states=True).hidden_states, layer_ids)
        torch.testing.assert_close(ours, target_forward(target, ids, layer_ids))


class UnevenDrafter(ChainDrafter):
    """The target's chain, except that the first draft is wrong after an anchor divisible by 3."""

    def propose(self, target_hidden: Tensor, last_token: Tensor) -> Tensor:
        tokens = super().propose(target_hidden, last_token)
        if int(last_token[0]) % 3 == 0:
            tokens[:, 0] = (tokens[:, 0] + 1) % 256
        return tokens


def test_tau_is_reported_per_round_and_per_prompt() -> None:
    """tau_prompt_mean = the mean over prompts of each prompt's own mean tau (z-lab's figure),
    computed here by evaluating each prompt alone; tau_mean stays the mean over all rounds."""
    target, next_of = markov_target()
    drafter = UnevenDrafter(target, next_of, right=BS - 1)
    prompts = [[3], [7, 1], [12, 5, 9], [4]]
    both = evaluate_acceptance(target, drafter, prompts, [0, 1], max_new_tokens=9)
    alone = [evaluate_acceptance(target, drafter, [p], [0, 1], max_new_tokens=9) for p in prompts]
    assert both.tau_per_prompt == tuple(r.tau_mean for r in alone)
    assert both.tau_prompt_mean == pytest.approx(sum(r.tau_mean for r in alone) / len(alone))
    rounds = sum(r.rounds for r in alone)
    assert both.tau_mean == pytest.approx(sum(r.tau_mean * r.rounds for r in alone) / rounds)
    assert len(set(both.tau_per_prompt)) > 1  # the prompts differ, so the two means can differ


def test_eval_prompts_are_the_last_tokens_before_the_first_label() -> None:
    """A long prompt keeps its end (before: its first prompt_tokens, cut mid-message)."""
    from types import SimpleNamespace

    from training.data.dataset import TrainData

    rows = {
        "input_ids": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13]],
        "loss_mask": [[0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1], [1, 1]],
    }
    prompts = TrainData.eval_prompts(SimpleNamespace(eval_rows=rows), 3, 10)
    assert prompts == [[3, 4, 5], [9], [12]]


def mixing_target(seed: int = 0) -> Qwen3ForCausalLM:
    """The tiny Qwen3 as drawn: every token's output depends on the whole prefix."""
    return tiny_qwen3(seed=seed)


class OracleDrafter(ChainDrafter):
    """Drafts the target's greedy continuation (``transformers``' ``generate``) of one prompt: in its
    ``r``-th round right for the first ``r % BS`` offsets, then wrong, so the rounds accept every
    length 0..BS-1 and the cache is cut back by every amount."""

    def __init__(self, target: Qwen3ForCausalLM, sequence: list[int]) -> None:
        super().__init__(target, torch.zeros(256, dtype=torch.long), right=0)
        self.sequence = sequence
        self.rounds = 0

    def propose(self, target_hidden: Tensor, last_token: Tensor) -> Tensor:
        t = target_hidden.shape[1]  # the block's anchor is at position t
        right, self.rounds = self.rounds % BS, self.rounds + 1
        tokens = [
            tok if i < right else (tok + 1) % 256 for i, tok in enumerate(self.sequence[t + 1 : t + BS])
        ]
        return torch.tensor([tokens])


def _greedy(target: Qwen3ForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return out[0].tolist()


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_verified_tokens_are_the_targets_own_greedy_continuation(kv_cache: bool) -> None:
    """Speculative decoding with greedy verification produces exactly the target's greedy output,
    whichever drafts were accepted: here against transformers' ``generate``, with the KV cache kept
    and cut back between rounds, and without it."""
    target = mixing_target()
    prompt = [5, 17, 99, 3, 250, 41, 8]
    sequence = _greedy(target, prompt, 60)
    drafter = OracleDrafter(target, sequence)
    res = evaluate_acceptance(target, drafter, [prompt], [0, 1], max_new_tokens=40, kv_cache=kv_cache)
    (generated,) = res.generated
    assert len(generated) >= 40 and list(generated) == sequence[len(prompt) : len(prompt) + len(generated)]
    assert res.taus[0][: 2 * BS] == (1, 2, 3, 4) * 2, res.taus  # every amount of cut-back happens


def test_the_kv_cache_changes_nothing_measured() -> None:
    """A real (untrained) drafter on a mixing target: the same rounds, taus and tokens with the
    target's KV cache kept between rounds as with the whole sequence re-run every round."""
    target = mixing_target(seed=1)
    torch.manual_seed(4)
    cfg = DrafterConfig(
        num_layers=2, block_size=BS, full_attention_layers=(1,), num_target_layers=2, mask_token_id=255
    )
    drafter = DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())
    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 30)
    ]
    cached = evaluate_acceptance(target, drafter, prompts, drafter.target_layer_ids, 24, kv_cache=True)
    whole = evaluate_acceptance(target, drafter, prompts, drafter.target_layer_ids, 24, kv_cache=False)
    assert cached == whole


def test_only_full_attention_targets_keep_the_kv_cache() -> None:
    from training.config import load_config
    from training.model.tinymodel import qwen3_5_text_config
    from training.run.eval import keeps_kv_cache

    assert keeps_kv_cache(mixing_target())
    model = load_config("tiny-qwen3.5-cpu").model
    hybrid = qwen3_5_text_config(model, 256)
    assert not keeps_kv_cache(type("Hybrid", (), {"config": hybrid})())
    sliding = tiny_qwen3_config()
    sliding.layer_types = ["sliding_attention", "full_attention"]
    assert not keeps_kv_cache(type("Sliding", (), {"config": sliding})())


# ------------------------------------------------------------------ DDTree (training.run.tree)

BUDGETS = (16, 64, 256)


class RankedOracle(DFlashDrafter):
    """Drafts the target's greedy continuation ``sequence`` (prompt included) through designed
    logits: for the block anchored at position ``P``, depth ``i``'s true token is ranked
    ``(P + 2 * i) % 3`` among random logits (seeded by ``P`` and ``i``). The chain accepts the
    runs of rank 0; a tree gains where it holds a lower-ranked true token. Its lm_head is the
    identity, so ``draft_hidden`` (what both ``propose_logits`` and the replay read) gives the
    logits themselves."""

    def __init__(self, target: Qwen3ForCausalLM, sequence: list[int]) -> None:
        cfg = DrafterConfig(
            num_layers=1, block_size=BS, full_attention_layers=(0,), num_target_layers=2, mask_token_id=255
        )
        head = torch.nn.Linear(256, 256, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.eye(256))
        super().__init__(cfg, target.config, target.get_input_embeddings(), head)
        self.sequence = sequence

    def draft_hidden(self, target_hidden: Tensor, first_tokens: Tensor, anchors: Tensor) -> Tensor:
        out = torch.empty(*anchors.shape, BS - 1, 256)
        for row, col in itertools.product(range(anchors.shape[0]), range(anchors.shape[1])):
            pos = int(anchors[row, col])
            for i in range(BS - 1):
                logits = torch.randn(256, generator=torch.Generator().manual_seed(1000 * pos + i))
                true = self.sequence[pos + 1 + i]
                logits[true] = -math.inf
                top = logits.topk(3).values
                rank = (pos + 2 * i) % 3
                logits[true] = top[0] + 1 if rank == 0 else (top[rank - 1] + top[rank]) / 2
                out[row, col, i] = logits
        return out


def _untrained(target: torch.nn.Module, vocab: int) -> DFlashDrafter:
    torch.manual_seed(4)
    cfg = DrafterConfig(
        num_layers=2, block_size=BS, full_attention_layers=(1,), num_target_layers=2, mask_token_id=vocab - 1
    )
    return DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())


def _check_trees(target: torch.nn.Module, drafter: DFlashDrafter, prompts: list[list[int]], new: int) -> None:
    """The chain with budgets is today's eval exactly; replay at budget 0 is the chain; every budget
    emits the target's own greedy continuation (``generate``); and, on this full-attention target,
    replay and tree verification give the same taus for every budget."""
    plain = evaluate_acceptance(target, drafter, prompts, [0, 1], new)
    replay = evaluate_acceptance(target, drafter, prompts, [0, 1], new, budgets=(0, *BUDGETS))
    verify = evaluate_acceptance(
        target, drafter, prompts, [0, 1], new, budgets=(0, *BUDGETS), tree_method="verify"
    )
    assert dataclasses.replace(replay, trees=()) == plain == dataclasses.replace(verify, trees=())
    assert [t.budget for t in replay.trees] == [0, *BUDGETS] == [t.budget for t in verify.trees]
    chain = replay.trees[0]
    assert (chain.taus, chain.generated, chain.hist) == (plain.taus, plain.generated, plain.hist)
    assert chain.tree_size_mean == BS - 1
    longest = max(len(g) for t in replay.trees for g in t.generated)
    greedy = [_greedy(target, prompt, longest)[len(prompt) :] for prompt in prompts]
    for ours, theirs in zip(replay.trees, verify.trees, strict=True):
        assert ours == theirs, (ours.budget, ours.taus, theirs.taus)
        for reference, generated in zip(greedy, ours.generated, strict=True):
            assert list(generated) == reference[: len(generated)], ours.budget
    for tree in replay.trees[1:]:
        assert 1 <= tree.tree_size_mean <= tree.budget and sum(tree.hist) == tree.rounds


def test_ddtree_replay_equals_tree_verification_and_the_chain_is_budget_0() -> None:
    """The oracle drafter on a mixing target: trees accept more than the chain (siblings and
    their subtrees are followed and their KV entries compacted), the same through either method."""
    target = mixing_target()
    prompts = [[5, 17, 99, 3, 250, 41, 8], [12, 200, 7]]
    sequences = [_greedy(target, p, 40) for p in prompts]
    for prompt, sequence in zip(prompts, sequences, strict=True):
        drafter = RankedOracle(target, sequence)
        _check_trees(target, drafter, [prompt], 24)
        result = evaluate_acceptance(target, drafter, [prompt], [0, 1], 24, budgets=BUDGETS)
        assert result.tau_mean < result.trees[0].tau_mean <= result.trees[-1].tau_mean, result


def test_ddtree_replay_equals_tree_verification_with_a_real_drafter() -> None:
    """An untrained DFlash drafter (real network, its own logits): the same equalities."""
    target = mixing_target(seed=1)
    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11)
    ]
    _check_trees(target, _untrained(target, 256), prompts, 12)


def test_ddtree_replay_runs_on_the_hybrid_and_verification_is_refused() -> None:
    """The tiny Qwen3.5 hybrid (Gated DeltaNet layers: no tree verification): the replay's chain is
    the chain, and every budget's tokens are the target's greedy continuation."""
    from training.config import load_config
    from training.model.target import build_random_target
    from training.run.eval import tree_method_problem

    model = load_config("tiny-qwen3.5-cpu", ["--model.kind=random", "--model.vocab_size=256"]).model
    target = build_random_target(model, torch.device("cpu"), torch.float32)
    drafter = _untrained(target, 256)
    prompts = [[5, 17, 99, 3, 250], [12, 200, 7]]
    result = evaluate_acceptance(target, drafter, prompts, drafter.target_layer_ids, 10, budgets=(0, 16, 64))
    assert (result.trees[0].taus, result.trees[0].generated) == (result.taus, result.generated)
    longest = max(len(g) for t in result.trees for g in t.generated)
    greedy = [_greedy(target, prompt, longest)[len(prompt) :] for prompt in prompts]
    for tree in result.trees:
        for reference, generated in zip(greedy, tree.generated, strict=True):
            assert list(generated) == reference[: len(generated)], tree.budget
    problem = tree_method_problem(target, "verify")
    assert problem is not None and "full attention" in problem and "tree_method=replay" in problem
    full = mixing_target()
    assert tree_method_problem(full, "verify") is None and tree_method_problem(full, "replay") is None
    full.config._attn_implementation = "flash_attention_2"
    assert "sdpa or eager" in str(tree_method_problem(full, "verify"))
    with pytest.raises(ValueError, match="tree_method=replay"):
        evaluate_acceptance(
            target, drafter, prompts, drafter.target_layer_ids, 4, budgets=(16,), tree_method="verify"
        )
