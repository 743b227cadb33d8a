"""``python -m training train ... --topology N+M`` under torchrun: target and drafter ranks.

Targets (ranks 0..N-1) read disjoint shards of the global batch order (target ``t`` takes
global batches ``g`` with ``g % N == t``), run the frozen target forward (no grad; bf16 on
GPU) and send hidden states + tokens + loss mask + lengths + anchors to drafters
(training.run.pipeline). Drafters (ranks N..N+M-1) train with DDP over the drafter group; one
optimizer step consumes one batch per drafter, so ``train.steps`` steps use ``steps * M``
global batches.

``pipeline.order``:
    free   (default) a target sends to the drafter with the most free credits; a drafter
           trains on whichever target's batch arrived first (no head-of-line wait behind a
           slow target).
    fixed  drafter ``d`` trains step ``s`` on global batch ``s*M + d``, made by target
           ``(s*M + d) % N``: the single-process order, so 1+M... runs are checkable
           against ``python -m training train`` (tests/training/test_topology.py).

Anchors come from ``anchor_generator(seed, position)`` on the target, as in the single
trainer. Drafter rank N (drafter 0) writes checkpoints, into the run dir of its own host; a
resumed run restarts the data at global batch ``step * M`` (the single trainer's position is not
kept across topologies), the step being drafter 0's, broadcast to every rank: over several hosts
without a shared file system only drafter 0's host has the checkpoints, and that is enough.
Every host's first rank writes ``config.json`` into its own run dir. Acceptance eval needs the
target next to the drafter: run ``python -m training eval --run-dir DIR`` after training (on
drafter 0's host).
"""

from __future__ import annotations

import collections
import gc
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training import contract
from training.compile.cache import CounterReporter, start_workers
from training.config import ConfigError, RunConfig, TrainingError, load_config, write_config
from training.data.buckets import Position
from training.data.dataset import Batch, TrainData
from training.events import EventWriter, first_line
from training.model.target import is_compiled, model_source, num_layers, target_forward
from training.progress import report_to
from training.run import core, warm
from training.run.checkpoint import CheckpointManager, check_finite, check_resumable
from training.run.pipeline import (
    CREDIT,
    KIND_END,
    STOP_DONE,
    STOP_SIGNAL,
    Balance,
    Header,
    Message,
    RankLost,
    WorkItem,
    control_receiver,
    header_receiver,
    item_sender,
    next_message,
    post_receive,
    ready_messages,
    send_control,
    start_thread,
)
from training.topology import (
    DistContext,
    init_distributed,
    parse_topology,
    rank_config,
    shutdown,
    startup_timeout,
)


def _say(text: str) -> None:
    print(text, flush=True)


class Worker:
    def __init__(self, ctx: DistContext, config: RunConfig, run_dir: Path, events: EventWriter) -> None:
        self.ctx, self.config, self.run_dir, self.events = ctx, config, run_dir, events
        self.stop_signal: int | None = None
        self.balance = Balance(events, config.pipeline.balance_window_s)
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.timeout_s = config.pipeline.timeout_s
        self.start_step = 0  # the step the run continues from: drafter 0's (``agree_start``)
        report_to(events, _say if ctx.rank == 0 else None)  # the long phases' progress events
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def prepare_shared(self) -> tuple[str, Any, TrainData]:
        """The model folder, the tokenizer and the tokenized data; rank 0 builds caches first,
        then the rest."""
        if self.ctx.rank != 0:
            self.barrier()
        folder, tokenizer, data = core.prepare_data(
            self.config, self.run_dir / core.DATA_CACHE
        )  # drafters: their shapes
        if self.ctx.rank == 0:
            self.barrier()
        return folder, tokenizer, data

    def barrier(self) -> None:
        """Every rank here (startup group: its own long timeout; rank 0 names missing ranks)."""
        timeout = startup_timeout(self.timeout_s)
        dist.monitored_barrier(group=self.ctx.startup, timeout=timeout, wait_all_ranks=True)

    def ready(self) -> Iterator[Message]:
        """The messages already in the inbox, without waiting; an error among them raises
        ``RankLost`` naming the peer."""
        return ready_messages(self.inbox, self.ctx.describe)

    def message(self, waiting_for: str, peer: int | None = None) -> Message:
        started = time.monotonic()
        message = next_message(self.inbox, self.timeout_s, waiting_for, self.ctx.describe, peer)
        self.balance.wait(time.monotonic() - started)
        return message


