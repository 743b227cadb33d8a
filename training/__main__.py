"""``python -m training {train,eval,export,warm,plan}`` — the trainer's command line (runs on the target).

    python -m training train  --config NAME|PATH --run-dir DIR [--topology N+M] [--section.key=value ...]
    python -m training eval   --run-dir DIR [--export FOLDER]
    python -m training export --run-dir DIR [--step N] --out FOLDER [--dtype bfloat16|float32] [--gguf]
    python -m training serve-bench --run-dir DIR [--draft-lengths N,N] [--prompts N] [--max-new-tokens N]
    python -m training warm  --config NAME|PATH [--cache-dir ROOT] [--if-needed] [--section.key=value ...]
    python -m training plan  --config NAME|PATH [--gpus G] [--json] [--section.key=value ...]
    python -m training resume-check --config NAME|PATH --run-dir DIR [--section.key=value ...]
    python -m training data   --config NAME|PATH [--json] [--section.key=value ...]
    python -m training regen  --input FILE --output FILE --server ADDR [--server ADDR ...] [options]

Exit 0 when finished or stopped by SIGTERM (checkpointed). A user error (bad config or
override, missing model or data folder) is one line on stderr, an ``error`` event, exit 2,
no traceback. A full disk (ENOSPC / EDQUOT anywhere in the failure's chain) is the machine's
state, not a bug: one line naming it and where, an ``error`` event, exit 1, no traceback (the
traceback would land, cut short, in a log on that same full disk). Any other failure writes an
``error`` event and re-raises (traceback, exit 1).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from training.config import TrainingError
from training.contract import COMPILE_CACHE_ENV
from training.events import EventWriter, first_line


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
    export.add_argument(
        "--gguf", action="store_true", help="also the drafter + target as GGUF for llama.cpp, in <out>-gguf/"
    )
    export.add_argument(
        "--target-model-dir",
        type=Path,
        default=None,
        help="with --gguf: the target's HF folder (default: the run's)",
    )
    bench = sub.add_parser(
        "serve-bench", help="the drafter in llama.cpp vs the target alone (training.engines)"
    )
    bench.add_argument("--run-dir", required=True, type=Path)
    bench.add_argument(
        "--draft-lengths", default="", metavar="N,N", help="default: 1, 3, block/2 - 1, block - 1"
    )
    bench.add_argument(
        "--prompts", type=int, default=0, help="held-out prompts (default: all the run holds out)"
    )
    bench.add_argument(
        "--max-new-tokens", type=int, default=0, help="default: the config's eval.max_new_tokens"
    )
    bench.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: all cores)")
    bench.add_argument(
        "--engine-args",
        default="",
        metavar="FLAGS",
        help="more llama-server flags for every setting, one string (e.g. '-bs')",
    )
    warm = sub.add_parser(
        "warm", help="compile every shape of a config into a compile cache (training.run.warm)"
    )
    warm.add_argument("--config", required=True, help="config name in training/configs/ or a TOML path")
    warm.add_argument("--cache-dir", default="", help=f"the cache root (default ${COMPILE_CACHE_ENV})")
    warm.add_argument("--if-needed", action="store_true", help="skip when the key is warm for this config")
    data = sub.add_parser("data", help="the data report: records, tokens, drops, lengths, bucket plan")
    data.add_argument("--config", required=True, help="config name in training/configs/ or a TOML path")
    data.add_argument("--json", action="store_true", help="one JSON object instead of the text")
    regen = sub.add_parser(
        "regen", help="regenerate a data set's replies through OpenAI-compatible servers (resumable)"
    )
    regen.add_argument("--input", required=True, type=Path, help="JSONL: conversations, messages or prompts")
    regen.add_argument(
        "--output", required=True, type=Path, help="X.jsonl (+ X_error.jsonl, X_skipped.jsonl)"
    )
    regen.add_argument(
        "--server", action="append", required=True, help="host:port or URL; repeat for several"
    )
    regen.add_argument("--model", default="default", help="the model name the servers expect")
    regen.add_argument("--max-tokens", type=int, default=4096)
    regen.add_argument("--temperature", type=float, default=0.8)
    regen.add_argument("--concurrency", type=int, default=64, help="requests in flight per server")
    regen.add_argument("--retries", type=int, default=4, help="per request, on the next server, with backoff")
    regen.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    regen.add_argument("--reasoning", default="none", choices=("none", "save", "disable"))
    regen.add_argument("--num-samples", type=int, default=0, help="only the first N records (0 = all)")
    regen.add_argument("--retry-errors", action="store_true", help="send the error file's records again")
    regen.add_argument("--json", action="store_true", help="the summary as one JSON object")
    return parser


def _regen(args: argparse.Namespace) -> int:
    """``regen``: exit 0 when every record is accounted for and none failed, 1 when some failed
    (they are in the error file; the others are kept)."""
    from training.data.engine_regen import RegenSettings, regenerate_file

    settings = RegenSettings(
        servers=tuple(args.server),
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
        retries=args.retries,
        timeout_s=args.timeout,
        reasoning=args.reasoning,
        num_samples=args.num_samples,
        retry_errors=args.retry_errors,
    )
    result = regenerate_file(args.input, args.output, settings)
    print(result.to_json() if args.json else result.text(), flush=True)
    return 0 if result.balanced and not result.error else 1


def _data(config_name: str, overrides: list[str], as_json: bool) -> int:
    from training.config import load_config
    from training.model.target import load_tokenizer, model_source
    from training.run.core import data_report, default_cache_dir

    config = load_config(config_name, overrides)
    _folder, tok_dir = model_source(config)
    report = data_report(
        config, load_tokenizer(tok_dir), default_cache_dir(config.model.cache_dir) / "data-cache"
    )
    print(report.to_json() if as_json else report.text(), flush=True)
    return 0


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
    if args.command in ("data", "regen"):  # read the data only: no run dir, no event
        try:
            if args.command == "regen":
                if extra:
                    raise_usage(f"unexpected argument {extra[0]!r}: see python -m training regen --help")
                return _regen(args)
            _check_overrides(extra)
            return _data(args.config, extra, args.json)
        except TrainingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
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
            return export_main(
                args.run_dir,
                args.out,
                args.step,
                args.dtype,
                gguf=args.gguf,
                target_model_dir=args.target_model_dir,
            )
        elif args.command == "serve-bench":
            if extra:
                raise_usage(f"unexpected argument {extra[0]!r}: see python -m training serve-bench --help")
            from training.engines.serve_bench import parse_engine_args, parse_lengths, serve_bench

            run_dir = None  # a failed benchmark is not the run's error: no error event, phase kept
            serve_bench(
                args.run_dir,
                draft_lengths=parse_lengths(args.draft_lengths),
                num_prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                threads=args.threads,
                engine_args=parse_engine_args(args.engine_args),
            )
        else:
            if other := [arg for arg in extra if not arg.startswith("--eval.")]:
                raise_usage(
                    f"unexpected argument {other[0]!r}: eval takes --run-dir, --export and --eval.KEY=VALUE"
                )
            from training.config import read_config
            from training.run.single import evaluate_run

            evaluate_run(read_config(run_dir, extra), run_dir, export=args.export)
    except TrainingError as exc:
        _record_error(run_dir, exc)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseException as exc:
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            raise
        _record_error(run_dir, exc)
        full = disk_full(exc)
        if full is None:
            raise
        print(
            f"error: {full}; free space there, then `fab train` resumes from the last checkpoint",
            file=sys.stderr,
        )
        return 1
    return 0


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> str | None:
    """'the disk is full (No space left on device) writing PATH' when ``exc``, or an exception it was
    raised from or during, is a full disk or quota; None otherwise. Libraries wrap the OSError
    (torch's checkpoint writer raises a RuntimeError whose text carries it), so the text counts too."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL:
            where = f" writing '{current.filename}'" if current.filename else ""
            return f"the disk is full ({os.strerror(current.errno)}){where}"
        text = str(current)
        for code in _DISK_FULL:
            if os.strerror(code) in text:
                return f"the disk is full ({os.strerror(code)}): {first_line(current)[:300]}"
        todo += [current.__cause__, current.__context__]
    return None


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
    from training.process_exit import exit_process

    sys.exit(exit_process(main()))
