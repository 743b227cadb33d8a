"""The drafter-training core: the one implementation both drivers run.

The single-process trainer (``training.run.single``: target and drafter in one process) and the
drafter ranks of an N+M job (``training.run.distributed``) differ only in where hidden states come
from and who writes what; everything else about training the drafter is here, written once,
and so are the pieces ``training.run.plan`` (the split probe) and ``training.run.warm`` (the compile
warm-up) reuse:

    drafter_config, build_drafter     the run config's drafter, sharing the target's embedding/lm_head
    build_optimizer                   AdamW + linear warmup and cosine decay (``lr_lambda``)
    batch_anchors                     a batch's anchors, drawn from (seed, data position) only
    train_forward, drafter_step       forward under the device's autocast; one optimizer step
    checkpoint_state                  what a checkpoint holds (``training.run.checkpoint`` writes,
                                      verifies and resumes it: ``CheckpointManager``)
    report_step                       the ``step`` event (training/EVENTS.md), metrics, the human line
    compiles                          whether a run compiles on a device (compile.enabled)
    load_train_data                   the tokenized data and its cache folder
    emit_run_start, announce_buckets, load_run_target   the start-up events both drivers write
    ready_target                      a rank that runs the target forward: its layers and kernels
                                      (line + ``target`` event), the fast-path check, the kernel cache,
                                      its forward compiled (``compile.target``)
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.config import ConfigError, RunConfig, config_to_dict
from training.contract import DATA_CACHE_ENV
from training.data.buckets import Position, format_bucket_table
from training.data.corpus import default_cache_dir
from training.data.dataset import TrainData, load_prompt_set, load_tokenized
from training.events import EventWriter
from training.model.drafter import (
    DFlashDrafter,
    DrafterConfig,
    DraftOutput,
    resolve_mask_token_id,
    sample_anchors,
)
from training.model.hf_folder import load_export_into
from training.model.kernels import (
    TargetKernels,
    autotune_results,
    linear_attention_kernels,
    require_fast_path,
)
from training.model.target import (
    check_vocab,
    compile_target,
    describe_layers,
    layer_types,
    load_model,
    load_tokenizer,
    model_source,
    resolve_device,
    resolve_dtype,
    text_config,
)
from training.progress import Progress
from training.wandb_logger import MetricsLogger

Echo = Callable[[str], None]
DATA_CACHE = "data-cache"  # <run-dir>/data-cache unless data.cache_dir names one


# ------------------------------------------------------------------ the drafter
def drafter_config(config: RunConfig) -> DrafterConfig:
    """``DrafterConfig`` from the run config's [drafter] section (matching field names)."""
    known = {f.name for f in fields(DrafterConfig)}
    values = {f.name: getattr(config.drafter, f.name) for f in fields(config.drafter) if f.name in known}
    try:
        return DrafterConfig(**values)
    except ValueError as exc:  # DrafterConfig's own checks name the key
        raise ConfigError(f"config key {exc}") from None


def mask_token_id(config: RunConfig, tokenizer: Any, target_config: Any) -> int:
    """The run's MASK token id (``drafter.resolve_mask_token_id``); a bad one is a ConfigError."""
    try:
        return resolve_mask_token_id(config.drafter.mask_token_id, tokenizer, target_config)
    except ValueError as exc:
        raise ConfigError(f"config key {exc}") from None


def build_drafter(
    config: RunConfig, target: nn.Module, device: torch.device, tokenizer: Any
) -> DFlashDrafter:
    """A fresh drafter sharing the target's frozen embedding and lm_head (seeded by train.seed),
    or ``drafter.init_from``'s weights (a resume then loads its checkpoint over them)."""
    cfg = replace(drafter_config(config), mask_token_id=mask_token_id(config, tokenizer, target.config))
    torch.manual_seed(config.train.seed)
    try:
        drafter = DFlashDrafter(
            cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings()
        )
    except ValueError as exc:  # a layout the target cannot take (heads vs KV heads)
        raise ConfigError(f"config key {exc}") from None
    if config.drafter.init_from:
        load_export_into(drafter, Path(config.drafter.init_from))
    if compiles(config, device):
        drafter.compile_regions(config.compile.mode)
    return drafter.to(device)