class TargetWorker(Worker):
    """Frozen target forward on this rank's shard; sends to drafters with free credits."""

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.events.phase("load_data")
        folder, self.tokenizer, self.data = self.prepare_shared()
        if ctx.rank == 0:
            core.announce_buckets(self.data, self.events, _say)
        self.events.phase("load_target")
        self.target, seconds = core.load_run_target(cfg, folder, self.tokenizer, self.events)
        _say(f"target {ctx.index} (rank {ctx.rank}) loaded on {ctx.device} in {seconds:.1f}s")
        self.layer_ids = core.drafter_config(cfg).resolved_target_layers(num_layers(self.target))
        core.ready_target(
            cfg,
            self.target,
            self.layer_ids,
            ctx.device,
            events=self.events,
            echo=lambda line: _say(f"target {ctx.index}: {line}"),
            who=ctx.me.describe(),
        )
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.pad_to_bucket = core.compiles(cfg, ctx.device)
        self.compile_reporter: CounterReporter | None = None
        if is_compiled(self.target):
            self.compile_reporter = warm.prepare_target_compile(
                cfg, self.data.planner, ctx.device, echo=lambda line: _say(f"target {ctx.index}: {line}")
            )
        self.cursor, self.position = 0, Position()  # global batch number -> its data position
        self.prefetched: dict[int, Batch] = {}

    def _batch(self, seq: int) -> Batch:
        """Global batch ``seq``: the epoch plan walked forward from the last batch asked for."""
        while self.cursor < seq:
            self.position = self.data.planner.take(self.position)[3]
            self.cursor += 1
        batch, _ = self.data.batch(self.position, self.pad_id, pad_to_bucket=self.pad_to_bucket)
        return batch

    def produce(self, seq: int, next_seq: int | None) -> WorkItem:
        """Hidden states of batch ``seq``; the CPU work of ``next_seq`` overlaps the GPU forward."""
        device = self.ctx.device
        batch = self.prefetched.pop(seq, None) or self._batch(seq)
        ids = batch.input_ids.to(device, non_blocking=True)
        mask = batch.loss_mask.to(device, non_blocking=True)
        hidden = target_forward(self.target, ids, self.layer_ids)  # queued on the GPU
        anchors = core.batch_anchors(self.config, batch.loss_mask, batch.lengths, batch.position).to(device)
        if next_seq is not None:
            self.prefetched = {next_seq: self._batch(next_seq)}
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # honest busy time; hidden is ready
        position = batch.position
        return WorkItem(
            seq, position.epoch, position.index, batch.bucket, ids, mask, batch.lengths, anchors, hidden
        )

    def run(self) -> None:
        cfg, ctx = self.config, self.ctx
        topo = ctx.topology
        drafters = topo.drafter_ranks
        fixed = cfg.pipeline.order == "fixed"
        first = self.start_step * topo.drafters
        total = cfg.train.steps * topo.drafters  # global batches the drafters will consume
        credits = dict.fromkeys(drafters, cfg.pipeline.credits)
        outboxes: dict[int, queue.Queue[WorkItem | None]] = {d: queue.Queue() for d in drafters}
        threads = []
        for d in drafters:
            threads.append(start_thread(f"credits-{d}", control_receiver(d, ctx.pair_ctl[d], self.inbox)))
            body = item_sender(
                d, ctx.pair_ctl[d], ctx.pair_data[d], outboxes[d], self.inbox, ctx.device, self.timeout_s
            )
            threads.append(start_thread(f"send-{d}", body))
        open_ = set(drafters)
        # free order: the drafters on this target's host when the placement allows (hidden states
        # stay on the host), else all; fixed order: its drafter; every drafter is told END
        partners = set(topo.partners(ctx.rank))
        stopped_by_signal = False
        seq = first + (ctx.index - first) % topo.targets
        self.events.phase("train")
        self.balance.restart()
        produced = 0

        def handle(message: Message) -> None:
            nonlocal stopped_by_signal
            if message.kind == "control" and message.value == CREDIT:
                credits[message.peer] += 1
            elif message.kind == "control":
                open_.discard(message.peer)
                outboxes[message.peer].put(None)  # END after what is queued
                stopped_by_signal |= message.value == STOP_SIGNAL

        while open_:
            for ready in self.ready():
                handle(ready)
            if not open_:  # the last STOP came in with the ready messages: nothing to wait for
                break
            ready_ds = [d for d in sorted(open_ if fixed else open_ & partners) if credits[d] > 0]
            if fixed:
                want = drafters[seq % topo.drafters]
                dest = want if (seq < total and want in ready_ds) else None
            else:
                dest = max(ready_ds, key=lambda d: (credits[d], -((d - seq) % topo.drafters)), default=None)
            if dest is None:
                handle(self.message(f"a credit or stop from drafters {sorted(open_)}"))
                self.balance.maybe_emit()
                continue
            started = time.monotonic()
            upcoming = seq + topo.targets
            item = self.produce(seq, upcoming if (not fixed or upcoming < total) else None)
            self.balance.busy(time.monotonic() - started, int(item.lengths.sum()))
            if self.compile_reporter is not None:
                self.compile_reporter.report(self.events)  # compile_cache: first forward, then on change
            outboxes[dest].put(item)
            credits[dest] -= 1
            produced += 1
            seq += topo.targets
            self.balance.maybe_emit()
        for thread in threads:
            thread.join(timeout=self.timeout_s)
        self.balance.maybe_emit(force=True)
        self.events.phase("stopped" if stopped_by_signal else "done")
        if ctx.rank == 0:
            _say(f"targets: rank 0 produced {produced} batches; {self.balance.summary()}")


