"""A drafter export against another target is one line at export, before llama.cpp's converter runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import ConfigError
from training.engines.gguf import check_pair

DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 576,
    "vocab_size": 49152,
    "num_target_layers": 30,
    "dflash_config": {"block_size": 8, "mask_token_id": 4, "target_layer_ids": [1, 8, 15, 22, 28]},
}
SMOL = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
}


def _folder(root: Path, name: str, config: dict[str, object]) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({**SMOL, "hidden_size": 960}, "hidden size 576 != 960"),
        ({**SMOL, "vocab_size": 151936}, "vocabulary 49152 != 151936"),
        ({**SMOL, "num_hidden_layers": 24}, "trained on a 30-layer target, this one has 24"),
        # a multimodal config keeps the text model's shape under text_config
        ({"architectures": ["X"], "text_config": {**SMOL, "hidden_size": 1024}}, "hidden size 576 != 1024"),
    ],
)
def test_a_wrong_target_is_one_line(tmp_path: Path, target: dict[str, object], message: str) -> None:
    drafter = _folder(tmp_path, "drafter", DRAFTER)
    other = _folder(tmp_path, "target", target)
    with pytest.raises(ConfigError, match=message) as info:
        check_pair(drafter, other)
    assert "\n" not in str(info.value) and "target it was trained for" in str(info.value)


def test_the_right_target_passes(tmp_path: Path) -> None:
    check_pair(_folder(tmp_path, "drafter", DRAFTER), _folder(tmp_path, "target", SMOL))


def test_a_missing_target_config_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        check_pair(_folder(tmp_path, "drafter", DRAFTER), tmp_path)
