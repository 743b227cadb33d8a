"""The single-process trainer: target and drafter on one device (CPU or one GPU).

The step is split so that it does not care where hidden states come from (issue 8 feeds
them from other processes): ``target_forward`` (training.target) makes them,
``drafter_step`` consumes them. Anchors are drawn from a generator seeded by the batch's
data position, so a resumed run draws exactly the anchors the uninterrupted one would.

Resume is automatic: a run dir that holds checkpoints continues from the newest one
(model, optimizer, scheduler, data position, RNG). SIGTERM/SIGINT finish the current
step, checkpoint, emit ``phase: stopped`` and return normally (exit 0).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from training import attention, warm
from training.buckets import Position, format_bucket_table
from training.checkpoint import (
    check_resumable,
    load_latest,
    remove_stale_temps,
    restore_rng,
    save_checkpoint,
)
from training.config import ConfigError, RunConfig, config_to_dict, write_config
from training.corpus import default_cache_dir
from training.data import Batch, TrainData, load_tokenized
from training.drafter import DFlashDrafter, DrafterConfig, sample_anchors
from training.eval import evaluate_acceptance
from training.events import EventWriter, print0
from training.target import (
    check_vocab,
    load_model,
    load_tokenizer,
    model_source,
    num_layers,
    resolve_device,
    target_forward,
)
from training.wandb_logger import NullLogger, make_logger


@dataclass(frozen=True)
class StepResult:
    loss: float
    acc: list[float]
    tau: float
    grad_norm: float
    lr: float
    num_tokens: int


def drafter_config(config: RunConfig) -> DrafterConfig:
    """``DrafterConfig`` from the run config's [drafter] section (matching field names)."""
    known = {f.name for f in fields(DrafterConfig)}
    values = {f.name: getattr(config.drafter, f.name) for f in fields(config.drafter) if f.name in known}
    values["anchor_length"] = config.data.max_length  # num_anchors is per max_length sequence
    try:
        return DrafterConfig(**values)
    except ValueError as exc:  # DrafterConfig's own checks name the key
        raise ConfigError(f"config key {exc}") from None


def anchors_per_row(config: RunConfig, padded_length: int) -> int:
    """``drafter.num_anchors`` scaled to a batch padded to ``padded_length`` (DrafterConfig.anchors_for)."""
    return drafter_config(config).anchors_for(padded_length)