def trainable_parameters(drafter: nn.Module) -> list[nn.Parameter]:
    """The drafter's own weights (the shared embedding and lm_head are frozen and not registered)."""
    return [p for p in drafter.parameters() if p.requires_grad]


def set_threads(config: RunConfig) -> None:
    """``train.torch_threads`` (0 = torch's default)."""
    if config.train.torch_threads > 0:
        torch.set_num_threads(config.train.torch_threads)


# ------------------------------------------------------------------ optimizer
def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def fused_adamw(params: list[nn.Parameter]) -> bool:
    """Whether AdamW runs fused (one kernel for every parameter's update instead of a few
    per tensor): when every parameter is on a CUDA device. The CPU keeps the default
    (foreach) implementation, so CPU runs and their tests are unchanged."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(
    config: RunConfig, drafter: nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the drafter's trainable weights (fused on a GPU: ``fused_adamw``) and its
    warmup + cosine schedule ([train])."""
    train = config.train
    params = trainable_parameters(drafter)
    optimizer = torch.optim.AdamW(
        params,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        weight_decay=train.weight_decay,
        fused=fused_adamw(params) or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(train.warmup_steps, train.steps, train.min_lr_ratio)
    )
    return optimizer, scheduler


# ------------------------------------------------------------------ the step
@dataclass(frozen=True)
class StepResult:
    loss: float
    acc: list[float]
    tau: float
    grad_norm: float
    lr: float
    num_tokens: int


