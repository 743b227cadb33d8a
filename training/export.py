"""``python -m training export``: a run's trained drafter as a folder serving engines load.

    python -m training export --run-dir D [--step N] --out DIR [--dtype bfloat16|float32]

The folder (written next to ``DIR`` as a hidden temp folder, then renamed onto ``DIR``, so a
reader never sees half of it) holds:

``model.safetensors``
    The drafter's own weights under the reference names (z-lab/dflash ``dflash/model.py``
    ``DFlashDraftModel``; loaded by SGLang ``python/sglang/srt/models/dflash.py``
    ``load_weights`` and vLLM ``vllm/model_executor/models/qwen3_dflash.py``): ``fc.weight``,
    ``hidden_norm.weight``, ``layers.N.input_layernorm.weight``,
    ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``,
    ``layers.N.post_attention_layernorm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
    ``norm.weight``. No ``embed_tokens`` / ``lm_head``: every engine takes them from the target
    (SGLang: "DFlash uses the target model's embedding/lm_head"), and no MASK vector: MASK is
    the target's embedding of ``dflash_config.mask_token_id``.
``config.json``
    A Qwen3 config with ``architectures: ["DFlashDraftModel"]``, the drafter's head layout,
    ``layer_types`` (``full_attention`` / ``sliding_attention``) and ``sliding_window`` (the
    engines make sliding layers causal and full layers bidirectional, as the trainer does),
    ``rope_theta``, ``vocab_size`` (the target's embedding rows), ``block_size`` and
    ``dflash_config: {block_size, mask_token_id, target_layer_ids}`` as z-lab's published
    drafters have them (SGLang's ``parse_dflash_draft_config`` reads ``dflash_config`` first,
    then the top level).
the tokenizer files
    The run's tokenizer (``save_pretrained``), so the folder names its MASK token.
``ddtree.json`` (when the run's evals measured DDTree, or its drafter has fitted temperatures)
    What the serving side sets for DDTree (``tree_settings``): the tree budgets the eval measured
    with their tau (greedy replay on held-out prompts) and, where the cost was measured on the
    target's device, each budget's modelled speedup, the best budget and that device; the
    per-depth temperatures of the drafter's distributions where a calibration was fitted
    (``tree-calibration.json`` in the run dir, benchmarks/tree_bench.py ``levers calibrate --save``).

The checkpoint read is the newest complete one (``--step N``: that one): checkpoints are
written to a temp file and renamed, so a live run is never disturbed and never read half-written;
a checkpoint pruned between listing and reading is retried with the then-newest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from training.config import ConfigError, RunConfig, TrainingError, read_config
from training.contract import (
    CHECKPOINT_DIR,
    DDTREE_FILE,
    EVENTS_FILE,
    HF_CONFIG_FILE,
    TREE_CALIBRATION_FILE,
    parse_events,
    tree_figures,
)
from training.model.drafter import DrafterConfig, drafter_layout
from training.model.hf_folder import ARCHITECTURE, WEIGHTS, load_export_into, read_export
from training.run.checkpoint import drafter_weights, list_checkpoints, verify_checkpoint

__all__ = ["ARCHITECTURE", "WEIGHTS", "export_run", "load_export_into", "read_export"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(TrainingError):
    """The export folder could not be written (disk full, permissions): exit 1, one line."""


@dataclass(frozen=True)
class Exported:
    """Where an export went and what it holds."""

    path: Path
    step: int
    checkpoint: str
    num_tensors: int
    mask_token_id: int
    ddtree: bool = False  # DDTREE_FILE written


def _load_checkpoint(run_dir: Path, step: int | None) -> dict[str, Any]:
    for _ in range(3):  # a live run may prune the file between listing and reading it
        found = list_checkpoints(run_dir)
        if not found:
            raise ConfigError(f"{run_dir}/{CHECKPOINT_DIR} has no checkpoint yet: export after the first one")
        if step is None:
            chosen = found[-1]
        else:
            match = [c for c in found if c[0] == step]
            if not match:
                have = ", ".join(str(s) for s, _ in found)
                raise ConfigError(
                    f"no checkpoint of step {step} in {run_dir}/{CHECKPOINT_DIR} (have: {have})"
                )
            chosen = match[0]
        try:
            why = verify_checkpoint(chosen[1], chosen[0])
            if why and chosen[1].exists():
                raise ConfigError(
                    f"checkpoint {chosen[1]} failed its check: {why}; export another step (--step)"
                )
            state = torch.load(chosen[1], map_location="cpu", weights_only=False)
        except FileNotFoundError:
            if step is not None:
                raise ConfigError(
                    f"checkpoint of step {step} was pruned by the run while reading it"
                ) from None
            continue
        state["path"] = str(chosen[1].resolve())
        state["step"] = int(state.get("step", chosen[0]))
        return state
    raise ConfigError(f"{run_dir}/{CHECKPOINT_DIR} changed three times while reading: retry")


def run_target_config(config: RunConfig) -> tuple[Any, Any]:
    """(target HF config, tokenizer) of a run, without loading the target's weights."""
    from training.model.target import load_tokenizer, model_source
    from training.run.warm import target_config

    folder, tok_dir = model_source(config)
    return target_config(config, folder), load_tokenizer(tok_dir)


