"""The single-process trainer: target and drafter on one device (CPU or one GPU).

The target forward (``training.model.target.target_forward``) makes the hidden states and the
drafter step of ``training.run.core`` consumes them, the same step the drafter ranks of an N+M
job run on hidden states from other processes (``training.run.distributed``). Anchors are drawn
from a generator seeded by the batch's data position, so a resumed run draws exactly the
anchors the uninterrupted one would.

Resume is automatic: a run dir that holds checkpoints continues from the newest one
(model, optimizer, scheduler, data position, RNG). SIGTERM/SIGINT during training finish the
current step, checkpoint, emit ``phase: stopped`` and return normally (exit 0); in any other phase
(data, target loading, compile, eval) they stop it at once (``training.progress``), checkpoint
when a step was trained since the last checkpoint (an eval after a step), and say what a resume
will find (``phase: stopped`` with ``during`` and ``resume_step``), exit 0 too.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch

from training.compile.cache import start_workers
from training.config import ConfigError, RunConfig, load_config, with_loaded_shape, write_config
from training.contract import CHECKPOINT_DIR, set_label
from training.data.buckets import Position
from training.data.dataset import Batch
from training.events import EventWriter, print0
from training.model.target import (
    HiddenCache,
    is_compiled,
    num_layers,
    resolve_device,
    target_forward,
    text_config,
)
from training.progress import Progress, StopRequested, StopSignals, report_to
from training.run import core, warm
from training.run.checkpoint import CheckpointManager, check_finite
from training.run.eval import (
    evaluate_acceptance,
    tree_method_problem,
    tree_records,
    tree_summary,
    tree_table,
)
from training.run.tree_cost import TreeCost, eval_context, measure_tree_cost, tree_cost_enabled
from training.wandb_logger import NullLogger, make_logger


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
        self.signals = StopSignals(self._on_signal)
        self.phase = "load_data"  # the phase a stop signal interrupts
        self.eval_only = eval_only
        self.hidden_cache = HiddenCache() if config.target.cache_hidden else None
        self.target_s = 0.0  # the last step's target forward, with hidden_cache
        self._tree_cost: TreeCost | None = None  # measured at the first eval that asks (tree_cost)
        # checkpoints written in the background: training goes on while one is written
        self.checkpoints = CheckpointManager(
            self.run_dir,
            config,
            self.checkpoint_state,
            events=None if eval_only else self.events,
            echo=print0,
            writes=not eval_only,
        )
        core.set_threads(config)
        if eval_only:  # `python -m training eval`: only phase/eval events, no run_start
            self.logger, logger_line = NullLogger("eval"), ""
            report_to(None, print0)
            self.checkpoints.check(verify=True)  # the newest checkpoint that passes its check
            return
        report_to(self.events, print0)
        self.checkpoints.check()  # before config.json is written: a changed config is refused
        self.logger, logger_line = make_logger(config, self.run_dir)
        write_config(config, self.run_dir)
        core.emit_run_start(
            self.events,
            config,
            self.run_dir,
            host=socket.gethostname(),
            world_size=1,
            device=str(self.device),
        )
        print0(f"run {self.run_dir} config={config.name} device={self.device}")
        print0(logger_line)
        self.signals.install()  # a SIGTERM while loading stops cleanly before the first step

    # ----------------------------------------------------------------- setup
    def _phase(self, phase: str) -> None:
        """A phase event; an eval-only process reports only its ``eval`` phase."""
        self.phase = phase
        if not self.eval_only:
            self.events.phase(phase)

    def setup(self, *, quiet_data: bool = False) -> None:
        cfg = self.config
        if core.compiles(cfg, self.device):
            start_workers(self.device)  # ready by the first compile, which comes after the loads
        self._phase("load_data")
        folder, self.tokenizer, self.data = core.prepare_data(cfg, self.run_dir / core.DATA_CACHE, print0)
        if not quiet_data:
            core.announce_buckets(self.data, self.events, print0)

        self._phase("load_target")
        print0(f"Loading target ({cfg.model.kind}) {folder or '(random weights)'}...")
        self.target, seconds = core.load_run_target(
            cfg, folder, self.tokenizer, None if self.eval_only else self.events
        )
        print0(f"  Loaded in {seconds:.1f}s, {num_layers(self.target)} layers")
        if cfg.eval.tree_budgets and (problem := tree_method_problem(self.target, cfg.eval.tree_method)):
            raise ConfigError(problem)  # now, not after the training
        if not self.eval_only:  # config.json: the target's shape as loaded, not [model]'s defaults
            write_config(with_loaded_shape(cfg, text_config(self.target)), self.run_dir)

        self._phase("load_drafter")
        self.drafter = core.build_drafter(cfg, self.target, self.device, self.tokenizer)
        self.layer_ids = list(self.drafter.target_layer_ids)
        count = sum(p.numel() for p in core.trainable_parameters(self.drafter))
        print0(
            f"Drafter: {cfg.drafter.num_layers} layers, {count / 1e6:.2f}M params, "
            + f"target layers {self.layer_ids}"
        )
        core.ready_target(
            cfg,
            self.target,
            self.layer_ids,
            self.device,
            events=None if self.eval_only else self.events,
            echo=print0,
            who=f"target on {self.device}",
        )
        self.optimizer, self.scheduler = core.build_optimizer(cfg, self.drafter)
        self._setup_compile()
        self._resume()

    def _setup_compile(self) -> None:
        self.compiled = core.compiles(self.config, self.device)
        if not self.compiled:
            return
        self._phase("compile")
        self.compile_reporter = warm.prepare_compile(
            self.config,
            self.drafter,
            self.data.planner,
            self.device,
            echo=print0,
            prewarm_dtype=None if self.eval_only else self.target.get_input_embeddings().weight.dtype,
            target=self.target if is_compiled(self.target) else None,
        )

    def _resume(self) -> None:
        resumed = self.checkpoints.resume(  # RNG states must stay on CPU
            self.drafter, self.optimizer, self.scheduler, map_location="cpu"
        )
        if resumed is None:
            return
        self.step, self.position, self.last_tau = resumed.step, resumed.position, resumed.tau
        if self.eval_only:
            print0(f"Loaded {resumed.path} (step {self.step})")
        else:
            self.events.emit("resume", step=self.step, path=resumed.path)
            print0(f"Resumed from {resumed.path} at step {self.step}, next batch {self.position}")

    # ----------------------------------------------------------------- loop
    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.phase == "train":
            print0(f"signal {name}: finishing the step, then checkpoint and stop")
        else:
            print0(f"signal {name}: stopping {self.phase} now")

    def next_batch(self) -> Batch:
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch, self.position = self.data.batch(self.position, pad_id, pad_to_bucket=self.compiled)
        return batch

    def train_step(self, batch: Batch) -> core.StepResult:
        ids = batch.input_ids.to(self.device, non_blocking=True)
        mask = batch.loss_mask.to(self.device, non_blocking=True)
        # Anchors from the batch's CPU mask: from the device copy, sample_anchors' copy back would
        # wait for the target forward queued before it, and the drafter step could not be queued
        # meanwhile.
        anchors = core.batch_anchors(self.config, batch.loss_mask, batch.lengths, batch.position)
        if self.hidden_cache is not None:
            # timed for the ETA: the epochs after the first read the cache and skip this cost (the
            # cache's copy to the CPU waits for the forward, so the time is real on a GPU too)
            started = time.monotonic()
            hidden = self.hidden_cache.forward(self.target, ids, batch.lengths, self.layer_ids)
            self.target_s = time.monotonic() - started
        else:
            hidden = target_forward(self.target, ids, self.layer_ids)
        return self.drafter_step(ids, mask, hidden, anchors.to(self.device, non_blocking=True))

    def drafter_step(
        self, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor
    ) -> core.StepResult:
        """One optimizer step of this trainer's drafter on given hidden states."""
        return core.drafter_step(
            self.drafter,
            self.optimizer,
            self.scheduler,
            ids,
            mask,
            hidden,
            anchors,
            grad_clip=self.config.train.grad_clip,
        )

    def checkpoint_state(self) -> dict[str, Any]:
        return core.checkpoint_state(
            self.drafter,
            self.optimizer,
            self.scheduler,
            position=self.position,
            tau=self.last_tau,
            config=self.config,
        )

    def checkpoint(self) -> None:
        self.checkpoints.save(self.step)

    def report_checkpoints(self, *, wait: bool = False) -> None:
        """The ``checkpoint`` events of the background writes that finished (``wait``: all)."""
        self.checkpoints.report(wait=wait)

    def evaluate(self, export: Path | None = None) -> None:
        """Acceptance on each eval set (``eval.sets``, in order): per set, the ``eval`` event and its
        line; of an exported folder (``export``: not this run's checkpoint, whose step it may not be)
        the lines alone, named after the folder, and nothing in the run's events."""
        if export is None:
            self.phase = "eval"
            self.events.phase("eval")
        for name in self.config.eval.active_sets:
            self.evaluate_set(name, export)

    def evaluate_set(self, name: str, export: Path | None = None) -> None:
        """Acceptance on the eval set ``name``: its ``eval`` event (``set``) and its line."""
        cfg = self.config.eval
        prompts = self.data.eval_prompts(cfg.prompt_tokens, cfg.num_prompts, name)
        if not prompts:
            print0(f"eval: no {name} prompts, skipped")
            return
        own = export is None
        t0 = time.monotonic()
        what = f"evaluating acceptance ({len(prompts)} {name} prompts)"
        total = len(prompts) * cfg.max_new_tokens
        with self.signals.anywhere(), Progress("eval", what, total, "tokens") as p:
            result = evaluate_acceptance(
                self.target,
                self.drafter,
                prompts,
                self.layer_ids,
                cfg.max_new_tokens,
                eos_token_id=self.tokenizer.eos_token_id,
                progress=p.update,
                budgets=cfg.tree_budgets,
                tree_method=cfg.tree_method,
            )
        trees = {"tree": tree_records(result)} if result.trees else {}
        taus = {0: result.tau_mean, **{t.budget: t.tau_mean for t in result.trees}}
        cost = self.tree_cost() if result.trees else None
        if cost is not None:
            trees["tree_cost"] = cost.to_json(taus)
        label, estimate = f"export {export}", ""
        if own:
            self.events.emit(
                "eval",
                step=self.step,
                set=name,
                split=name,  # the older field: readers without `set` take a missing one as held_out
                tau_mean=result.tau_mean,
                tau_hist=list(result.hist),
                tau_estimate=self.last_tau,
                tau_prompt_mean=result.tau_prompt_mean,
                **trees,
            )
            key = "eval" if name == "held_out" else f"eval_{set_label(name)}"
            logged = {f"{key}/tau_mean": result.tau_mean, f"{key}/tau_prompt_mean": result.tau_prompt_mean}
            logged.update({f"{key}/tree_tau_{t.budget}": t.tau_mean for t in result.trees})
            if cost is not None and (best := cost.best(taus)) is not None:
                logged.update({f"{key}/tree_best_budget": best[0], f"{key}/tree_best_speedup": best[1]})
            self.logger.log({**logged, "eval/tau_estimate": self.last_tau}, self.step)
            label, estimate = f"step {self.step}", f" (training estimate {self.last_tau:.3f})"
        print0(
            f"eval {label} ({name}): tau_mean={result.tau_mean:.3f} per round, "
            f"{result.tau_prompt_mean:.3f} per prompt{estimate} over {result.rounds} blocks of "
            f"{result.prompts} prompts; hist={list(result.hist)} ({time.monotonic() - t0:.1f}s)"
            + (f"; {tree_summary(result)} ({cfg.tree_method})" if result.trees else "")
        )
        if self.eval_only and result.trees:
            sizes = {t.budget: t.tree_size_mean for t in result.trees}
            print0(cost.table(taus, sizes) if cost is not None else tree_table(result))
        elif cost is not None and (best := cost.best(taus)) is not None:
            print0(f"DDTree: best budget {best[0]}: ~{best[1]:.2f}x speedup modelled on {cost.device}")

    def tree_cost(self) -> TreeCost | None:
        """DDTree's cost per budget on this device (``eval.tree_cost``), measured at the first eval
        that asks and reused by the later ones (the target and its device do not change)."""
        cfg = self.config.eval
        if self._tree_cost is None and tree_cost_enabled(cfg.tree_cost, self.device):
            budgets = cfg.tree_cost_budgets
            with Progress("eval", "timing DDTree's verify per budget", len(set(budgets)), "budgets") as p:
                self._tree_cost = measure_tree_cost(
                    self.target, self.drafter, eval_context(cfg), budgets, progress=p.update
                )
        return self._tree_cost

    def _log_step(self, result: core.StepResult, batch: Batch, seconds: float) -> None:
        shape = core.batch_shape(batch.input_ids, batch.lengths)
        cached = {"target_s": self.target_s} if self.hidden_cache is not None else {}
        core.report_step(
            self.events,
            result,
            step=self.step,
            total_steps=self.config.train.steps,
            epoch=batch.position.epoch,
            tokens_per_s=shape["tokens"] / max(seconds, 1e-9),
            device=self.device,
            echo=print0,
            logger=self.logger,
            **shape,
            step_s=seconds,
            **cached,
        )

    def train(self) -> int:
        """Train to ``train.steps``; returns the steps done. Emits done/stopped."""
        cfg = self.config
        self.signals.install()  # already installed by __init__ unless train() runs again
        last_saved = self.step
        first = True
        try:
            self._phase("train")
            while self.step < cfg.train.steps:
                if self.signals.requested is not None:  # arrived during setup or a checkpoint
                    return self._stop(last_saved)
                t0 = time.monotonic()
                batch = self.next_batch()
                if first:  # compiles (minutes on a cold cache), warms up: progress events say it lives
                    what = "the first step" + (" (compiling its graphs)" if self.compiled else "")
                    with Progress("train", what, 1, "steps"):
                        result = self.train_step(batch)
                    first = False
                else:
                    result = self.train_step(batch)
                self.step += 1
                if self.compiled:
                    self.compile_reporter.report(self.events)  # first step, then on any new compile
                self.last_tau = result.tau
                if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps or self.step == 1:
                    self._log_step(result, batch, time.monotonic() - t0)
                if self.signals.requested is not None:
                    check_finite(self.step, result.loss, result.grad_norm, self.checkpoints.last_saved)
                    return self._stop(last_saved)
                self.checkpoints.step_end(self.step, result.loss, result.grad_norm)  # cadence saves
                last_saved = self.checkpoints.last_saved
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                    self.evaluate()
                    self._phase("train")
            if last_saved != self.step:
                self.checkpoint()
                last_saved = self.step
            if cfg.eval.num_prompts > 0:
                self.evaluate()  # while the final checkpoint is written
            self.wait_checkpoints()
            self.events.phase("done")
            self.events.emit("done", steps=self.step, seconds=time.monotonic() - self.started)
            print0(f"done: {self.step} steps in {time.monotonic() - self.started:.1f}s")
            return self.step
        except StopRequested:  # in an eval: the step before it is whole, so it can be saved
            return self._stop(last_saved)
        finally:
            self.signals.restore()

    def wait_checkpoints(self) -> None:
        """Wait for the background checkpoint writes (reporting them), with progress while one is
        still being written."""
        if self.checkpoints.writer.busy:
            with Progress("checkpoint", "writing the checkpoint", 1, "files"):
                self.report_checkpoints(wait=True)
        else:
            self.report_checkpoints(wait=True)

    def _stop(self, last_saved: int) -> int:
        """A stop signal came after set-up: checkpoint unless this step is saved, ``phase: stopped``."""
        during = self.phase
        if last_saved != self.step:
            self.checkpoint()
        self.wait_checkpoints()
        self.events.emit("phase", phase="stopped", during=during, resume_step=self.step)
        where = "between steps" if during == "train" else f"during {during}"
        print0(f"stopped {where} at step {self.step} (checkpointed; `fab train` resumes after it)")
        return self.step

    def stopped_in_setup(self) -> int:
        """A stop signal came while setting up (data, target, drafter, compile): nothing was trained
        in this launch, so there is nothing to checkpoint; say what a resume will find."""
        resume_step = self.checkpoints.point.step
        self.events.emit("phase", phase="stopped", during=self.phase, resume_step=resume_step)
        found = f"resumes after step {resume_step}" if resume_step else "starts at step 1 (no checkpoint)"
        print0(f"stopped during {self.phase}, before training: nothing to checkpoint; `fab train` {found}")
        return resume_step

    def close(self) -> None:
        # a write in flight completes even when training failed; a failed write has raised in
        # train() already, and on an error path the training error is the one to report
        self.checkpoints.close()
        self.signals.restore()
        report_to(None)
        self.logger.finish()
        self.events.close()


def train(config_name: str, run_dir: Path, overrides: list[str]) -> int:
    """``python -m training train`` (one process): run or resume a training run; the steps done."""
    config = load_config(config_name, overrides)
    trainer = Trainer(config, run_dir)
    try:
        try:
            with trainer.signals.anywhere():
                trainer.setup()
        except StopRequested:
            return trainer.stopped_in_setup()
        return trainer.train()
    finally:
        trainer.close()


def evaluate_run(config: RunConfig, run_dir: Path, export: Path | None = None) -> None:
    """``python -m training eval``: the newest checkpoint of ``run_dir`` (or the exported folder
    ``export``: same target, prompts and settings) against its target."""
    trainer = Trainer(config, run_dir, eval_only=True)
    try:
        trainer.setup(quiet_data=True)
        if export is not None:
            from training.export import load_export_into

            load_export_into(trainer.drafter, export)
            print0(f"Loaded the exported drafter {export}")
        elif trainer.step == 0:
            print0(
                f"eval: no checkpoint in {trainer.run_dir}/{CHECKPOINT_DIR}; evaluating an untrained drafter"
            )
        trainer.evaluate(export)
    finally:
        trainer.close()
