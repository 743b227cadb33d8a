"""``python -m training {train,eval,export,warm,plan}`` — the trainer's command line (runs on the target).

    python -m training train  --config NAME|PATH --run-dir DIR [--topology N+M] [--section.key=value ...]
    python -m training eval   --run-dir DIR [--export FOLDER]
    python -m training export --run-dir DIR [--step N] --out FOLDER [--dtype bfloat16|float32]
    python -m training warm  --config NAME|PATH [--cache-dir ROOT] [--if-needed] [--section.key=value ...]
    python -m training plan  --config NAME|PATH [--gpus G] [--json] [--section.key=value ...]
    python -m training resume-check --config NAME|PATH --run-dir DIR [--section.key=value ...]

Exit 0 when finished or stopped by SIGTERM (checkpointed). A user error (bad config or
override, missing model or data folder) is one line on stderr, an ``error`` event, exit 2,
no traceback. Any other failure writes an ``error`` event and re-raises (traceback, exit 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from training.config import TrainingError
from training.contract import COMPILE_CACHE_ENV
from training.events import EventWriter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description="DFlash drafter trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (or resume) a drafter; overrides: --section.key=value")
    train.add_argument("--config", required=True, help="config name in training/configs/ or a TOML path")
    train.add_argument(
        "--run-dir", required=True, type=Path, help="the run directory (resumes if it has checkpoints)"
    )
    train.add_argument(
        "--topology",
        default="",
        metavar="N+M",
        help="N target ranks + M drafter ranks, one process per GPU under torchrun (training.launch)",
    )
    train.add_argument(
        "--placement",
        default="",
        metavar="N+M,N+M",
        help="several hosts: the target + drafter ranks of each host, in node order (training.contract)",
    )
    check = sub.add_parser("resume-check", help="can --run-dir resume with this config? (read-only)")
    check.add_argument("--config", required=True, help="config name in training/configs/ or a TOML path")
    check.add_argument("--run-dir", required=True, type=Path)
    sub.add_parser("plan", help="split advisor: probe rates, predict each N+M split (training.run.plan)")
    evaluate = sub.add_parser("eval", help="measure real acceptance of the newest checkpoint of a run")
    evaluate.add_argument("--run-dir", required=True, type=Path)
    evaluate.add_argument(
        "--export", type=Path, default=None, help="evaluate this exported folder instead of the checkpoint"
    )
    export = sub.add_parser(
        "export", help="write a checkpoint as a folder SGLang/vLLM load (training.export)"
    )
    export.add_argument("--run-dir", required=True, type=Path)
    export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
    export.add_argument("--out", required=True, type=Path, help="the folder to write (replaced atomically)")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    warm = sub.add_parser(
        "warm", help="compile every shape of a config into a compile cache (training.run.warm)"
    )
    warm.add_argument("--config", required=True, help="config name in training/configs/ or a TOML path")
    warm.add_argument("--cache-dir", default="", help=f"the cache root (default ${COMPILE_CACHE_ENV})")
    warm.add_argument("--if-needed", action="store_true", help="skip when the key is warm for this config")
    return parser


def _record_error(run_dir: Path | None, exc: BaseException) -> None:
    """An ``error`` event and ``phase: error`` in the run dir (best effort: the dir may be bad)."""
    if run_dir is None:
        return
    try:
        with EventWriter(run_dir) as events:
            events.error(exc)
    except OSError as write_error:
        print(f"(could not record the error in {run_dir}: {write_error})", file=sys.stderr)


# Pinned host memory (the checkpoint snapshots' buffers) by malloc + cudaHostRegister in 8 threads
# instead of one cudaHostAlloc: on an H200 host, 6 GiB pinned in 0.9 s instead of 4.2 s, and done in
# a background thread it delays the training thread by 0.4 s instead of the whole 2.5 s that
# cudaHostAlloc holds it (benchmarks/pin_bench.py, benchmarks/RESULTS.md).
PINNED_HOST_ALLOC = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def allocator_settings(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Add ``PINNED_HOST_ALLOC`` to the allocator settings (the variable the user set, else
    ``PYTORCH_CUDA_ALLOC_CONF``) before torch reads them; a user's own pinned setting wins."""
    name = next((n for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if environ.get(n)), "")
    current = environ.get(name, "") if name else ""
    if "pinned_use_cuda_host_register" in current:
        return
    value = f"{current},{PINNED_HOST_ALLOC}" if current else PINNED_HOST_ALLOC
    environ[name or "PYTORCH_CUDA_ALLOC_CONF"] = value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    allocator_settings()  # before any subcommand imports torch
    if argv[:1] == ["plan"]:
        from training.run.plan import main as plan_main

        return plan_main(argv[1:])
    args, extra = _parser().parse_known_args(argv)
    if args.command == "resume-check":  # read-only: never writes an event into the run dir
        from training.run.resume_check import resume_check

        try:
            _check_overrides(extra)
            return resume_check(args.config, args.run_dir, extra)
        except TrainingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    run_dir: Path | None = getattr(args, "run_dir", None)
    try:
        if args.command == "train":
            _check_overrides(extra)
            if args.topology or _config_topology(args.config, extra):
                from training.run.distributed import train_distributed

                return train_distributed(args.config, run_dir, extra, args.topology, args.placement)
            from training.run.single import train

            train(args.config, run_dir, extra)
        elif args.command == "warm":
            _check_overrides(extra)
            from training.run.warm import warm_main

            return warm_main(args.config, args.cache_dir, extra, if_needed=args.if_needed)
        elif args.command == "export":
            if extra:
                raise_usage(
                    f"unexpected argument {extra[0]!r}: export takes --run-dir, --step, --out, --dtype"
                )
            from training.export import export_main

            run_dir = None  # export only reads the run dir: no error event in a live run's log
            return export_main(args.run_dir, args.out, args.step, args.dtype)
        else:
            if extra:
                raise_usage(f"unexpected argument {extra[0]!r}: eval takes only --run-dir and --export")
            from training.config import read_config
            from training.run.single import evaluate_run

            evaluate_run(read_config(run_dir), run_dir, export=args.export)
    except TrainingError as exc:
        _record_error(run_dir, exc)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseException as exc:
        if not isinstance(exc, SystemExit | KeyboardInterrupt):
            _record_error(run_dir, exc)
        raise
    return 0


def _config_topology(config_name: str, overrides: list[str]) -> str:
    """``pipeline.topology`` of the run config ("" = single process)."""
    from training.config import load_config

    return load_config(config_name, overrides).pipeline.topology


def _check_overrides(extra: list[str]) -> None:
    """Every argument left after the subcommand's own is a ``--section.key=value`` override."""
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if bad:
        raise_usage(f"unexpected argument {bad[0]!r}: overrides look like --section.key=value")


def raise_usage(message: str) -> None:
    from training.config import ConfigError

    raise ConfigError(message)


if __name__ == "__main__":
    sys.exit(main())
