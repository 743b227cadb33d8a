"""The N+M topology: which rank does what, and the process groups that connect them.

``--topology 5+3`` under ``torchrun --nproc-per-node=8`` runs one process per GPU:

    ranks 0 .. N-1      targets   (frozen target forward, send hidden states)
    ranks N .. N+M-1    drafters  (receive hidden states, train the drafter with DDP)

Several hosts: ``torchrun --nnodes=H --node-rank=I --rdzv-backend=c10d
--rdzv-endpoint=HOST0:29500 --nproc-per-node=G -m training train ... --topology N+M``
with ``N + M = H * G``; global ranks are assigned node by node, so with 2 hosts of 4 GPUs
and ``5+3`` host 0 runs targets 0-3 and host 1 runs target 4 and the 3 drafters. Each
process drives one GPU (never threads: they compile concurrently) and sees it as ``cuda:0``: before CUDA
starts, ``CUDA_VISIBLE_DEVICES`` is narrowed to the LOCAL_RANK-th GPU of the host (or of the
list the launcher was given). Inductor's cache key holds the device index, so this is what lets
one warm-up on ``cuda:0`` (``fab warm``) serve every rank. ``FLEET_RANKS_SEE_ALL_GPUS=1``
keeps all GPUs visible and uses ``cuda:LOCAL_RANK`` instead.

Groups (created in the same order on every rank, as torch.distributed requires):

    world     backend NCCL on GPU / gloo on CPU: the join only (no collective runs on it)
    control   gloo over all ranks: the identities gathered and the resumed step agreed at the start
    startup   gloo over all ranks: the barriers around data and model loading
    pair      per target/drafter pair, a gloo channel for headers and credits (small CPU
              tensors) and a world-backend channel for the hidden-state payloads. Kept apart
              because NCCL runs sends and receives between one pair of ranks on one stream in
              posting order: a pre-posted credit receive would block the next payload send
              (deadlock). Gloo receives do not block sends.
    drafters  the drafter ranks, world backend: DDP's gradient all-reduce
    drafters_ctl  gloo over the drafter ranks: the per-step "stop now?" vote

Joining and the startup barriers wait up to ``STARTUP_TIMEOUT_S`` (ranks start and load their
models at their own pace); every other collective has the process-group timeout
(``timeout_s``), and point-to-point waits are polled against the same deadline
(training.run.pipeline), so a dead or stuck rank ends the job in bounded time with an
``error`` event naming the rank, its role and host.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from training import contract
from training.config import ConfigError, RunConfig
from training.contract import Topology

STARTUP_TIMEOUT_S = 1800.0
# The name a launcher gives this host (fleet: the inventory's target name): errors name a lost
# peer by it, which is what the user knows the host as; else the hostname.
NODE_NAME_ENV = contract.NODE_NAME_ENV


def parse_topology(text: str, placement: str = "") -> Topology:
    """``"5+3"`` -> Topology(5, 3), with ``placement`` (``"5+0,0+3"``: per host) if given;
    ``ConfigError`` (one line) for anything else."""
    try:
        topology = contract.parse_topology(text)
    except ValueError as err:
        raise ConfigError(f"--topology {text!r}: {err}") from None
    try:
        return contract.parse_placement(topology, placement)
    except ValueError as err:
        raise ConfigError(f"--placement: {err}") from None


@dataclass(frozen=True)
class RankInfo:
    """Who a rank is; gathered from every rank at start-up so errors can name a peer."""

    rank: int
    role: str
    index: int
    host: str
    pid: int
    device: str

    def describe(self) -> str:
        return (
            f"rank {self.rank} ({self.role} {self.index} on host {self.host}, pid {self.pid}, {self.device})"
        )


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job plus the groups (``None`` groups mean "world")."""

    topology: Topology
    rank: int
    local_rank: int
    role: str
    index: int
    device: torch.device
    backend: str
    timeout_s: float
    control: Any  # gloo ProcessGroup over all ranks
    startup: Any  # gloo over all ranks, timeout STARTUP_TIMEOUT_S: barriers around model loading
    drafters: Any  # ProcessGroup over the drafter ranks (world backend)
    drafters_ctl: Any  # gloo ProcessGroup over the drafter ranks
    pair_ctl: dict[int, Any]  # peer rank -> gloo 2-rank group (headers, credits)
    pair_data: dict[int, Any]  # peer rank -> world-backend 2-rank group (payloads)
    peers: tuple[RankInfo, ...]

    @property
    def me(self) -> RankInfo:
        return self.peers[self.rank]

    def describe(self, rank: int) -> str:
        if 0 <= rank < len(self.peers):
            return self.peers[rank].describe()
        role, index = self.topology.role_of(rank)
        return f"rank {rank} ({role} {index})"


def torchrun_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) set by torchrun; ``ConfigError`` when not under torchrun."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"--topology needs torchrun ({', '.join(missing)} unset): run "
            "`python -m torch.distributed.run --nproc-per-node=N+M -m training train ... --topology N+M`"
        )
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError as exc:
        raise ConfigError(f"torchrun environment is malformed ({exc})") from None


SEE_ALL_GPUS_ENV = contract.RANKS_SEE_ALL_GPUS_ENV


