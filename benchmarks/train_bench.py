"""Single-process trainer benchmark: step time, tokens/s, peak memory and MFU.

    # on one H200 (the qwen3-8b-h200 shape: random weights built from its config)
    python benchmarks/train_bench.py --config qwen3-8b-h200 --steps 40
    # correctness of the script itself on a CPU
    python benchmarks/train_bench.py --config tiny-cpu --steps 6 --device cpu

Runs ``python -m training train`` (target and drafter on one device), then reads its
events.jsonl. Steps before every padded shape has been seen once (each new shape compiles)
and before ``--warmup-steps`` are left out. FLOPs are counted as in topology_bench.py
(training/model/flops.py): target forward on the real tokens + the drafter step's forward and
backward. MFU against two peaks: the bf16 8192^3 matmul rate measured here, before the run
(``mfu``), and the H200's 989 TFLOP/s dense bf16 spec (``mfu_spec``; GPU only). Prints one JSON
line; ``--append-results`` adds a block to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from topology_bench import (  # noqa: E402
    drafter_flops,
    flop_shapes,
    last_new_shape_step,
    peak_matmul_flops,
    target_flops,
)

from training.config import load_config  # noqa: E402
from training.events import read_events  # noqa: E402
from training.model.flops import H200_BF16_DENSE_PEAK  # noqa: E402


def summarize(
    events: list[dict[str, Any]], config: Any, warmup: int, peak: float, spec_peak: float | None
) -> dict[str, Any]:
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
    if not steps:
        raise SystemExit("the run wrote no step events")
    shapes = {e["padded_length"] for e in steps}
    warmup = max(warmup, last_new_shape_step(steps))
    warm = [e for e in steps if e["step"] > warmup]
    if not warm:
        raise SystemExit("no step after the warm-up: raise --steps or lower --data.num_buckets")
    counts = flop_shapes(config)
    seconds = sum(e["step_s"] for e in warm)
    tokens = sum(e["tokens"] for e in warm)
    t_flops = sum(target_flops(counts, e) for e in warm)
    d_flops = sum(drafter_flops(config, counts, e) for e in warm)
    return {
        "steps_measured": len(warm),
        "warmup_steps_used": warmup,
        "shapes": len(shapes),
        "median_step_s": statistics.median(e["step_s"] for e in warm),
        "tokens_per_s": tokens / seconds,
        "peak_mem_gib": max(e["mem_gib"] for e in steps),
        "mfu": (t_flops + d_flops) / seconds / peak,
        "mfu_spec": (t_flops + d_flops) / seconds / spec_peak if spec_peak else None,
        "tflop_per_step": (t_flops + d_flops) / len(warm) / 1e12,
        "target_share_of_flops": t_flops / (t_flops + d_flops),
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-8b-h200")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--append-results", action="store_true")
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, overrides)
    on_gpu = args.device == "cuda"
    peak = peak_matmul_flops(args.device, 8192 if on_gpu else 1024, 10 if on_gpu else 3)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="train-bench-")) / "run"
    argv = [sys.executable, "-m", "training", "train", "--config", args.config, "--run-dir", str(run_dir)]
    argv += [f"--train.steps={args.steps}", "--train.log_every=1", "--checkpoint.every=0", *overrides]
    subprocess.run(argv, cwd=REPO, check=True, stdout=sys.stderr, stderr=sys.stderr)
    summary = {
        "config": args.config,
        "device": args.device,
        "peak_matmul_tflops": peak / 1e12,
        "spec_peak_tflops": H200_BF16_DENSE_PEAK / 1e12 if on_gpu else None,
        **summarize(
            read_events(run_dir / "events.jsonl"),
            config,
            args.warmup_steps,
            peak,
            H200_BF16_DENSE_PEAK if on_gpu else None,
        ),
    }
    print(json.dumps(summary))
    if args.append_results:
        lines = [
            f"## trainer, single process ({args.config}) — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {platform.node()}, {os.cpu_count()} CPUs, device {args.device}",
            f"- command: `python benchmarks/train_bench.py {' '.join(sys.argv[1:])}`",
            f"- median step {summary['median_step_s']:.3f} s, {summary['tokens_per_s']:,.0f} tok/s, "
            f"peak memory {summary['peak_mem_gib']:.1f} GiB, {summary['tflop_per_step']:.1f} TFLOP a step "
            f"(training/model/flops.py), MFU {100 * summary['mfu']:.1f}% of the bf16 8192^3 matmul rate "
            f"measured here ({summary['peak_matmul_tflops']:.0f} TFLOP/s)"
            + (
                f", {100 * summary['mfu_spec']:.1f}% of the 989 TFLOP/s H200 spec"
                if summary["mfu_spec"] is not None
                else ""
            ),
        ]
        with open(REPO / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as handle:
            handle.write("\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