class DrafterWorker(Worker):
    """Trains the drafter (DDP over the drafter ranks) on batches from any target."""

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        if core.compiles(cfg, ctx.device):
            start_workers(ctx.device)  # ready by the first compile, which comes after the loads
        self.events.phase("load_target")
        folder, self.tokenizer, data = self.prepare_shared()
        target, _ = core.load_run_target(cfg, folder, self.tokenizer, None)  # only embedding and lm_head kept
        self.events.phase("load_drafter")
        drafter = core.build_drafter(cfg, target, ctx.device, self.tokenizer)
        del target
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        self.optimizer, self.scheduler = core.build_optimizer(cfg, drafter)
        self.drafter = drafter
        # drafter 0 checks, sets aside and writes checkpoints (in the background: the pipeline goes
        # on meanwhile); every drafter resumes from the step it chose
        self.checkpoints = CheckpointManager(
            self.run_dir,
            cfg,
            self.checkpoint_state,
            events=self.events,
            echo=self._lead,
            writes=ctx.index == 0,
        )
        chosen = self._agree_resume_step(self.checkpoints.check().step)
        self.compile_reporter: CounterReporter | None = None
        if core.compiles(cfg, ctx.device):
            self.events.phase("compile")
            self.compile_reporter = warm.prepare_compile(
                cfg, drafter, data.planner, ctx.device, echo=self._lead
            )
        self.step, self.last_tau = 0, 1.0
        resumed = self.checkpoints.resume(
            drafter, self.optimizer, self.scheduler, map_location=ctx.device, step=chosen
        )
        if resumed is not None:
            self.step, self.last_tau = resumed.step, resumed.tau
            self.events.emit("resume", step=self.step, path=resumed.path)
            self._lead(f"Resumed from {resumed.path} at step {self.step}")
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(drafter, device_ids=device_ids, process_group=ctx.drafters)
        count = sum(p.numel() for p in core.trainable_parameters(drafter))
        self._lead(
            f"drafters: {ctx.topology.drafters} x {count / 1e6:.2f}M params (DDP), order={cfg.pipeline.order}"
        )

    def _agree_resume_step(self, mine: int) -> int:
        """Drafter 0's resume decision on every drafter (it alone verifies and sets aside)."""
        if self.ctx.topology.drafters == 1:
            return mine
        step = torch.tensor([mine], dtype=torch.long)
        dist.broadcast(step, src=self.ctx.topology.drafter_ranks[0], group=self.ctx.drafters_ctl)
        return int(step.item())

    def _lead(self, text: str) -> None:
        if self.ctx.index == 0:
            _say(text)

    # ------------------------------------------------------------ receiving
    def _start_receivers(self) -> None:
        self.pending: dict[int, collections.deque[Header]] = {
            t: collections.deque() for t in self.ctx.topology.target_ranks
        }
        self.arrivals: collections.deque[int] = collections.deque()
        self.ended: set[int] = set()
        self.threads = [
            start_thread(f"headers-{t}", header_receiver(t, self.ctx.pair_ctl[t], self.inbox))
            for t in self.ctx.topology.target_ranks
        ]

    def _file(self, message: Message) -> None:
        if message.kind != "header":
            raise RankLost(f"unexpected {message.kind} message from {self.ctx.describe(message.peer)}")
        if message.value.kind == KIND_END:
            self.ended.add(message.peer)
        else:
            self.pending[message.peer].append(message.value)
            if self.config.pipeline.order == "free":
                self.arrivals.append(message.peer)

    def _pick(self, want: int | None) -> int | None:
        if want is not None:
            return want if self.pending[want] else None
        while self.arrivals and not self.pending[self.arrivals[0]]:
            self.arrivals.popleft()
        return self.arrivals[0] if self.arrivals else None

    def acquire(self, block: bool) -> tuple[int, Any] | None:
        """Post the receives of the next batch (whichever target has one ready)."""
        topo = self.ctx.topology
        want = None
        if self.config.pipeline.order == "fixed":
            want = topo.target_ranks[(self.taken * topo.drafters + self.ctx.index) % topo.targets]
        while True:
            for message in self.ready():
                self._file(message)
            source = self._pick(want)
            if source is not None:
                break
            if not block:
                return None
            what = self.ctx.describe(want) if want is not None else "any target"
            self._file(self.message(f"a batch from {what}", want))
        header = self.pending[source].popleft()
        if self.arrivals and self.arrivals[0] == source:
            self.arrivals.popleft()
        expected = self.taken * topo.drafters + self.ctx.index
        if want is not None and header.seq != expected:
            raise RankLost(
                f"{self.ctx.describe(source)} sent batch {header.seq}, expected {expected} (order=fixed)"
            )
        self.taken += 1
        return source, self._post(header, source)

    def _post(self, header: Any, source: int) -> Callable[[], WorkItem]:
        """``post_receive`` from ``source``; gloo refuses to post to a peer already gone: RankLost."""
        try:
            return post_receive(header, source, self.ctx.pair_data[source], self.ctx.device)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0][:200]
            raise RankLost(f"lost {self.ctx.describe(source)} during a transfer: {first}", source) from None

    def receive(self, ticket: tuple[int, Any]) -> WorkItem:
        source, finish = ticket
        started = time.monotonic()
        try:
            item = finish()
        except RuntimeError as exc:
            first = str(exc).splitlines()[0][:200]
            raise RankLost(f"lost {self.ctx.describe(source)} during a transfer: {first}", source) from None
        self.balance.wait(time.monotonic() - started)
        self._control(CREDIT, source)
        return item

    def _control(self, value: int, target: int) -> None:
        try:
            send_control(value, target, self.ctx.pair_ctl[target])
        except RuntimeError as exc:
            first = str(exc).splitlines()[0][:200]
            raise RankLost(f"lost {self.ctx.describe(target)}: {first}", target) from None

    # ------------------------------------------------------------ training
    def run(self) -> None:
        cfg = self.config
        self._start_receivers()
        self.taken = self.step  # batches taken by this drafter (one per step)
        self.events.phase("train")
        self.balance.restart()
        ticket = self.acquire(block=True) if self.step < cfg.train.steps else None
        stopped = False
        last = time.monotonic()
        while ticket is not None:
            item = self.receive(ticket)
            ticket = self.acquire(block=False) if self.step + 1 < cfg.train.steps else None
            started = time.monotonic()
            result = core.drafter_step(
                self.ddp,
                self.optimizer,
                self.scheduler,
                item.input_ids,
                item.loss_mask,
                item.hidden,
                item.anchors,
                grad_clip=cfg.train.grad_clip,
                always_backward=True,
            )
            tokens = int(item.lengths.sum())
            self.balance.busy(time.monotonic() - started, tokens)
            self.step += 1
            if self.compile_reporter is not None:
                self.compile_reporter.report(self.events)  # compile_cache: first step, then on change
            self.last_tau = result.tau
            now = time.monotonic()
            if self.step % cfg.train.log_every == 0 or self.step in (1, cfg.train.steps):
                self._log_step(result, item, tokens / max(now - last, 1e-9))
            last = now
            self.balance.maybe_emit()
            if self._vote_stop():
                check_finite(self.step, result.loss, result.grad_norm, self.checkpoints.last_saved)
                stopped = True
                break
            self.checkpoints.step_end(self.step, result.loss, result.grad_norm)
            if ticket is None and self.step < cfg.train.steps:
                ticket = self.acquire(block=True)
        self.checkpoints.save(self.step)
        self._finish(STOP_SIGNAL if stopped else STOP_DONE, ticket)  # the targets stop while it is written
        self.balance.maybe_emit(force=True)
        self.checkpoints.wait()
        if stopped:
            self.events.phase("stopped")
            self._lead(f"stopped at step {self.step} (checkpointed)")
        else:
            self.events.phase("done")
            self.events.emit("done", steps=self.step, seconds=time.monotonic() - self.balance.first)
            self._lead(
                f"done: {self.step} steps; eval: run `python -m training eval --run-dir {self.run_dir}`"
            )

    def _vote_stop(self) -> bool:
        flag = torch.tensor([1 if self.stop_signal is not None else 0], dtype=torch.long)
        if self.ctx.topology.drafters > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.drafters_ctl)
        return bool(flag.item())

    def _finish(self, kind: int, ticket: tuple[int, Any] | None) -> None:
        """STOP every target, then take (and drop) what is still in flight until each sends END."""
        if ticket is not None:
            self.receive(ticket)
        for t in self.ctx.topology.target_ranks:
            self._control(kind, t)
        while True:
            for t in self.ctx.topology.target_ranks:
                while self.pending[t]:
                    header = self.pending[t].popleft()
                    self._post(header, t)()
            if len(self.ended) == self.ctx.topology.targets:
                break
            self._file(self.message("END from targets"))
        for thread in self.threads:
            thread.join(timeout=self.timeout_s)

    def _log_step(self, result: core.StepResult, item: WorkItem, tokens_per_s: float) -> None:
        core.report_step(
            self.events,
            result,
            step=self.step,
            total_steps=self.config.train.steps,
            epoch=item.epoch,
            tokens_per_s=tokens_per_s,
            device=self.ctx.device,
            echo=self._lead,
            note=f" (drafter 0, batch {item.seq})",
            batch=item.seq,  # extras (training/EVENTS.md allows them): what this step trained on
            **core.batch_shape(item.input_ids, item.lengths),
        )

    def checkpoint_state(self) -> dict[str, Any]:
        return core.checkpoint_state(
            self.drafter,
            self.optimizer,
            self.scheduler,
            position=Position(),  # the data restarts at global batch step * M (module docstring)
            tau=self.last_tau,
            config=self.config,
            global_batches=self.step * self.ctx.topology.drafters,
            topology=str(self.ctx.topology),
        )