def pin_visible_gpu(config: RunConfig, local_rank: int) -> str | None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this rank's GPU so it is ``cuda:0`` here.

    Must run before CUDA starts in this process (the driver reads the variable once). Returns
    the host's name for the GPU (its index or UUID as the launcher listed it), or ``None`` when
    nothing was pinned: a CPU run, a torch without CUDA, ``FLEET_RANKS_SEE_ALL_GPUS=1``, or CUDA
    already started. ``ConfigError`` when the launcher's list has no LOCAL_RANK-th entry.
    """
    wanted = config.model.device
    if wanted == "cpu" or not torch.backends.cuda.is_built() or os.environ.get(SEE_ALL_GPUS_ENV) == "1":
        return None
    if torch.cuda.is_initialized():
        return None
    gpu = visible_gpu_of(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def visible_gpu_of(local_rank: int, listed: str | None) -> str:
    """The GPU of LOCAL_RANK: the ``local_rank``-th entry of the launcher's CUDA_VISIBLE_DEVICES
    (``listed``), or the host's GPU ``local_rank`` when unset. Pure; ``ConfigError`` when the
    list is too short."""
    if listed is None:
        return str(local_rank)
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    if local_rank >= len(entries):
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but CUDA_VISIBLE_DEVICES={listed!r} lists {len(entries)} GPUs: "
            "--nproc-per-node must not exceed the GPUs given to the job"
        )
    return entries[local_rank]


def rank_device(config: RunConfig, local_rank: int, pinned: str | None = None) -> torch.device:
    """This rank's device: ``cuda:0`` when ``pinned`` (see ``pin_visible_gpu``), else
    ``cuda:LOCAL_RANK``, when the run config puts the model on a GPU; else ``cpu``."""
    wanted = config.model.device
    use_cuda = torch.cuda.is_available() if wanted == "auto" else wanted.startswith("cuda")
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        where = f" (CUDA_VISIBLE_DEVICES={pinned} for LOCAL_RANK {local_rank})" if pinned is not None else ""
        raise ConfigError(f"model.device={wanted}: no CUDA device visible{where}; use --model.device=cpu")
    index = 0 if pinned is not None else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs visible: "
            "--nproc-per-node must not exceed the GPUs of the host"
        )
    return torch.device("cuda", index)


def rank_config(config: RunConfig, device: torch.device) -> RunConfig:
    """The run config with ``model.device`` pinned to this rank's device."""
    return replace(config, model=replace(config.model, device=str(device)))


def die_with_agent() -> None:
    """Under torchrun, end this rank when its agent dies (Linux ``PR_SET_PDEATHSIG``).

    torchrun starts each rank in a session of its own, so a killed agent (``kill -9``, a host's
    run stopped by force) would leave its ranks running as orphans, holding their GPUs and keeping
    the other hosts' ranks waiting; with this they die with it, and the other hosts' ranks see the
    peer gone at once."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the agent died before the call above
        os.kill(os.getpid(), signal.SIGKILL)


def startup_timeout(timeout_s: float) -> timedelta:
    """How long joining the job and the barriers around loading wait: ranks start and load their
    models at their own pace, so never less than ``STARTUP_TIMEOUT_S``."""
    return timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))


def init_distributed(topology: Topology, config: RunConfig, timeout_s: float) -> DistContext:
    """Join the job (torchrun env), create the groups, gather every rank's identity."""
    rank, world_size, local_rank = torchrun_env()
    die_with_agent()
    if world_size != topology.world_size:
        raise ConfigError(
            f"--topology {topology} needs {topology.world_size} processes but torchrun started "
            f"{world_size}: use --nproc-per-node={topology.world_size} (times --nnodes)"
        )
    role, index = topology.role_of(rank)
    pinned = pin_visible_gpu(config, local_rank)
    device = rank_device(config, local_rank, pinned)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # Joining waits for every rank to start (Python and torch imported, on each host: minutes on a
    # loaded or cold one) and loading a large target takes minutes per role: both get the long
    # startup timeout. No collective runs on the default group afterwards (each has its own group
    # below), so a rank that hangs while training is still named after ``timeout_s``.
    join = startup_timeout(timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # No device_id (eager init): lazily created NCCL communicators keep each 2-rank group's sends
    # and receives on their own communicator and stream.
    dist.init_process_group(backend, timeout=join)
    control = dist.new_group(backend="gloo", timeout=timeout)
    startup = dist.new_group(backend="gloo", timeout=join)
    drafters = dist.new_group(topology.drafter_ranks, backend=backend, timeout=timeout)
    drafters_ctl = (
        drafters
        if backend == "gloo"
        else dist.new_group(topology.drafter_ranks, backend="gloo", timeout=timeout)
    )
    pair_ctl: dict[int, Any] = {}
    pair_data: dict[int, Any] = {}
    for t in topology.target_ranks:
        for d in topology.drafter_ranks:
            ctl = dist.new_group([t, d], backend="gloo", timeout=timeout)
            # Separate even on gloo: a header receive posted ahead must never match a payload.
            data = dist.new_group([t, d], backend=backend, timeout=timeout)
            if rank in (t, d):
                peer = d if rank == t else t
                pair_ctl[peer], pair_data[peer] = ctl, data
    where = f"{device} = GPU {pinned}" if pinned is not None else str(device)
    host = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    me = RankInfo(rank, role, index, host, os.getpid(), where)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, me, group=control)
    return DistContext(
        topology=topology,
        rank=rank,
        local_rank=local_rank,
        role=role,
        index=index,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        control=control,
        startup=startup,
        drafters=drafters,
        drafters_ctl=drafters_ctl,
        pair_ctl=pair_ctl,
        pair_data=pair_data,
        peers=tuple(gathered),
    )


def shutdown() -> None:
    """Leave the job (no-op when never joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "DistContext",
    "RankInfo",
    "Topology",
    "init_distributed",
    "parse_topology",
    "pin_visible_gpu",
    "rank_config",
    "rank_device",
    "shutdown",
    "torchrun_env",
    "visible_gpu_of",
]