def export_config(cfg: DrafterConfig, target_config: Any, tokenizer: Any) -> dict[str, Any]:
    """The ``config.json`` of an exported drafter (see the module docstring)."""
    layout = drafter_layout(target_config, cfg)
    text = getattr(target_config, "text_config", None) or target_config
    layer_ids = cfg.resolved_target_layers(int(text.num_hidden_layers))
    types = cfg.layer_types()
    sliding = "sliding_attention" in types
    eos = getattr(tokenizer, "eos_token_id", None)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "hidden_size": layout["hidden_size"],
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": layout["num_attention_heads"],
        "num_key_value_heads": layout["num_key_value_heads"],
        "head_dim": layout["head_dim"],
        "intermediate_size": layout["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 32768)),
        "vocab_size": int(text.vocab_size),
        "tie_word_embeddings": False,
        "layer_types": types,
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "max_window_layers": cfg.num_layers,
        "num_target_layers": int(text.num_hidden_layers),
        "block_size": cfg.block_size,
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": layer_ids,
        },
        "eos_token_id": eos,
        "bos_token_id": None,
    }


def tree_settings(run_dir: Path, step: int) -> dict[str, Any] | None:
    """``ddtree.json`` of an export of ``step`` (the module docstring): the figures of the run's held-out
    eval of that step, else its last one (``eval_step`` says which); None when the run has neither
    tree figures nor temperatures."""
    events_path = run_dir / EVENTS_FILE
    events = parse_events(events_path.read_text(encoding="utf-8")).events if events_path.is_file() else ()
    found = [
        figures
        for ev in events
        if ev["event"] == "eval" and ev.get("split", "held_out") == "held_out"
        if (figures := tree_figures(ev)) is not None
    ]
    same = [f for f in found if f.step == step]
    figures = (same or found or [None])[-1]
    calibration = run_dir / TREE_CALIBRATION_FILE
    temperatures = None
    if calibration.is_file():
        try:
            fitted = json.loads(calibration.read_text(encoding="utf-8"))
            temperatures = [float(t) for t in fitted["temperatures"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{calibration}: not a calibration file ({exc}); delete it or fit it again"
            ) from None
    if figures is None and temperatures is None:
        return None
    body: dict[str, Any] = {"checkpoint_step": step}
    if figures is not None:
        body.update(
            eval_step=figures.step,
            chain_tau=figures.taus.get(0),
            budgets=[
                {
                    "budget": b,
                    "tau_mean": figures.taus[b],
                    "tree_size_mean": figures.sizes.get(b),
                    "modelled_speedup": figures.speedups.get(b),
                }
                for b in sorted(b for b in figures.taus if b > 0)
            ],
            best_budget=figures.best_budget,
            best_speedup_modelled=figures.best_speedup,
            device=figures.device or None,
            context=figures.context,
        )
    if temperatures is not None:
        body["temperatures"] = temperatures  # depth 1..block_size-1: divide the logits by these
        # the taus above are the raw distributions'; these were measured with the temperatures
        body["temperatures_step"] = fitted.get("step")
        taus = fitted.get("taus")
        body["temperatures_taus"] = taus.get("calibrated") if isinstance(taus, dict) else None
    return body


def export_run(run_dir: Path, out: Path, *, step: int | None = None, dtype: str = "bfloat16") -> Exported:
    """Export a run's checkpoint (the newest, or ``step``) to ``out`` (replaced atomically)."""
    from safetensors.torch import save_file

    from training.run.core import drafter_config, mask_token_id

    if dtype not in DTYPES:
        raise ConfigError(f"export --dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    run_dir = run_dir.resolve()
    config = read_config(run_dir)
    state = _load_checkpoint(run_dir, step)
    weights = drafter_weights(state, state["path"])
    target_config, tokenizer = run_target_config(config)
    mask_id = state.get("mask_token_id")
    if mask_id is None:
        mask_id = mask_token_id(config, tokenizer, target_config)
    cfg = replace(drafter_config(config), mask_token_id=int(mask_id))
    body = export_config(cfg, target_config, tokenizer)
    tensors = {name: t.detach().to(DTYPES[dtype]).contiguous() for name, t in weights.items()}
    body["dtype"] = dtype
    tree = tree_settings(run_dir, int(state["step"]))

    out = out.expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS, 0o644)  # safetensors writes 0600; engines may run as another user
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        if tree is not None:
            (tmp / DDTREE_FILE).write_text(json.dumps(tree, indent=2) + "\n", encoding="utf-8")
        tokenizer.save_pretrained(str(tmp))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, int(state["step"]), state["path"], len(tensors), int(mask_id), tree is not None)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Put ``tmp`` at ``out``: a rename when ``out`` is new, else swap then delete the old one."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export --out {out} exists and is not a folder")
    if not out.exists():
        tmp.rename(out)
        return
    if any(out.iterdir()) and not (out / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"export --out {out} is a non-empty folder that is not an export: choose another")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def export_main(
    run_dir: Path,
    out: Path,
    step: int | None,
    dtype: str,
    *,
    gguf: bool = False,
    target_model_dir: Path | None = None,
) -> int:
    """The command: export, then one line saying where it went; ``gguf``: also the drafter and its
    target as GGUF files in ``<out>-gguf/`` (``training.engines.gguf``)."""
    if target_model_dir is not None and not gguf:
        raise ConfigError("export --target-model-dir is for --gguf: add --gguf")
    try:
        done = export_run(run_dir, out, step=step, dtype=dtype)
    except OSError as exc:
        raise ExportError(f"export to {out} failed: {exc}") from None
    print(
        f"exported step {done.step} ({done.num_tensors} tensors, {dtype}, "
        f"mask_token_id {done.mask_token_id}{', ' + DDTREE_FILE if done.ddtree else ''}) -> {done.path}"
    )
    if gguf:
        from training.engines.gguf import export_gguf
        from training.engines.llamacpp import default_cache_root, ensure_llamacpp
        from training.model.smol import gguf_path
        from training.model.target import model_source

        config = read_config(run_dir.resolve())
        own = Path(model_source(config)[0])
        target = target_model_dir.expanduser().resolve() if target_model_dir else own
        shipped = gguf_path() if config.model.kind == "smol" and target == own else None
        build = ensure_llamacpp(default_cache_root())
        pair = export_gguf(
            build, done.path, target, done.path.with_name(done.path.name + "-gguf"), shipped_target=shipped
        )
        print(pair.text())
    return 0