def anchor_generator(seed: int, position: Position) -> torch.Generator:
    """The anchor RNG of one batch: a function of (seed, epoch, batch index) only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + position.epoch) * 10_000_019 + position.index)


def batch_anchors(
    config: RunConfig, loss_mask: torch.Tensor, lengths: torch.Tensor, position: Position
) -> torch.Tensor:
    """The anchors of the batch taken at ``position`` (on ``loss_mask``'s device): the same
    anchors on every driver and after a resume, since they depend on the position only."""
    return sample_anchors(
        loss_mask, lengths, config.drafter.num_anchors, anchor_generator(config.train.seed, position)
    )


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The drafter's autocast: bf16 on a GPU, none (fp32) on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


def train_forward(
    drafter: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
) -> DraftOutput:
    """The drafter's training forward (train mode, the device's autocast)."""
    drafter.train()
    dtype = autocast_dtype(input_ids.device)
    with torch.autocast(input_ids.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        return drafter(input_ids, hidden, loss_mask, anchors)


def drafter_step(
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    *,
    grad_clip: float,
    always_backward: bool = False,
) -> StepResult:
    """One optimizer step of the drafter on given target hidden states.

    ``always_backward``: run backward even with no labelled token (a zero loss), as DDP
    needs every rank to join each gradient all-reduce (training.run.distributed)."""
    out = train_forward(drafter, input_ids, loss_mask, hidden, anchors)
    optimizer.zero_grad(set_to_none=True)
    lr = float(scheduler.get_last_lr()[0])
    if out.num_tokens > 0 or always_backward:
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(drafter), grad_clip))
        optimizer.step()
    else:
        grad_norm = 0.0
    scheduler.step()
    return StepResult(
        loss=float(out.loss.detach()),
        acc=[float(a) for a in out.acc_per_offset.detach().cpu()],
        tau=float(out.tau_estimate),
        grad_norm=grad_norm,
        lr=lr,
        num_tokens=int(out.num_tokens),
    )


def report_step(
    events: EventWriter,
    result: StepResult,
    *,
    step: int,
    total_steps: int,
    epoch: int,
    tokens_per_s: float,
    device: torch.device,
    echo: Echo,
    logger: MetricsLogger | None = None,
    note: str = "",
    **extra: Any,
) -> None:
    """The ``step`` event (its fields, then ``extra``), the metrics logger and the human line."""
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    metrics = {
        "step": step,
        "total_steps": total_steps,
        "epoch": epoch,
        "loss": result.loss,
        "acc": result.acc,
        "tau": result.tau,
        "lr": result.lr,
        "tokens_per_s": tokens_per_s,
        "grad_norm": result.grad_norm,
        "mem_gib": mem,
    }
    # labelled: the block positions the loss (and the lm_head) ran on; for the FLOP count
    events.emit("step", **metrics, labelled=result.num_tokens, **extra)
    if logger is not None:
        logger.log({f"train/{k}": v for k, v in metrics.items() if k != "acc"}, step)
    echo(
        f"step {step}/{total_steps} epoch {epoch} loss {result.loss:.4f} "
        f"tau {result.tau:.3f} acc1 {result.acc[0] if result.acc else 0:.3f} lr {result.lr:.2e} "
        f"gnorm {result.grad_norm:.2f} tok/s {tokens_per_s:.0f}{note}"
    )


def batch_shape(input_ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, int]:
    """What a step trained on, as ``step`` event extras: real tokens, rows, padded length."""
    return {
        "tokens": int(lengths.sum()),
        "sequences": int(input_ids.shape[0]),
        "padded_length": int(input_ids.shape[1]),
    }


# ------------------------------------------------------------------ checkpoints
def checkpoint_state(
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    position: Position,
    tau: float,
    config: RunConfig,
    **extra: Any,
) -> dict[str, Any]:
    """What a checkpoint holds besides its step and RNG states (the writer adds those)."""
    own = getattr(drafter, "module", drafter)  # DDP wraps the drafter on drafter ranks
    return {
        "drafter": own.state_dict(),
        "mask_token_id": int(own.cfg.mask_token_id),  # what the export writes
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "position": (position.epoch, position.index),
        "tau": tau,
        "config": config_to_dict(config),
        **extra,
    }


# ------------------------------------------------------------------ start-up
def compiles(config: RunConfig, device: torch.device) -> bool:
    """Whether a run compiles: ``compile.enabled`` on, or auto on a GPU."""
    mode = config.compile.enabled
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def data_cache_dir(config: RunConfig, default: Path) -> Path:
    """``data.cache_dir``, else ``$FLEET_DATA_CACHE``, else ``default`` (a run's:
    ``<run-dir>/data-cache``). A shared root holds one tokenized copy per (data files, tokenizer,
    max_length) fingerprint: ``datasets`` keys its cache files by that hash, so runs of the same
    data reuse one copy and runs of other data never read it."""
    if config.data.cache_dir:
        return Path(config.data.cache_dir).expanduser()
    shared = os.environ.get(DATA_CACHE_ENV, "")
    return Path(shared) if shared else default


def regenerate_data(config: RunConfig, tokenizer: Any, echo: Echo = print) -> Path:
    """The JSONL of ``data.regenerate``: shipped prompts, the target's greedy replies
    (``training.data.regen``), generated once per (model, prompts, settings) into the cache root."""
    from training.data.magpie import MagpieSettings, user_turn
    from training.data.regen import regenerated_data, server_regenerated_data

    folder, _tok_dir = model_source(config)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    model_id = Path(folder).name if config.model.kind in ("tiny", "smol") else folder
    try:
        if config.data.regen_servers:
            return server_regenerated_data(
                default_cache_dir(config.model.cache_dir),
                model_id,
                count=config.data.regen_prompts,
                max_new_tokens=config.data.regen_max_new_tokens,
                servers=config.data.regen_servers,
                concurrency=config.data.regen_concurrency,
                sources=config.data.regen_sources,
                magpie=MagpieSettings.of(config.data),
                magpie_share=config.data.magpie_share,
                turn=lambda: user_turn(tokenizer),
                echo=echo,
            )
        return regenerated_data(
            default_cache_dir(config.model.cache_dir),
            model_id,
            lambda: (load_model(config, folder), tokenizer),
            count=config.data.regen_prompts,
            max_new_tokens=config.data.regen_max_new_tokens,
            batch_size=config.data.regen_batch_size,
            dtype=f"{device.type}-{dtype}",
            sources=config.data.regen_sources,
            magpie=MagpieSettings.of(config.data),
            magpie_share=config.data.magpie_share,
            echo=echo,
        )
    except ValueError as exc:
        raise ConfigError(f"config key {exc}") from None


def planned_magpie_file(config: RunConfig) -> Path | None:
    """Where ``data.regenerate`` keeps the requests Magpie writes for this config (its report
    beside it: ``*.report.json``), None where ``data.regen_sources`` has no "magpie"."""
    from training.data.magpie import MagpieSettings, magpie_path, sampled_how
    from training.data.regen import source_counts

    data = config.data
    _shipped, written = source_counts(data.regen_prompts, data.regen_sources, data.magpie_share)
    if not written:
        return None
    folder, _tok_dir = model_source(config)
    model_id = Path(folder).name if config.model.kind in ("tiny", "smol") else folder
    device = resolve_device(config.model.device)
    dtype = f"{device.type}-{resolve_dtype(config.model.dtype, device)}"
    how = sampled_how(data.regen_batch_size, dtype, bool(data.regen_servers))
    cache = default_cache_dir(config.model.cache_dir)
    return magpie_path(cache, model_id, written, MagpieSettings.of(data), how)


def planned_regen_file(config: RunConfig) -> Path:
    """The file ``data.regenerate`` trains on (it may not be generated yet), without building it;
    with Magpie's requests not written yet, a ``missing`` path."""
    from training.data.magpie import cached_prompts
    from training.data.regen import (
        SERVER_REGEN_FILE,
        regen_path,
        server_regen_folder,
        shipped_prompts,
        source_counts,
    )

    data = config.data
    folder, _tok_dir = model_source(config)
    model_id = Path(folder).name if config.model.kind in ("tiny", "smol") else folder
    cache = default_cache_dir(config.model.cache_dir)
    device = resolve_device(config.model.device)
    dtype = f"{device.type}-{resolve_dtype(config.model.dtype, device)}"
    shipped, _written = source_counts(data.regen_prompts, data.regen_sources, data.magpie_share)
    prompts = shipped_prompts(shipped, data.regen_sources)
    magpie_file = planned_magpie_file(config)
    if magpie_file is not None:
        magpie = cached_prompts(magpie_file)
        if magpie is None:
            return cache / "regen" / "missing"
        prompts += magpie
    if data.regen_servers:
        found = server_regen_folder(cache, model_id, prompts, data.regen_max_new_tokens)
        return found / SERVER_REGEN_FILE if (found / "complete").is_file() else found / "missing"
    return regen_path(cache, model_id, prompts, data.regen_max_new_tokens, data.regen_batch_size, dtype)