def build_drafter(config: RunConfig, target: nn.Module, device: torch.device) -> DFlashDrafter:
    """A fresh drafter sharing the target's frozen embedding and lm_head (seeded by train.seed)."""
    torch.manual_seed(config.train.seed)
    drafter = DFlashDrafter(
        drafter_config(config), target.config, target.get_input_embeddings(), target.get_output_embeddings()
    )
    return drafter.to(device)


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def anchor_generator(seed: int, position: Position) -> torch.Generator:
    """The anchor RNG of one batch: a function of (seed, epoch, batch index) only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + position.epoch) * 10_000_019 + position.index)


def drafter_step(
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    *,
    grad_clip: float,
    autocast_dtype: torch.dtype | None,
    always_backward: bool = False,
) -> StepResult:
    """One optimizer step of the drafter on given target hidden states.

    ``always_backward``: run backward even with no labelled token (a zero loss), as DDP
    needs every rank to join each gradient all-reduce (training.distributed)."""
    drafter.train()
    device_type = input_ids.device.type
    with torch.autocast(
        device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        out = drafter(input_ids, hidden, loss_mask, anchors)
    optimizer.zero_grad(set_to_none=True)
    lr = float(scheduler.get_last_lr()[0])
    params = [p for p in drafter.parameters() if p.requires_grad]
    if out.num_tokens > 0 or always_backward:
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
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


class Trainer:
    """Builds everything for a run config in ``run_dir`` and trains (``train()``)."""

    def __init__(self, config: RunConfig, run_dir: Path, *, rank: int = 0, eval_only: bool = False) -> None:
        self.config = config
        self.run_dir = run_dir.resolve()
        self.events = EventWriter(self.run_dir, rank=rank, role="single")
        self.started = time.monotonic()
        self.device = resolve_device(config.model.device)
        self.step = 0
        self.position = Position()
        self.last_tau = 1.0
        self._stop_signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.eval_only = eval_only
        if config.train.torch_threads > 0:
            torch.set_num_threads(config.train.torch_threads)
        if eval_only:  # `python -m training eval`: only phase/eval events, no run_start
            self.logger, logger_line = NullLogger("eval"), ""
            return
        check_resumable(config, self.run_dir)
        self.logger, logger_line = make_logger(config, self.run_dir)
        write_config(config, self.run_dir)
        self.events.emit(
            "run_start",
            config=config.name,
            run_dir=str(self.run_dir),
            pid=os.getpid(),
            host=socket.gethostname(),
            world_size=1,
            device=str(self.device),
        )
        print0(f"run {self.run_dir} config={config.name} device={self.device}")
        print0(logger_line)
        self._install_signals()  # a SIGTERM while loading stops cleanly before the first step

    # ----------------------------------------------------------------- setup
    def _phase(self, phase: str) -> None:
        """A phase event; an eval-only process reports only its ``eval`` phase."""
        if not self.eval_only:
            self.events.phase(phase)

    def setup(self, *, quiet_data: bool = False) -> None:
        cfg = self.config
        self._phase("load_data")
        folder, tok_dir = model_source(cfg)
        self.tokenizer = load_tokenizer(tok_dir)
        data_cache = (
            Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else self.run_dir / "data-cache"
        )

        tokenized = load_tokenized(
            cfg.data, self.tokenizer, default_cache_dir(cfg.model.cache_dir), data_cache
        )
        self.data = TrainData(tokenized, cfg.data)
        if not quiet_data:
            self.events.phase("buckets")
            table = self.data.planner.table()
            print0(format_bucket_table(table))
            self.events.emit("buckets", **table.event_fields())

        self._phase("load_target")
        print0(f"Loading target ({cfg.model.kind}) {folder or '(random weights)'}...")
        t0 = time.monotonic()
        if not self.eval_only:
            self.events.emit("load_progress", what="target", done=0, total=1, seconds=0.0)
        self.target = load_model(cfg, folder)
        check_vocab(self.target, self.tokenizer)
        seconds = time.monotonic() - t0
        if not self.eval_only:
            self.events.emit("load_progress", what="target", done=1, total=1, seconds=seconds)
        print0(f"  Loaded in {seconds:.1f}s, {num_layers(self.target)} layers")

        self._phase("load_drafter")
        self.drafter = build_drafter(cfg, self.target, self.device)
        self.layer_ids = list(self.drafter.target_layer_ids)
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        count = sum(p.numel() for p in trainable)
        print0(
            f"Drafter: {cfg.drafter.num_layers} layers, {count / 1e6:.2f}M params, "
            + f"target layers {self.layer_ids}"
        )
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=cfg.train.lr,
            betas=(cfg.train.beta1, cfg.train.beta2),
            weight_decay=cfg.train.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        )
        self._setup_compile()
        self._resume()

    def _setup_compile(self) -> None:
        mode = self.config.compile.enabled
        self.compiled = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        if not self.compiled:
            return
        self._phase("compile")
        if self.device.type == "cpu":
            attention.set_cpu_compile(True)
        buckets = warm.num_compiled_shapes(self.data.planner)  # (bucket, batch size) shapes (issue 7)
        limit = warm.set_compile_guards(self.config, self.drafter, buckets)
        print0(f"compile: on, recompile_limit={limit} (fail_on_recompile_limit_hit) for {buckets} shapes")
        self.compile_reporter = warm.prepare_trainer(self)  # cache dir + blob; compile_cache events

    def _resume(self) -> None:
        remove_stale_temps(self.run_dir)
        state = load_latest(self.run_dir, map_location="cpu")  # RNG states must stay on CPU
        if state is None:
            return
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.position = Position(*state["position"])
        self.last_tau = float(state.get("tau", 1.0))
        restore_rng(state)
        if self.eval_only:
            print0(f"Loaded {state['path']} (step {self.step})")
        else:
            print0(f"Resumed from {state['path']} at step {self.step}, next batch {self.position}")

    # ----------------------------------------------------------------- loop
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_signal = signum
        print0(f"signal {signal.Signals(signum).name}: finishing the step, then checkpoint and stop")

    def _install_signals(self) -> None:
        """SIGTERM/SIGINT only set a flag; the loop stops at the next step boundary."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum not in self._previous_handlers:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signals(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def next_batch(self) -> Batch:
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch, self.position = self.data.batch(self.position, pad_id, pad_to_bucket=self.compiled)
        return batch

    def train_step(self, batch: Batch) -> StepResult:
        ids = batch.input_ids.to(self.device, non_blocking=True)
        mask = batch.loss_mask.to(self.device, non_blocking=True)
        hidden = target_forward(self.target, ids, self.layer_ids)
        anchors = sample_anchors(
            mask,
            batch.lengths,
            anchors_per_row(self.config, mask.shape[1]),
            self.config.drafter.block_size,
            anchor_generator(self.config.train.seed, batch.position),
        )
        autocast = torch.bfloat16 if self.device.type == "cuda" else None
        return drafter_step(
            self.drafter,
            self.optimizer,
            self.scheduler,
            ids,
            mask,
            hidden,
            anchors,
            grad_clip=self.config.train.grad_clip,
            autocast_dtype=autocast,
        )

    def checkpoint(self) -> None:
        self.events.phase("checkpoint")
        state = {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "position": (self.position.epoch, self.position.index),
            "tau": self.last_tau,
            "config": config_to_dict(self.config),
        }
        saved = save_checkpoint(self.run_dir, self.step, state, self.config.checkpoint.keep)
        self.events.emit("checkpoint", step=saved.step, path=str(saved.path), seconds=saved.seconds)
        print0(f"checkpoint step {saved.step} -> {saved.path} ({saved.seconds:.2f}s)")

    def evaluate(self) -> None:
        cfg = self.config.eval
        prompts = self.data.eval_prompts(cfg.prompt_tokens, cfg.num_prompts)
        if not prompts:
            print0("eval: no held-out prompts, skipped")
            return
        self.events.phase("eval")
        t0 = time.monotonic()
        result = evaluate_acceptance(
            self.target,
            self.drafter,
            prompts,
            self.layer_ids,
            cfg.max_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.events.emit(
            "eval",
            step=self.step,
            tau_mean=result.tau_mean,
            tau_hist=list(result.hist),
            tau_estimate=self.last_tau,
        )
        self.logger.log({"eval/tau_mean": result.tau_mean, "eval/tau_estimate": self.last_tau}, self.step)
        print0(
            f"eval step {self.step}: tau_mean={result.tau_mean:.3f} (training estimate {self.last_tau:.3f}) "
            f"over {result.rounds} blocks of {result.prompts} prompts; hist={list(result.hist)} "
            f"({time.monotonic() - t0:.1f}s)"
        )

    def _log_step(self, result: StepResult, batch: Batch, seconds: float) -> None:
        cfg = self.config.train
        tokens = int(batch.lengths.sum())
        tokens_per_s = tokens / max(seconds, 1e-9)
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        fields_ = {
            "step": self.step,
            "total_steps": cfg.steps,
            "epoch": batch.position.epoch,
            "loss": result.loss,
            "acc": result.acc,
            "tau": result.tau,
            "lr": result.lr,
            "tokens_per_s": tokens_per_s,
            "grad_norm": result.grad_norm,
            "mem_gib": mem,
        }
        shape_fields = {
            "tokens": tokens,
            "sequences": int(batch.lengths.numel()),
            "padded_length": int(batch.input_ids.shape[1]),
            "step_s": seconds,
        }
        self.events.emit("step", **fields_, **shape_fields)
        self.logger.log({f"train/{k}": v for k, v in fields_.items() if k != "acc"}, self.step)
        print0(
            f"step {self.step}/{cfg.steps} epoch {batch.position.epoch} loss {result.loss:.4f} "
            f"tau {result.tau:.3f} acc1 {result.acc[0] if result.acc else 0:.3f} lr {result.lr:.2e} "
            f"gnorm {result.grad_norm:.2f} tok/s {tokens_per_s:.0f}"
        )

    def train(self) -> int:
        """Train to ``train.steps``; returns the steps done. Emits done/stopped."""
        cfg = self.config
        self._install_signals()  # already installed by __init__ unless train() runs again
        try:
            self.events.phase("train")
            last_saved = self.step
            while self.step < cfg.train.steps:
                if self._stop_signal is not None:  # arrived during setup, eval or a checkpoint
                    if last_saved != self.step:
                        self.checkpoint()
                    self.events.phase("stopped")
                    print0(f"stopped at step {self.step} (checkpointed)")
                    return self.step
                t0 = time.monotonic()
                batch = self.next_batch()
                result = self.train_step(batch)
                self.step += 1
                if self.compiled:
                    self.compile_reporter.report(self.events)  # first step, then on any new compile
                self.last_tau = result.tau
                if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps or self.step == 1:
                    self._log_step(result, batch, time.monotonic() - t0)
                if self._stop_signal is not None:
                    self.checkpoint()
                    self.events.phase("stopped")
                    print0(f"stopped at step {self.step} (checkpointed)")
                    return self.step
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.checkpoint()
                    last_saved = self.step
                    self.events.phase("train")
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                    self.evaluate()
                    self.events.phase("train")
            if last_saved != self.step:
                self.checkpoint()
            if cfg.eval.num_prompts > 0:
                self.evaluate()
            self.events.phase("done")
            self.events.emit("done", steps=self.step, seconds=time.monotonic() - self.started)
            print0(f"done: {self.step} steps in {time.monotonic() - self.started:.1f}s")
            return self.step
        finally:
            self._restore_signals()

    def close(self) -> None:
        self._restore_signals()
        self.logger.finish()
        self.events.close()


def evaluate_run(config: RunConfig, run_dir: Path) -> None:
    """``python -m training eval``: the newest checkpoint of ``run_dir`` against its target."""
    trainer = Trainer(config, run_dir, eval_only=True)
    try:
        trainer.setup(quiet_data=True)
        if trainer.step == 0:
            print0(f"eval: no checkpoint in {trainer.run_dir}/checkpoints; evaluating an untrained drafter")
        trainer.evaluate()
    finally:
        trainer.close()
