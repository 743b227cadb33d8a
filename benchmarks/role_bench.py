"""Each role's speed on its own, compiled and not, with MFU from the FLOP model.

    # on one H200, cold compile included (~5-7 min): the 1+1 shape (qwen3-8b-h200, 4 x 4096)
    FLEET_COMPILE_CACHE=/tmp/rb-cache python benchmarks/role_bench.py --config qwen3-8b-h200 \\
        --data.num_buckets=1 --data.corpus_files=300
    # the script itself on a CPU (tiny model)
    python benchmarks/role_bench.py --config tiny-cpu --device cpu --iters 2

Builds the run's target and drafter on one device as the split probe does (``Trainer.setup``, with
``compile.target`` off so the target starts eager), then times:

- the target forward (``target_forward``, the layers up to the deepest chosen one) on random
  tokens at the longest bucket's shape (``--batch`` x the bucket's padded length): eager, then
  compiled (``compile_target``; its first call, the cold compile, is reported on its own);
- the drafter step (``drafter_step``: forward, backward, clipping, AdamW) on a real batch of that
  bucket and the compiled target's hidden states: with the run's compiled regions (the code
  between the attention kernels and the loss's softmax, ``DFlashDrafter.compile_regions``), then
  with those regions eager (flex attention compiled either way: the drafter before the regions).

MFU from ``training.model.flops`` (the target's forward on the batch's tokens; the drafter step
from the batch's own anchors and labels), against the bf16 8192^3 matmul rate measured here and
the H200's 989 TFLOP/s spec. Prints one line per figure and the JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def timed(fn: Callable[[], Any], iters: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of each of ``iters`` calls (synchronised)."""
    seconds = []
    for _ in range(iters):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-8b-h200")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after each compile")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per figure")
    args, overrides = parser.parse_known_args()
    overrides = [*overrides, "--compile.target=false"]  # the target starts eager; compiled below
    if args.device == "cpu":
        overrides.append("--model.device=cpu")

    import torch
    from topology_bench import flop_shapes, peak_matmul_flops

    from training.compile.cache import cache_counters
    from training.config import load_config
    from training.model.drafter import block_labels
    from training.model.flops import H200_BF16_DENSE_PEAK, AnchorStats, drafter_step_flops, forward_flops
    from training.model.target import compile_target, target_forward
    from training.run.core import batch_anchors
    from training.run.single import Trainer

    config = load_config(args.config, overrides)
    on_gpu = args.device == "cuda"
    peak = peak_matmul_flops(args.device, 8192 if on_gpu else 1024, 10 if on_gpu else 3)
    spec = H200_BF16_DENSE_PEAK if on_gpu else None
    shapes = flop_shapes(config)
    scratch = Path(tempfile.mkdtemp(prefix="fleet-role-bench-"))
    trainer = Trainer(config, scratch)
    figures: dict[str, Any] = {}

    def mfu(flops: float, seconds: float) -> dict[str, float | None]:
        return {
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / peak,
            "mfu_spec": flops / seconds / spec if spec else None,
        }

    def report(name: str, seconds: list[float], flops: float, **extra: Any) -> None:
        median = statistics.median(seconds)
        figures[name] = {
            "ms": 1e3 * median,
            "ms_all": [round(1e3 * s, 2) for s in seconds],
            **mfu(flops, median),
        }
        figures[name].update(extra)
        spec_part = f", {100 * figures[name]['mfu_spec']:.1f}% of the 989 spec" if spec else ""
        print(
            f"{name}: {1e3 * median:.1f} ms, {figures[name]['tflops']:.1f} TFLOP/s, MFU "
            f"{100 * figures[name]['mfu']:.1f}% of the measured {peak / 1e12:.0f}{spec_part}",
            flush=True,
        )

    try:
        trainer.setup(quiet_data=True)
        device = trainer.device

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        planner = trainer.data.planner
        longest = len(planner.boundaries) - 2
        while True:  # a real batch of the longest bucket (the drafter's shape)
            batch = trainer.next_batch()
            if batch.bucket == longest:
                break
        ids, mask = batch.input_ids.to(device), batch.loss_mask.to(device)
        anchors = batch_anchors(config, mask, batch.lengths, batch.position).to(device)
        rows, length = ids.shape
        vocab = trainer.target.get_input_embeddings().weight.shape[0]
        random_ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).to(
            device
        )
        t_flops = forward_flops(shapes.target, rows, length, layers_run=shapes.layers_run)["total"]

        # ---- target forward: eager, then compiled
        forward = lambda: target_forward(trainer.target, random_ids, trainer.layer_ids)  # noqa: E731
        timed(forward, args.warmup, sync)
        report("target forward eager", timed(forward, args.iters, sync), t_flops)
        compile_target(trainer.target, mode=config.compile.mode)
        before = cache_counters()
        cold = timed(forward, 1, sync)[0]
        timed(forward, args.warmup, sync)
        report(
            "target forward compiled",
            timed(forward, args.iters, sync),
            t_flops,
            first_call_s=cold,
            fxgraph_miss=cache_counters()["fxgraph_miss"] - before["fxgraph_miss"],
        )
        print(f"target forward compiled: first call (cold compile) {cold:.1f}s", flush=True)

        # ---- drafter step: compiled regions (the run's), then eager regions
        hidden = target_forward(trainer.target, ids, trainer.layer_ids)
        _, label_mask = block_labels(ids, mask, anchors, config.drafter.block_size)
        stats = AnchorStats.from_tensors(anchors, label_mask, trainer.drafter.windows)
        d_flops = drafter_step_flops(shapes.drafter, length, stats)["total"]
        step = lambda: trainer.drafter_step(ids, mask, hidden, anchors)  # noqa: E731
        mode = trainer.drafter.compile_mode
        for name, regions in (("drafter step", mode), ("drafter step eager regions", None)):
            trainer.drafter.compile_mode = regions
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            timed(step, 1, sync)
            first = time.perf_counter() - started
            timed(step, args.warmup, sync)
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0
            report(name, timed(step, args.iters, sync), d_flops, first_call_s=first, peak_mem_gib=mem)
        summary = {
            "bench": "role_bench",
            "config": args.config,
            "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if on_gpu else ""),
            "commit": commit(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
            "argv": sys.argv[1:],
            "batch": [rows, length],
            "anchors_per_row": int(anchors.shape[1]),
            "labelled": stats.labelled,
            "target_tflop": t_flops / 1e12,
            "drafter_tflop": d_flops / 1e12,
            "peak_matmul_tflops": peak / 1e12,
            "spec_peak_tflops": spec / 1e12 if spec else None,
            "compile_cache": cache_counters(),
            "figures": figures,
            "target_speedup": figures["target forward eager"]["ms"]
            / figures["target forward compiled"]["ms"],
            "drafter_speedup": figures["drafter step eager regions"]["ms"] / figures["drafter step"]["ms"],
        }
    finally:
        trainer.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
