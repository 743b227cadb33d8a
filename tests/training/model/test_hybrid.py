"""The Qwen3.5/3.6 hybrid target (transformers' qwen3_5): loading both checkpoint layouts, the
hidden-state layers, the 27B shape, random builds, the linear-attention kernels each rank runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from training.config import ConfigError, load_config
from training.model.drafter import select_target_layers, target_context
from training.model.kernels import (
    TargetKernels,
    linear_attention_kernels,
    require_fast_path,
    source_of,
)
from training.model.target import (
    build_random_target,
    decoder_layers,
    describe_layers,
    layer_types,
    load_model,
    load_target,
    model_source,
    target_forward,
)
from training.model.tinymodel import qwen3_5_layer_types, target_text_config

REPO = Path(__file__).resolve().parents[3]
TINY = "tiny-qwen3.5-cpu"


def tiny_folder(layout: str) -> tuple[Path, object]:
    config = load_config(TINY, [f"--model.checkpoint_layout={layout}"])
    folder, _tokenizer = model_source(config)
    return Path(folder), config


def saved_tensor(folder: Path, key: str) -> torch.Tensor:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return handle.get_tensor(key)


@pytest.mark.parametrize(
    ("layout", "architecture", "embed_key"),
    [
        ("text", "Qwen3_5ForCausalLM", "model.embed_tokens.weight"),
        ("multimodal", "Qwen3_5ForConditionalGeneration", "model.language_model.embed_tokens.weight"),
    ],
)
def test_tiny_qwen3_5_loads_text_only_from_both_layouts(
    tiny_cache: Path, layout: str, architecture: str, embed_key: str
) -> None:
    folder, config = tiny_folder(layout)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == [architecture]
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert embed_key in keys and "lm_head.weight" in keys
    assert (layout == "multimodal") == any(k.startswith("model.visual.") for k in keys)

    model = load_model(config, str(folder))  # the run's own path: from_pretrained, local files only
    assert type(model).__name__ == "Qwen3_5ForCausalLM"  # text-only, whatever the layout
    assert not any(name.startswith("model.visual") for name, _ in model.named_parameters())
    # The embedding and lm_head the drafter shares are the checkpoint's, read here by their keys.
    torch.testing.assert_close(model.get_input_embeddings().weight, saved_tensor(folder, embed_key))
    torch.testing.assert_close(model.get_output_embeddings().weight, saved_tensor(folder, "lm_head.weight"))
    prefix = "model.language_model." if layout == "multimodal" else "model."
    torch.testing.assert_close(
        decoder_layers(model)[1].linear_attn.in_proj_qkv.weight,
        saved_tensor(folder, f"{prefix}layers.1.linear_attn.in_proj_qkv.weight"),
    )
    assert layer_types(model) == qwen3_5_layer_types(8, 4)


def test_hidden_states_come_from_the_intended_layers(tiny_cache: Path) -> None:
    folder, _ = tiny_folder("multimodal")
    model = load_target(folder, "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 70))  # past one 64-token delta-rule chunk
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    ran: list[int] = []
    handles = [
        layer.register_forward_hook(lambda _m, _a, _o, i=i: ran.append(i))
        for i, layer in enumerate(decoder_layers(model))
    ]
    try:
        for layer_ids in ([1, 3, 5], [0, 7], [4]):  # linear + full mixes; the last layer (final norm)
            ran.clear()
            ours = target_forward(model, ids, layer_ids)
            torch.testing.assert_close(ours, target_context(reference, layer_ids))
            assert ran == list(range(max(layer_ids) + 1))  # nothing deeper than needed ran
    finally:
        for handle in handles:
            handle.remove()
    assert describe_layers(model, [1, 3, 5]) == "[1 linear, 3 full, 5 linear]"


def test_qwen3_6_layer_ids_are_the_even_spread_formula() -> None:
    """SpecForge configs/qwen3.6-27b-dflash.json: target_layer_ids [1, 16, 31, 46, 61], 64 layers."""
    config = load_config("qwen3.6-27b-random")
    assert select_target_layers(config.model.num_hidden_layers, 5) == [1, 16, 31, 46, 61]
    types = qwen3_5_layer_types(config.model.num_hidden_layers, config.model.full_attention_interval)
    assert [types[i] for i in (1, 16, 31, 46, 61)] == ["linear_attention"] * 2 + ["full_attention"] + [
        "linear_attention"
    ] * 2
    assert (
        types.count("full_attention") == 16 and types[3] == "full_attention" and types[63] == "full_attention"
    )


def test_qwen3_6_27b_random_has_the_real_shape_and_size() -> None:
    from transformers import AutoModelForCausalLM

    model_cfg = load_config("qwen3.6-27b-random").model
    hf = target_text_config(model_cfg, model_cfg.vocab_size)
    assert hf.model_type == "qwen3_5_text" and hf.layer_types == qwen3_5_layer_types(64, 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    counted = sum(p.numel() for p in model.parameters())
    # The same sum by hand, from the architecture (transformers' modeling_qwen3_5):
    h, v, inter, heads, kv, hd = 5120, 248320, 17408, 24, 4, 256
    k_dim, v_dim, v_heads, conv = 16 * 128, 48 * 128, 48, 4
    full = h * 2 * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # gated q, k, v, o, q/k norms
    linear = h * (2 * k_dim + v_dim) + h * v_dim + 2 * h * v_heads  # in_proj qkv, z, b, a
    linear += (2 * k_dim + v_dim) * conv + 2 * v_heads + 128 + v_dim * h  # conv1d, A_log, dt_bias, norm, out
    per_layer = 3 * h * inter + 2 * h  # MLP + the two norms
    expected = 2 * v * h + 16 * (full + per_layer) + 48 * (linear + per_layer) + h
    assert counted == expected == 26_895_998_464


def test_random_qwen3_5_target_is_initialised_as_transformers_does() -> None:
    from transformers import AutoModelForCausalLM

    model_cfg = load_config(TINY, ["--model.kind=random", "--model.vocab_size=64"]).model
    model = build_random_target(model_cfg, torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert all(not p.requires_grad and torch.isfinite(p).all() for p in model.parameters())
    reference = AutoModelForCausalLM.from_config(target_text_config(model_cfg, 64))
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():  # rotary inv_freq (partial rotary, mrope): rebuilt
        torch.testing.assert_close(buffer, buffers[name])
    layer = decoder_layers(model)[0]
    assert torch.equal(layer.linear_attn.dt_bias, torch.ones_like(layer.linear_attn.dt_bias))
    assert torch.equal(layer.input_layernorm.weight, torch.zeros_like(layer.input_layernorm.weight))  # 1 + w
    assert 0.2 < float(model.get_output_embeddings().weight.std()) < 0.4  # initializer_range 0.3
    again = build_random_target(model_cfg, torch.device("cpu"), torch.float32)
    assert torch.equal(again.get_input_embeddings().weight, model.get_input_embeddings().weight)  # seeded


def test_this_env_runs_the_torch_fallback_and_says_so(tiny_cache: Path) -> None:
    folder, _ = tiny_folder("text")
    model = load_target(folder, "cpu", torch.float32)
    kernels = linear_attention_kernels(model)
    assert kernels.model_type == "qwen3_5_text" and kernels.linear_layers == 6
    assert dict(kernels.kernels) == {"delta_rule": "torch", "conv1d": "torch", "gated_norm": "torch"}
    assert kernels.fast_path == "no"
    assert "fast path no (delta_rule torch, conv1d torch, gated_norm torch)" in kernels.line()
    plain = linear_attention_kernels(
        build_random_target(load_config("tiny-cpu").model, torch.device("cpu"), torch.float32)
    )
    assert plain == TargetKernels("qwen3", 0) and plain.fast_path == "n/a"


def test_require_fast_path_stops_a_gpu_rank_on_the_fallback_in_one_line() -> None:
    slow = TargetKernels(
        "qwen3_5_text", 48, {"delta_rule": "torch", "conv1d": "torch", "gated_norm": "torch"}
    )
    with pytest.raises(ConfigError) as info:
        require_fast_path(slow, device_type="cuda", required=True, who="rank 0 (target 0)")
    message = str(info.value)
    assert "\n" not in message and message.startswith("rank 0 (target 0): ")
    assert "torch fallback" in message and "--target.require_fast_path=false" in message
    require_fast_path(slow, device_type="cpu", required=True, who="x")  # CPU: nothing to require
    require_fast_path(slow, device_type="cuda", required=False, who="x")
    fast = TargetKernels("qwen3_5_text", 48, {"delta_rule": "fla", "conv1d": "torch", "gated_norm": "torch"})
    require_fast_path(fast, device_type="cuda", required=True, who="x")  # conv1d is not required
    require_fast_path(TargetKernels("qwen3", 0), device_type="cuda", required=True, who="x")
    assert load_config(TINY).target.require_fast_path is True
    assert load_config(TINY, ["--target.require_fast_path=false"]).target.require_fast_path is False


DETECT = textwrap.dedent(
    """
    import json, sys
    from training.model import kernels
    if sys.argv[1] == "hide":
        kernels.hide_kernels()
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], local_files_only=True)
    found = kernels.linear_attention_kernels(model)
    print(json.dumps({"kernels": dict(found.kernels), "problem": kernels.import_problem()}))
    """
)


def _detect(mode: str, folder: Path, extra_path: Path | None = None) -> dict:
    path = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-c", DETECT, mode, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_detection_reads_the_implementation_transformers_chose(tiny_cache: Path, tmp_path: Path) -> None:
    """transformers >= 5.17 imports ``fla`` (any importable package of that name) when
    ``modeling_qwen3_5`` is imported and calls what it found: with a package exposing the two
    delta-rule functions on the path, the detector must report ``fla`` for the delta rule and
    still ``torch`` for the others; ``hide_kernels`` must bring the fallback back. (The real
    flash-linear-attention needs Triton and a GPU; the benchmark and the trainer's start-up line
    report it there.)"""
    import transformers
    from packaging.version import Version

    folder, _ = tiny_folder("text")
    if Version(transformers.__version__) < Version("5.17"):
        pytest.skip("transformers < 5.17 takes fla only with CUDA (is_flash_linear_attention_available)")
    package = tmp_path / "site" / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    for init in (tmp_path / "site" / "fla", tmp_path / "site" / "fla" / "ops"):
        (init / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "def chunk_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError('not a kernel')\n"
        "def fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError('not a kernel')\n"
    )
    found = _detect("plain", folder, tmp_path / "site")
    assert found["kernels"] == {"delta_rule": "fla", "conv1d": "torch", "gated_norm": "torch"}
    assert found["problem"] == ""
    hidden = _detect("hide", folder, tmp_path / "site")
    assert hidden["kernels"]["delta_rule"] == "torch"
    assert "hidden" in hidden["problem"]


def test_source_of_unwraps_only_transformers_fallback_wrappers() -> None:
    assert source_of(None) == "torch"
    assert source_of(torch.nn.functional.conv1d) == "torch"
    assert source_of(json.dumps) == "json"


def test_warm_runs_the_target_kernels_on_a_cut_with_one_layer_of_each_kind(tiny_cache: Path) -> None:
    from training.compile.cache import ShapeRecord
    from training.run.warm import (
        kernel_probe_target,
        run_target_shapes,
        target_config,
        warm_target_kernels,
    )

    big = load_config("qwen3.6-27b-random")
    cut = kernel_probe_target(target_config(big, ""), torch.device("meta"), torch.bfloat16)
    assert cut is not None and cut.config.layer_types == qwen3_5_layer_types(4, 4)
    assert cut.config.linear_num_value_heads == 48 and cut.config.head_dim == 256  # the layer shapes stay
    assert (
        kernel_probe_target(
            target_config(load_config("tiny-cpu", ["--model.kind=random"]), ""),
            torch.device("meta"),
            torch.float32,
        )
        is None
    )

    folder, config = tiny_folder("multimodal")
    probe = kernel_probe_target(target_config(config, str(folder)), torch.device("cpu"), torch.float32)
    assert probe is not None and len(decoder_layers(probe)) == 4
    lines: list[str] = []
    shapes = [ShapeRecord(0, 3, 64), ShapeRecord(1, 1, 192)]
    done = run_target_shapes(probe, shapes, device=torch.device("cpu"), echo=lines.append)
    assert [(d.bucket, d.batch_size, d.length) for d in done] == [(0, 3, 64), (1, 1, 192)]
    assert all(d.seconds > 0 for d in done) and len(lines) == 2
    # On this CPU env the delta rule is the torch fallback: nothing to warm, and no error on CPU.
    assert warm_target_kernels(config, probe, shapes, device=torch.device("cpu"), echo=lines.append) == (
        "no",
        [],
    )
