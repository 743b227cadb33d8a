"""The compiled target forward (compile.target): same hidden states as eager, one graph for every
layer with no graph break, only ``target_forward`` compiled, the warm-up's one-layer cut compiling
the full target's graph (a new process then hits), a hybrid target left eager.

CPU inductor on the tiny Qwen3 shape: each compile takes ~10-20 s on a busy 2-core box.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from training.compile import cache as cc
from training.config import load_config
from training.model.target import (
    build_random_target,
    can_compile,
    compile_target,
    decoder_layers,
    is_compiled,
    target_forward,
)
from training.run.warm import cut_target, run_target_shapes, warm_compiled_target

REPO = Path(__file__).resolve().parents[3]
# The tiny Qwen3 target's shape, random weights (tiny-cpu's [model]), 4 layers.
TINY = load_config("tiny-cpu", ["--model.kind=random"])


def _target() -> torch.nn.Module:
    return build_random_target(TINY.model, torch.device("cpu"), torch.float32)


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private inductor cache per test (no hit from another test or an earlier session)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    counters.clear()


def target_forward_eager(target: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The uncompiled forward of the same model (the compiled layer call detached for one call)."""
    compiled = target.__dict__.pop("_fleet_compiled_layer")
    try:
        return target_forward(target, ids, layer_ids)
    finally:
        target._fleet_compiled_layer = compiled


def test_a_hybrid_target_is_not_compiled() -> None:
    config = load_config("tiny-qwen3.5-cpu", ["--model.kind=random", "--model.vocab_size=64"])
    with torch.device("meta"):
        hybrid = build_random_target(config.model, torch.device("meta"), torch.float32)
    assert not can_compile(hybrid)
    assert not compile_target(hybrid) and not is_compiled(hybrid)
    lines: list[str] = []
    assert (
        warm_compiled_target(
            config, hybrid.config, [], device=torch.device("cpu"), dtype=torch.float32, echo=lines.append
        )
        == []
    )
    assert "runs eager" in lines[-1]


@pytest.mark.slow
def test_the_one_layer_cut_compiles_the_full_targets_graph_and_it_equals_eager() -> None:
    """The warm-up compiles a one-layer cut; a new process running the full 4-layer target's
    compiled forward on the same shape then hits the cache (0 misses). Then, in this process, the
    full target's compiled forward (that graph, from the cache) gives eager's hidden states: one
    graph for all four layers, no graph break; another shape is one more graph, and only
    ``target_forward`` swaps the layers."""
    cut = cut_target(_target().config, torch.device("cpu"), torch.float32)
    assert len(decoder_layers(cut)) == 1 and can_compile(cut)
    assert compile_target(cut)
    lines: list[str] = []
    done = run_target_shapes(
        cut,
        [cc.ShapeRecord(0, 3, 48)],
        device=torch.device("cpu"),
        echo=lines.append,
        what="compiled target forward",
    )
    assert [(s.batch_size, s.length) for s in done] == [(3, 48)]
    assert "compiled target forward, fxgraph 0 hit / 1 miss" in lines[0]
    child = (
        f"import torch; torch.set_num_threads({torch.get_num_threads()})  # CPU inductor keys hold it\n"
        "from torch._dynamo.utils import counters\n"
        "from training.config import load_config\n"
        "from training.model.target import build_random_target, compile_target, target_forward\n"
        "cfg = load_config('tiny-cpu', ['--model.kind=random'])\n"
        "t = build_random_target(cfg.model, torch.device('cpu'), torch.float32); compile_target(t)\n"
        "target_forward(t, torch.randint(0, 100, (3, 48)), [0, 2, 3])\n"
        "print(counters['inductor']['fxgraph_cache_hit'], counters['inductor']['fxgraph_cache_miss'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["1", "0"]  # hit, miss

    torch._dynamo.reset()
    counters.clear()
    target = _target()
    ids = torch.randint(0, TINY.model.vocab_size, (3, 48), generator=torch.Generator().manual_seed(0))
    layer_ids = [0, 1, 3]  # the last layer too: the final norm after the compiled layers
    eager = target_forward(target, ids, layer_ids)
    assert compile_target(target) and is_compiled(target)
    compiled = target_forward(target, ids, layer_ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == 1  # one graph, all four layers
    assert not counters["graph_break"]
    assert (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]) == (1, 0)
    again = target_forward(target, ids[:, :32].contiguous(), [1])  # another shape: one more graph
    torch.testing.assert_close(again, target_forward_eager(target, ids[:, :32], [1]), rtol=1e-3, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    # Only target_forward swaps the layers: afterwards (and for eval's direct calls) they are eager.
    assert all("forward" not in vars(layer) for layer in decoder_layers(target))
    before = dict(counters["stats"])
    target(input_ids=ids[:, :17], output_hidden_states=True, use_cache=False)
    assert dict(counters["stats"]) == before


def test_compile_target_is_on_by_default_and_can_be_turned_off() -> None:
    assert load_config("tiny-cpu").compile.target is True
    assert load_config("tiny-cpu", ["--compile.target=false"]).compile.target is False


def test_a_target_rank_sets_the_guards_and_activates_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from training.data.buckets import EpochPlanner
    from training.run.warm import prepare_target_compile

    planner = EpochPlanner(
        np.array([10] * 7 + [50] * 7 + [120] * 5),
        num_buckets=3,
        max_length=128,
        token_budget=512,
        max_batch_size=64,
        seed=0,
    )
    monkeypatch.setenv(cc.ROOT_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # activate() sets it: restored after
    guards = {"recompile_limit": 1, "accumulated_recompile_limit": 256, "fail_on_recompile_limit_hit": False}
    lines: list[str] = []
    with torch._dynamo.config.patch(**guards):  # restored after
        reporter = prepare_target_compile(TINY, planner, torch.device("cpu"), echo=lines.append)
        assert torch._dynamo.config.recompile_limit >= len(planner.boundaries) - 1
        assert torch._dynamo.config.fail_on_recompile_limit_hit
    key = cc.cache_key(torch.device("cpu")).text
    assert reporter.key == key and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "cache" / key / "inductor"
    )
    assert lines[0].startswith("compile: target forward, recompile_limit=") and "not warmed" in lines[1]