def data_report(config: RunConfig, tokenizer: Any, default_cache: Path):  # -> DataReport
    """``python -m training data``: the report of the data this config trains on."""
    from training.data.report import DataReport, build_report

    data = config.data
    if data.regenerate and not data.path:
        path = planned_regen_file(config)
        if not path.is_file():
            where = data.regen_servers or "the target in the run's process"
            note = (
                f"data.regenerate: {data.regen_prompts} prompts, replies of <= {data.regen_max_new_tokens} "
                f"tokens written by {where} at the run's start; run the report again after that"
            )
            return DataReport("regenerated (not yet)", "", 0, 0, 0, 0, 0, {}, [], None, note=note)
        config = replace(config, data=replace(data, path=str(path)))
    report = build_report(
        config, tokenizer, default_cache_dir(config.model.cache_dir), data_cache_dir(config, default_cache)
    )
    return report


def prepare_data(config: RunConfig, default_cache: Path, echo: Echo = print) -> tuple[str, Any, TrainData]:
    """The load_data phase: the model folder, its tokenizer and the tokenized data. One Progress
    spans it, so the phase reports from its first second: a cold read of the model file or the
    first import of transformers can take longer than the cadence before a stage reports."""
    with Progress("load_data", "preparing the model and data", 3, "stages") as progress:
        folder, tok_dir = model_source(config)
        progress.advance()
        tokenizer = load_tokenizer(tok_dir)
        progress.advance()
        data = load_train_data(config, tokenizer, default_cache, echo)
    return folder, tokenizer, data


def load_train_data(config: RunConfig, tokenizer: Any, default_cache: Path, echo: Echo = print) -> TrainData:
    """The run's tokenized data (cached in ``data_cache_dir``) with its bucket planner."""
    data = config.data
    if data.regenerate and not data.path:
        data = replace(data, path=str(regenerate_data(config, tokenizer, echo)))
    caches = default_cache_dir(config.model.cache_dir), data_cache_dir(config, default_cache)
    # the eval sets that are not splits of this data (general, files), read only where a run evaluates
    others = [s for s in config.eval.active_sets if s not in ("held_out", "train")]
    others = others if config.eval.num_prompts > 0 else []
    # One unit a file: datasets tokenizes (or finds its cached copy) in one call; the events say it lives.
    units = 1 + bool(data.eval_path) + len(others)
    with Progress("load_data", "tokenizing the data", units, "data sets") as progress:
        tokenized = load_tokenized(data, tokenizer, *caches)
        held_out = None
        if data.eval_path:
            progress.advance()
            held_out = load_tokenized(replace(data, path=data.eval_path), tokenizer, *caches)
        sets = {}
        for name in others:
            progress.advance()
            sets[name] = load_prompt_set(name, tokenizer, data.reasoning, caches[1])
    return TrainData(tokenized, data, held_out, sets)


