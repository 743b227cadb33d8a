"""DDTree's cost model: the speedup arithmetic by hand, the timing on real tiny targets (a Qwen3 and
a Qwen3.5 hybrid) on the CPU, and the hybrid's tree mask reaching its full-attention layers."""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import tiny_qwen3

from training.config import load_config
from training.model.drafter import DFlashDrafter, DrafterConfig
from training.model.target import build_random_target
from training.run.eval import _cache_arg
from training.run.tree import DraftTree, tree_attention_mask, tree_position_ids
from training.run.tree_cost import TreeCost, _mask_arg, measure_tree_cost, tree_cost_enabled

torch.set_num_threads(1)

COST = TreeCost(
    device="cpu",
    context=100,
    t_step_s=0.020,
    t_draft_s=0.005,
    t_verify_s={0: 0.020, 16: 0.022, 64: 0.030, 256: 0.080},
    block_size=16,
)


def test_speedups_and_best_budget_by_hand() -> None:
    taus = {0: 2.5, 16: 3.0, 64: 3.6, 1024: 9.0}  # 256 has no tau, 1024 no cost: neither counts
    speed = COST.speedups(taus)
    assert speed == pytest.approx({0: 2.5 * 0.02 / 0.025, 16: 3.0 * 0.02 / 0.027, 64: 3.6 * 0.02 / 0.035})
    assert speed[16] == pytest.approx(2.2222, abs=1e-4)
    assert COST.best(taus) == (16, pytest.approx(2.2222, abs=1e-4))
    assert COST.best({}) is None
    # a tie goes to the cheaper (smaller) budget: 16 and 64 both at 2.0 (exact in binary)
    even = TreeCost("cpu", 1, t_step_s=1.0, t_draft_s=0.5, t_verify_s={16: 0.5, 64: 1.5}, block_size=16)
    assert even.best({16: 2.0, 64: 4.0}) == (16, 2.0)
    assert COST.break_even() == pytest.approx({0: 1.25, 16: 1.35, 64: 1.75, 256: 4.25})
    view = COST.to_json(taus)
    assert view["best_budget"] == 16 and view["t_verify_s"]["64"] == 0.030
    assert set(view["speedup"]) == {"0", "16", "64"}
    assert COST.to_json()["t_step_s"] == 0.020 and "best_budget" not in COST.to_json()


def test_the_table_marks_the_best_budget() -> None:
    lines = COST.table({0: 2.5, 16: 3.0, 64: 3.6, 1024: 9.0}, sizes={16: 15.5}).splitlines()
    rows = {line.split()[0]: line for line in lines[2:]}
    assert "<- best" in rows["16"] and "<-" not in rows["64"]
    assert rows["16"].split()[1:6] == ["3.000", "1.20x", "16", "22.00", "2.22x"]  # tree size rounded
    assert rows["chain"].split()[1:3] == ["2.500", "1.00x"]
    assert rows["256"].split()[1] == "-"  # measured, not evaluated
    assert rows["1024"].split()[1:] == ["9.000", "3.60x", "-", "-", "-"]  # evaluated, not measured


def test_tree_cost_runs_on_gpus_only_unless_asked() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tree_cost_enabled("auto", cuda) and not tree_cost_enabled("auto", cpu)
    assert tree_cost_enabled("on", cpu) and not tree_cost_enabled("off", cuda)


def _drafter(target: torch.nn.Module, block_size: int, mask_token: int) -> DFlashDrafter:
    cfg = DrafterConfig(
        num_layers=1,
        block_size=block_size,
        full_attention_layers=(0,),
        num_target_layers=2,
        mask_token_id=mask_token,
    )
    return DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())


def _hybrid() -> torch.nn.Module:
    model_cfg = load_config("tiny-qwen3.5-cpu", ["--model.kind=random", "--model.vocab_size=64"]).model
    return build_random_target(model_cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_measured_on_a_tiny_target_every_budget_has_a_time(kind: str) -> None:
    target = tiny_qwen3() if kind == "qwen3" else _hybrid()
    drafter = _drafter(target, 8, 60)
    cost = measure_tree_cost(target, drafter, 24, (0, 16), repeats=1, warmup=0)
    assert set(cost.t_verify_s) == {0, 16}
    assert cost.t_step_s > 0 and cost.t_draft_s > 0 and all(s > 0 for s in cost.t_verify_s.values())
    assert cost.tree_sizes == {0: 7, 16: 16}  # the chain: block_size - 1 drafts after the root
    assert cost.context == 24 and cost.device == "cpu" and cost.block_size == 8
    assert ("hybrid" in cost.method) == (kind == "qwen3_5")
    assert drafter.training  # left as it was


@torch.no_grad()
def test_a_hybrids_tree_mask_reaches_its_full_attention_layers() -> None:
    """Two siblings at depth 1: under the tree mask the second does not see the first in the
    full-attention layers (its logits differ from the causal pass'); the root sees the same."""
    target = _hybrid()
    prefix = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    arg = _cache_arg(target)
    out = target(input_ids=prefix, use_cache=True)
    cache = out.get("cache") or out.get("past_key_values")
    tree = DraftTree(torch.tensor([5, 9]), (0, 0), (1, 1))
    block = torch.tensor([[3, 5, 9]])
    mask = tree_attention_mask(tree, 12, torch.float32, "cpu")
    positions = tree_position_ids(tree, 12)
    masked = target(
        input_ids=block,
        attention_mask=_mask_arg(target, mask),
        position_ids=positions,
        **{arg: copy.deepcopy(cache)},
    ).logits[0]
    causal = target(input_ids=block, position_ids=positions, **{arg: copy.deepcopy(cache)}).logits[0]
    torch.testing.assert_close(masked[:2], causal[:2])  # the root, and the first sibling: same view
    assert not torch.allclose(masked[2], causal[2], atol=1e-4)
