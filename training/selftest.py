"""A stdlib-only stand-in for the trainer: same CLI shape, same events, no torch.

    python -m training.selftest train --config NAME --run-dir DIR
        [--selftest.steps=N] [--selftest.step_seconds=S] [--selftest.fail_at=K]
        [--selftest.checkpoint_every=N] [--selftest.checkpoint_bytes=B]
    (also accepted: --steps N, --step-seconds S, --fail-at K; the `train` word is optional)

It prints the human start-up lines (the bucket table in the trainer's format), writes
``<run-dir>/events.jsonl`` per training/EVENTS.md (run_start, phases, buckets, steps,
checkpoints, done), and behaves like the trainer on the edges fleet relies on:

- SIGTERM / SIGINT: the current step finishes, a checkpoint is written, phase ``stopped``, exit 0;
- ``fail_at=K``: an ``error`` event and phase ``error`` at step K, exit 1;
- a bad argument: one line on stderr, exit 2.

Used by fleet's e2e tests (containers without torch) and by status tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from training.contract import CHECKPOINT_DIR, CONFIG_FILE
from training.events import EventWriter

BLOCK_SIZE = 16
BUCKETS = ((0, 770, 2120), (770, 1216, 4016), (1216, 1728, 5470), (1728, 2432, 7493))


@dataclass(frozen=True)
class Settings:
    config: str
    run_dir: Path
    steps: int = 20
    step_seconds: float = 0.5
    fail_at: int = 0  # 0 = never
    checkpoint_every: int = 10
    checkpoint_bytes: int = 0  # padding, to give a checkpoint a real one's size (a disk can fill)


class _Stop:
    """Remembers that a stop signal came; the step loop checks it between steps."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum


def parse_args(argv: list[str]) -> Settings:
    """The CLI (see the module docstring) -> Settings; raises SystemExit(2) with one line on bad input."""
    if argv and argv[0] == "train":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m training.selftest", allow_abbrev=False)
    parser.add_argument("--config", default="selftest")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--step-seconds", type=float)
    parser.add_argument("--fail-at", type=int)
    known, rest = parser.parse_known_args(argv)
    values: dict[str, float | int] = {}
    for name in ("steps", "step_seconds", "fail_at"):
        if getattr(known, name) is not None:
            values[name] = getattr(known, name)
    for item in rest:
        key, sep, raw = item.removeprefix("--").partition("=")
        if not item.startswith("--") or not sep:
            _usage(f"unexpected argument {item!r}; overrides look like --selftest.steps=5")
        section, _, field = key.partition(".")
        if section != "selftest":
            print(f"selftest: ignoring override {item} (only selftest.* applies here)", flush=True)
            continue
        if field not in ("steps", "step_seconds", "fail_at", "checkpoint_every", "checkpoint_bytes"):
            _usage(
                f"unknown override --{key}; use selftest.steps, step_seconds, fail_at, checkpoint_every, "
                "checkpoint_bytes"
            )
        try:
            values[field] = float(raw) if field == "step_seconds" else int(raw)
        except ValueError:
            _usage(f"--{key}={raw!r} is not a number")
    settings = Settings(config=known.config, run_dir=Path(known.run_dir).absolute(), **values)  # type: ignore[arg-type]
    if settings.steps < 1 or settings.step_seconds < 0 or settings.checkpoint_every < 1:
        _usage("selftest.steps and checkpoint_every must be >= 1, step_seconds >= 0")
    if settings.checkpoint_bytes < 0:
        _usage("selftest.checkpoint_bytes must be >= 0")
    return settings


def _usage(message: str) -> None:
    print(f"selftest: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def print_buckets(events: EventWriter) -> None:
    """The bucket table, on stdout in the trainer's format and as a ``buckets`` event."""
    total = sum(b for _, _, b in BUCKETS)
    rows = [
        {"index": i, "lo": lo, "hi": hi, "batches": b, "percent": round(100 * b / total, 1)}
        for i, (lo, hi, b) in enumerate(BUCKETS)
    ]
    print(f"Batches per epoch: {total} (min=2 max=64 avg=19.3)", flush=True)
    for r in rows:
        span = f"[{r['lo']:4d},{r['hi']:4d})"
        print(f"  Bucket {r['index']} {span}: {r['batches']:5d} batches ( {r['percent']:.1f}%)", flush=True)
    events.emit("buckets", batches_per_epoch=total, min=2, max=64, avg=19.3, buckets=rows)


def checkpoint(events: EventWriter, settings: Settings, step: int) -> None:
    events.phase("checkpoint")
    start = time.monotonic()
    path = settings.run_dir / CHECKPOINT_DIR / f"step-{step:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "config": settings.config}) + "\n")
            for _ in range(settings.checkpoint_bytes // 65536):
                fh.write(" " * 65536)
            fh.write(" " * (settings.checkpoint_bytes % 65536))
    except OSError:
        tmp.unlink(missing_ok=True)  # as the trainer does: a checkpoint that did not fit is removed
        raise
    tmp.replace(path)
    seconds = time.monotonic() - start
    events.emit("checkpoint", step=step, path=str(path), seconds=seconds)
    print(f"Checkpoint step {step} -> {path} ({seconds:.2f}s)", flush=True)


def train(settings: Settings) -> int:
    """The step loop; returns the process exit code."""
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / CONFIG_FILE).write_text(
        json.dumps({**asdict(settings), "run_dir": str(settings.run_dir)}, indent=2) + "\n", encoding="utf-8"
    )
    started = time.monotonic()
    with EventWriter(settings.run_dir) as events:
        events.emit(
            "run_start",
            config=settings.config,
            run_dir=str(settings.run_dir),
            pid=os.getpid(),
            host=socket.gethostname(),
            world_size=1,
            device="cpu",
        )
        print(f"selftest: config={settings.config} steps={settings.steps} pid={os.getpid()}", flush=True)
        events.phase("load_data")
        events.phase("buckets")
        print_buckets(events)
        events.phase("train")
        step = 0
        for step in range(1, settings.steps + 1):
            time.sleep(settings.step_seconds)
            if step == settings.fail_at:
                message = f"selftest failure injected at step {step}"
                events.emit("error", type="RuntimeError", message=message, traceback_tail=message)
                events.phase("error")
                print(f"RuntimeError: {message}", file=sys.stderr, flush=True)
                return 1
            loss = 8.0 * math.exp(-step / 10) + 0.5
            acc = [
                round(max(0.0, 0.9 - 0.05 * k) * (1 - math.exp(-step / 5)), 4) for k in range(1, BLOCK_SIZE)
            ]
            events.emit(
                "step",
                step=step,
                total_steps=settings.steps,
                epoch=0,
                loss=loss,
                acc=acc,
                tau=1.0 + sum(acc[:3]),
                lr=1e-4,
                tokens_per_s=1000.0,
                grad_norm=1.0,
                mem_gib=0.0,
            )
            print(f"step {step}/{settings.steps} loss={loss:.4f} acc1={acc[0]:.3f}", flush=True)
            if stop.signal is not None:
                checkpoint(events, settings, step)
                events.phase("stopped")
                print(f"Stopped by signal {stop.signal} after step {step}; checkpointed", flush=True)
                return 0
            if step % settings.checkpoint_every == 0 and step < settings.steps:
                checkpoint(events, settings, step)
                events.phase("train")
        checkpoint(events, settings, step)
        events.emit("done", steps=step, seconds=time.monotonic() - started)
        events.phase("done")
        print(f"Done: {step} steps in {time.monotonic() - started:.1f}s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