def emit_run_start(
    events: EventWriter,
    config: RunConfig,
    run_dir: Path,
    *,
    host: str,
    world_size: int,
    device: str,
    **extra: Any,
) -> None:
    """The ``run_start`` event of this process."""
    events.emit(
        "run_start",
        config=config.name,
        run_dir=str(run_dir),
        pid=os.getpid(),
        host=host,
        world_size=world_size,
        device=device,
        **extra,
    )


def announce_buckets(data: TrainData, events: EventWriter, echo: Echo) -> None:
    """``phase: buckets``, the bucket table in the user's log format, the ``buckets`` event."""
    events.phase("buckets")
    table = data.planner.table()
    echo(format_bucket_table(table))
    events.emit("buckets", **table.event_fields())


def load_run_target(
    config: RunConfig, folder: str, tokenizer: Any, events: EventWriter | None
) -> tuple[nn.Module, float]:
    """The frozen target and the seconds it took; ``load_progress`` events when ``events``."""
    started = time.monotonic()
    if events is not None:
        events.emit("load_progress", what="target", done=0, total=1, seconds=0.0)
    with Progress("load_target", "loading the target", 1, "models"):
        target = load_model(config, folder)
    check_vocab(target, tokenizer)
    seconds = time.monotonic() - started
    if events is not None:
        events.emit("load_progress", what="target", done=1, total=1, seconds=seconds)
    return target, seconds


def ready_target(
    config: RunConfig,
    target: nn.Module,
    layer_ids: list[int],
    device: torch.device,
    *,
    events: EventWriter | None,
    echo: Echo,
    who: str,
) -> TargetKernels:
    """Before a rank's first target forward: the start-up lines (chosen layers with their mixers;
    which linear-attention kernels run), the ``target`` event, ``target.require_fast_path`` (one
    line and exit 2 instead of a ~1.5x slower run), the forward compiled where the run compiles and
    ``compile.target`` is on (``compile_target``: a dense target only) and, on a GPU under
    ``$FLEET_COMPILE_CACHE``,
    the Triton cache dir of the compile-cache key, so the linear-attention kernels' compiled code
    and autotune results (``fab warm`` runs them) are found there and new ones land there."""
    from training.compile.cache import activate, resolve_root

    kernels = linear_attention_kernels(target)
    types = layer_types(target)
    full = sum(1 for t in types if t == "full_attention")
    echo(
        f"Target layers {describe_layers(target, layer_ids)} of {len(types)} "
        f"({kernels.linear_layers} linear-attention, {full} full-attention)"
    )
    echo(kernels.line())
    if events is not None:
        events.emit(
            "target",
            model_type=kernels.model_type,
            num_layers=len(types),
            layer_ids=list(layer_ids),
            linear_layers=kernels.linear_layers,
            kernels=dict(kernels.kernels),
            fast_path=kernels.fast_path,
            hidden_size=int(text_config(target).hidden_size),
        )
    require_fast_path(kernels, device_type=device.type, required=config.target.require_fast_path, who=who)
    if compiles(config, device) and config.compile.target:
        if compile_target(target, mode=config.compile.mode):
            echo("target forward: compiled per bucket shape (compile.target)")
        else:
            echo("target forward: eager (compile.target: linear-attention layers run their own kernels)")
    root = resolve_root()
    if kernels.fast_path == "yes" and device.type == "cuda" and root is not None:
        triton_dir = activate(root, device, load=False).cache.triton_dir
        found = autotune_results(triton_dir)
        cold = "" if found else " (cold: the first forward autotunes, ~47 s on an H200; `fab warm` does it)"
        echo(f"target kernel cache {triton_dir}: {found} autotune results{cold}")
    return kernels
