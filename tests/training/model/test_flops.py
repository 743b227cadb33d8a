"""The target-forward FLOP formula (training/model/flops.py) against torch's FlopCounterMode.

FlopCounterMode counts the matmuls torch runs: on this CPU env the hybrid's delta rule is
transformers' torch fallback, the chunked algorithm written out in matmuls (5.8) or with its
UT transform applied by ``torch.linalg.solve_triangular`` (5.17 and later), which the counter does
not know; it is counted here as the dense triangular matmul flash-linear-attention performs
(2 * C^2 * width). Attention runs eager (the CPU sdpa kernel is not counted either), the full
square (``causal=False``). The conv1d runs with padding K-1 on both sides: torch computes
K-1 extra outputs per sequence and channel, which the causal formula leaves out. The rotary
embedding's tiny matmul (inverse frequencies x positions; transformers 5.8 and 5.17 run it as a
matmul, 5.24 not) is not model work and is taken out of the count.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from training.config import load_config
from training.model.flops import TargetShape, forward_flops
from training.model.target import target_forward
from training.model.tinymodel import target_text_config

aten = torch.ops.aten


def _solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    *batch, c, _ = a_shape
    width = b_shape[-1]
    count = 1
    for n in batch:
        count *= n
    return 2 * count * c * c * width


COUNT_SOLVES = {aten.linalg_solve_triangular: _solve_triangular}


def _model(config_name: str, overrides: list[str] = ()):
    from transformers import AutoModelForCausalLM

    model_cfg = load_config(config_name, ["--model.kind=random", *overrides]).model
    hf = target_text_config(model_cfg, 96)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
    return model, TargetShape.from_config(hf)


def _counted(fn) -> tuple[int, dict]:
    """FLOPs counted while ``fn`` runs, less the rotary embedding's; and the counts by module."""
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=COUNT_SOLVES) as counter:
        fn()
    by_module = counter.get_flop_counts()
    rotary = sum(sum(ops.values()) for name, ops in by_module.items() if name.endswith(".rotary_emb"))
    return counter.get_total_flops() - rotary, by_module


@pytest.mark.parametrize("length", [128, 100])  # a whole number of 64-token chunks, and a padded one
def test_hybrid_forward_flops_match_flop_counter(length: int) -> None:
    model, shape = _model("tiny-qwen3.5-cpu")
    batch = 2
    ids = torch.randint(0, 96, (batch, length))
    total, by_module = _counted(lambda: model.model(input_ids=ids, use_cache=False))
    terms = forward_flops(shape, batch, length, causal=False)
    linear_layers = shape.layer_types.count("linear_attention")
    conv_padding = linear_layers * 2 * batch * shape.conv_dim * (shape.conv_kernel - 1) * shape.conv_kernel
    assert total == terms["total"] + conv_padding

    # term by term, on one layer of each kind
    def module(name: str) -> dict[str, int]:
        return {str(op).split(".")[1]: n for op, n in by_module[f"Qwen3_5TextModel.{name}"].items()}

    linear = module("layers.0.linear_attn")
    assert linear["mm"] == terms["linear_projections"] / linear_layers
    assert linear["convolution"] == (terms["conv1d"] + conv_padding) / linear_layers
    assert linear["bmm"] + linear.get("linalg_solve_triangular", 0) == terms["delta_rule"] / linear_layers
    full = module("layers.3.self_attn")
    assert full["mm"] == terms["attention_projections"] / 2
    assert full["bmm"] == terms["attention_scores"] / 2
    assert module("layers.0.mlp")["mm"] == terms["mlp"] / shape.layers


def test_causal_count_halves_only_the_attention_scores() -> None:
    _model_unused, shape = _model("tiny-qwen3.5-cpu")
    full, causal = forward_flops(shape, 2, 128, causal=False), forward_flops(shape, 2, 128)
    assert causal["attention_scores"] == full["attention_scores"] / 2
    assert causal["total"] == full["total"] - full["attention_scores"] / 2


def test_target_forward_runs_only_the_layers_up_to_the_deepest_chosen() -> None:
    model, shape = _model("tiny-qwen3.5-cpu")
    ids = torch.randint(0, 96, (1, 64))
    total, _ = _counted(lambda: target_forward(model, ids, [1, 3, 5]))
    terms = forward_flops(shape, 1, 64, layers_run=6, causal=False)
    conv_padding = 5 * 2 * shape.conv_dim * (shape.conv_kernel - 1) * shape.conv_kernel  # 5 linear of 6
    assert total == terms["total"] + conv_padding


def test_dense_qwen3_forward_flops_match_flop_counter() -> None:
    model, shape = _model("tiny-cpu")
    assert not shape.gated_query and set(shape.layer_types) == {"full_attention"}
    ids = torch.randint(0, 96, (2, 80))
    total, _ = _counted(lambda: model.model(input_ids=ids, use_cache=False))
    terms = forward_flops(shape, 2, 80, causal=False)
    assert terms["delta_rule"] == terms["conv1d"] == terms["linear_projections"] == 0
    assert total == terms["total"]


def test_qwen3_6_27b_forward_flops_per_token() -> None:
    """The 27B hybrid: ~50 GFLOP per token for a 4096-token forward (the benchmark's shape)."""
    model_cfg = load_config("qwen3.6-27b-random").model
    shape = TargetShape.from_config(target_text_config(model_cfg, model_cfg.vocab_size))
    terms = forward_flops(shape, 4, 4096)
    per_token = terms["total"] / (4 * 4096)
    # 2 x the decoder's matmul weights (24.35B minus norms, conv and the per-head vectors) ...
    weights = 64 * 3 * 5120 * 17408 + 16 * (5120 * 12288 + 2 * 5120 * 1024 + 6144 * 5120)
    weights += 48 * (5120 * 10240 + 5120 * 6144 + 2 * 5120 * 48 + 6144 * 5120)
    assert (
        terms["mlp"] + terms["attention_projections"] + terms["linear_projections"] == 2 * weights * 4 * 4096
    )
    assert 49e9 < per_token < 52e9