def agree_start(ctx: DistContext, worker: Worker) -> int:
    """Drafter 0's resumed step, on every rank: the targets start the data there (their host may
    have no checkpoint: drafter 0's host holds them)."""
    mine = worker.step if isinstance(worker, DrafterWorker) and ctx.index == 0 else 0
    step = torch.tensor([mine], dtype=torch.long)
    dist.broadcast(step, src=ctx.topology.drafter_ranks[0], group=ctx.control)
    return int(step.item())


def _check_pipeline(config: RunConfig) -> None:
    p = config.pipeline
    if p.credits < 1:
        raise ConfigError(f"config key pipeline.credits: must be >= 1, got {p.credits}")
    if p.timeout_s <= 0 or p.balance_window_s <= 0:
        raise ConfigError("config keys pipeline.timeout_s and pipeline.balance_window_s must be > 0")
    if config.eval.every:  # acceptance eval needs the target next to the drafter (module docstring)
        raise ConfigError(
            f"config key eval.every={config.eval.every}: an N+M run has no in-run acceptance eval; "
            "set eval.every = 0 and run `python -m training eval --run-dir DIR` (or on a checkpoint's export)"
        )


def train_distributed(
    config_name: str, run_dir: Path, overrides: list[str], topology_text: str, placement: str = ""
) -> int:
    """One rank of an N+M job; returns the exit code (errors: an ``error`` event naming ranks).
    ``placement``: the per-host split of a job over several hosts (``Topology.placement``)."""
    config = load_config(config_name, overrides)
    topology = parse_topology(topology_text or config.pipeline.topology, placement)
    _check_pipeline(config)
    run_dir = run_dir.resolve()
    # the config check on every rank before the rendezvous (rank 0 writes config.json after it);
    # drafter 0 verifies the checkpoints in its setup
    check_resumable(config, run_dir, verify=False)
    if os.environ.get("LOCAL_RANK") == "0":
        # transformers saves a model only on global rank 0 once torch.distributed is up, so each
        # host's first rank builds what its host lacks (the tiny model's folder) before joining.
        model_source(config)
    ctx = init_distributed(topology, config, config.pipeline.timeout_s)
    config = rank_config(config, ctx.device)
    core.set_threads(config)
    events = EventWriter(run_dir, rank=ctx.rank, role=ctx.role)
    if ctx.local_rank == 0:  # each host's run dir (hosts need not share a file system)
        write_config(config, run_dir)
    core.emit_run_start(
        events,
        config,
        run_dir,
        host=ctx.me.host,
        world_size=topology.world_size,
        device=ctx.me.device,  # "cuda:0 = GPU 5": what this rank sees, and which GPU it is
        topology=str(topology),
    )
    if ctx.rank == 0:
        _say(f"run {run_dir} config={config.name} topology={topology} backend={ctx.backend}")
    worker_cls = TargetWorker if ctx.role == "target" else DrafterWorker
    worker = worker_cls(ctx, config, run_dir, events)
    try:
        worker.setup()
        worker.barrier()  # both roles loaded: from here on the pipeline timeout applies
        worker.start_step = agree_start(ctx, worker)
        worker.run()
    except BaseException as exc:  # every failure: one error event naming this rank (and the peer)
        code = exc.exit_code if isinstance(exc, TrainingError) else 1
        message = f"{ctx.me.describe()}: {first_line(exc) or type(exc).__name__}"
        peer = getattr(exc, "peer", None)
        extra = {}
        if isinstance(peer, int) and 0 <= peer < len(ctx.peers):  # who was lost: for fab status
            lost = ctx.peers[peer]
            extra = contract.peer_fields(lost.rank, lost.role, lost.host)
        events.error(exc, message, **extra)
        events.close()
        print(f"error: {message}", file=sys.stderr, flush=True)
        if not isinstance(exc, TrainingError):
            traceback.print_exception(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # helper threads may sit in a receive from the lost peer: do not join them
    events.close()
    shutdown()
    return 0
