"""The trainer's command line as fleet starts it, written once (pure).

``training/__main__.py`` defines the subcommands (``train``, ``warm``, ``plan``, ``resume-check``,
``export``); every argv here runs ``<python> -m <run.module> <subcommand> ...`` with the target's
interpreter and its run's ``module``, ``config`` and ``overrides``. Runs over N+M ranks start the
same ``train`` under ``training.launch`` (torchrun, for which `fab stop`'s SIGTERM is a clean stop,
exit 0, and whose single-node rendezvous is on 127.0.0.1, never the hostname).
"""

from __future__ import annotations

from fleet.inventory import MultiRunSpec, TargetSpec

LAUNCHER = "training.launch"  # torchrun with fleet's clean-stop handling, shipped with the trainer


def _head(spec: TargetSpec, command: str) -> list[str]:
    return [spec.run_python, "-m", spec.run.module, command]


def train(spec: TargetSpec, run_dir: str) -> list[str]:
    """``<python> -m <module> train --config C --run-dir D <overrides>``; with a topology N+M, under
    ``-m training.launch --nproc-per-node=N+M`` with ``--topology N+M`` (gpus = 0: gloo on CPU)."""
    run = spec.run
    train_args = ["-m", run.module, "train", "--config", run.config, "--run-dir", run_dir, *run.overrides]
    if spec.topology is None:
        return [spec.run_python, *train_args]
    launcher = ["-m", LAUNCHER, f"--nproc-per-node={spec.topology.world_size}"]
    return [spec.run_python, *launcher, *train_args, "--topology", str(spec.topology)]


def node_train(spec: TargetSpec, run: MultiRunSpec, index: int, run_dir: str, run_id: str) -> list[str]:
    """Host ``index`` of a run over several hosts: ``-m training.launch --nnodes=H --node-rank=I
    ... -m <module> train ... --topology N+M --placement ...``. The first host's agent serves the
    rendezvous (``is_host``); each host advertises its ``addr`` (``--local-addr``), by which c10d
    numbers the hosts (the inventory checks that order). The rendezvous id is the run id: agents of
    another run never join it."""
    node = run.nodes[index]
    launcher = [
        "-m",
        LAUNCHER,
        f"--nnodes={len(run.nodes)}",
        f"--node-rank={index}",
        f"--nproc-per-node={node.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={run.rendezvous}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={'true' if index == 0 else 'false'}",
        f"--local-addr={node.addr}",
    ]
    train_args = ["-m", run.run.module, "train", "--config", run.run.config, "--run-dir", run_dir]
    topology = ["--topology", str(run.topology), "--placement", run.placement]
    return [spec.run_python, *launcher, *train_args, *run.run.overrides, *topology]


def warm(spec: TargetSpec, *, if_needed: bool) -> list[str]:
    """``<python> -m <module> warm --config C --cache-dir <workdir>/compile-cache [--if-needed] ...``."""
    flag = ["--if-needed"] if if_needed else []
    head = [*_head(spec, "warm"), "--config", spec.run.config]
    return [*head, "--cache-dir", spec.layout.compile_cache, *flag, *spec.run.overrides]


def plan(spec: TargetSpec, gpus: int, *, as_json: bool) -> list[str]:
    """``<python> -m <module> plan --config C <overrides> --gpus G [--json]`` (the split advisor)."""
    argv = [*_head(spec, "plan"), "--config", spec.run.config, *spec.run.overrides]
    return [*argv, "--gpus", str(gpus), *(["--json"] if as_json else [])]


def resume_check(spec: TargetSpec, run_dir: str) -> list[str]:
    """``<python> -m <module> resume-check --config C --run-dir D <overrides>`` (read-only)."""
    head = [*_head(spec, "resume-check"), "--config", spec.run.config]
    return [*head, "--run-dir", run_dir, *spec.run.overrides]


def export(spec: TargetSpec, run_dir: str, out: str, step: int | None, *, gguf: bool = False) -> list[str]:
    """``<python> -m <module> export --run-dir D --out O [--step N] [--gguf]``."""
    argv = [*_head(spec, "export"), "--run-dir", run_dir, "--out", out]
    return argv + (["--step", str(step)] if step is not None else []) + (["--gguf"] if gguf else [])


def serve_bench(spec: TargetSpec, run_dir: str, draft_lengths: str, prompts: int) -> list[str]:
    """``<python> -m <module> serve-bench --run-dir D [--draft-lengths N,N] [--prompts N]``."""
    argv = [*_head(spec, "serve-bench"), "--run-dir", run_dir]
    argv += ["--draft-lengths", draft_lengths] if draft_lengths else []
    return argv + (["--prompts", str(prompts)] if prompts else [])
