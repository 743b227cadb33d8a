"""Cold compile of the drafter step, per graph and per bucket shape, and the step time after it.

    # one H200, qwen3-8b-h200 drafter shape (4 x 4096, 512 anchors, block 16, 5 layers), cold caches
    python benchmarks/cold_bench.py --cache /tmp/cold-a --lengths 4096,3296 --out /tmp/cold-a.json
    # the same on a CPU, tiny shapes (CPU inductor; blockwise attention, flex has no CPU backward)
    python benchmarks/cold_bench.py --device cpu --tiny --cache /tmp/cold-cpu --lengths 64

One process = one variant, its own empty ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` (under
``--cache``, wiped first). The drafter is the trainer's (``DFlashDrafter`` + ``core.drafter_step``:
forward, backward, clipping, fused AdamW) on random target hidden states, built without the target
model (only its embedding and lm_head, random), so the figure is the drafter's compile alone. For
each ``--lengths`` shape (a bucket: ``--rows`` x length) the first step is timed from a cold
start: that is the compile. Then, under ``--lock`` (several variants in parallel time their steps
one at a time), the median of ``--iters`` steps at the first shape.

Where the time goes: Dynamo's per-frame metrics (``torch._dynamo.utils.get_compilation_metrics``:
trace, backend = AOT + inductor, inductor's code generation) and ``compile_times()``, and with
``PYTHONPATH=benchmarks/gpu/ktime FLEET_KERNEL_LOG=file`` one line per Triton kernel compiled
(its seconds, in whichever worker compiled it). Prints a summary and the JSON as the last line.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="this variant's cache root (wiped first)")
    parser.add_argument("--keep-cache", action="store_true", help="start from what --cache holds")
    parser.add_argument("--lengths", default="4096", help="bucket lengths, compiled in this order")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small drafter (CPU development)")
    parser.add_argument("--eager-regions", action="store_true", help="only flex (and its mask) compiled")
    parser.add_argument("--threads", type=int, default=0, help="inductor compile_threads (0 = torch's)")
    parser.add_argument(
        "--late-workers",
        action="store_true",
        help="leave inductor's compile workers to start at the first compile (the trainer starts them early)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--lock", default="", help="a file to flock around the step timing")
    parser.add_argument("--save-blob", default="", help="save the Mega-Cache blob here after the run")
    parser.add_argument("--load-blob", default="", help="load this Mega-Cache blob before the first step")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    cache = Path(args.cache)
    if not args.keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    (cache / "inductor").mkdir(parents=True, exist_ok=True)
    (cache / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    if args.threads:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.threads)
    started = time.perf_counter()

    import torch

    from training.model import attention
    from training.model.drafter import DFlashDrafter, DrafterConfig, sample_anchors
    from training.run import core

    device = torch.device(args.device)
    if not args.late_workers:
        from training.compile.cache import start_workers

        start_workers(device)  # as the trainer does before it loads data and the target
    if args.tiny:
        hidden, heads, kv, head_dim, inter, vocab, layers = 64, 4, 2, 16, 128, 512, 32
        cfg = DrafterConfig(
            num_layers=2,
            block_size=4,
            num_anchors=8,
            sliding_window=16,
            full_attention_layers=(1,),
            loss_chunk_size=32,
            mask_token_id=1,
        )
    else:  # qwen3-8b-h200
        hidden, heads, kv, head_dim, inter, vocab, layers = 4096, 32, 8, 128, 12288, 151936, 36
        cfg = DrafterConfig(
            num_layers=5,
            block_size=16,
            num_anchors=512,
            sliding_window=2048,
            full_attention_layers=(4,),
            loss_chunk_size=2048,
            mask_token_id=151669,
        )
    target_config = SimpleNamespace(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        num_hidden_layers=layers,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target_config, embed, lm_head)
    if not args.eager_regions:
        drafter.compile_regions("default")
    drafter = drafter.to(device)
    if device.type == "cpu":
        attention.set_cpu_compile(True)
    lengths = [int(x) for x in args.lengths.split(",")]
    limit = attention.configure_compile(len(lengths), drafter.graphs_per_shape())
    params = core.trainable_parameters(drafter)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=core.fused_adamw(params) or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    n_ctx = len(cfg.resolved_target_layers(layers))
    blob_load_s = 0.0
    if args.load_blob:  # as a second host of the same key starts: the shipped artefact, an empty cache
        t0 = time.perf_counter()
        torch.compiler.load_cache_artifacts(Path(args.load_blob).read_bytes())
        blob_load_s = time.perf_counter() - t0
    setup_s = time.perf_counter() - started

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def batch(length: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, vocab, (args.rows, length), generator=g)
        mask = torch.ones(args.rows, length, dtype=torch.bool)
        mask[:, : length // 10] = False  # the prompt
        lengths_t = torch.full((args.rows,), length)
        anchors = sample_anchors(mask, lengths_t, cfg.num_anchors, g)
        h = torch.randn(args.rows, length, n_ctx * hidden, generator=g).to(dtype)
        return ids.to(device), mask.to(device), h.to(device), anchors.to(device)

    def step(b: tuple[Any, ...]) -> float:
        return core.drafter_step(drafter, optimizer, scheduler, *b, grad_clip=1.0).loss

    from torch._dynamo.utils import get_compilation_metrics

    from training.compile.cache import cache_counters

    per_bucket = []
    batches = {}
    for length in lengths:
        batches[length] = batch(length)
        done = len(get_compilation_metrics())
        sync()
        t0 = time.perf_counter()
        step(batches[length])
        sync()
        first = time.perf_counter() - t0
        since_start = time.perf_counter() - started
        graphs = []
        for m in get_compilation_metrics()[done:]:
            graphs.append(
                {
                    "co_name": m.co_name,
                    "compile_id": str(m.compile_id),
                    "entire_frame_s": m.entire_frame_compile_time_s,
                    "backend_s": m.backend_compile_time_s,
                    "inductor_s": m.inductor_compile_time_s,
                    "code_gen_s": m.code_gen_time_s,
                    "fail": m.fail_type,
                }
            )
        per_bucket.append(
            {"length": length, "first_step_s": first, "since_start_s": since_start, "graphs": graphs}
        )
        print(
            f"[{args.label}] bucket {length}: first step {first:.1f}s, {len(graphs)} frames compiled",
            flush=True,
        )

    lock = open(args.lock, "w") if args.lock else None
    if lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        b = batches[lengths[0]]
        for _ in range(args.warmup):
            step(b)
        sync()
        times = []
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            step(b)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    finally:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
    blob_bytes = 0
    if args.save_blob:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(args.save_blob).write_bytes(saved[0])
            blob_bytes = len(saved[0])
    kernels: list[dict[str, Any]] = []
    log = os.environ.get("FLEET_KERNEL_LOG")
    if log and Path(log).exists():
        for line in Path(log).read_text().splitlines():
            sec, name, pid = line.split("\t")
            kernels.append({"s": float(sec), "name": name, "pid": int(pid)})
    from torch._dynamo.utils import compilation_time_metrics

    summary = {
        "bench": "cold_bench",
        "label": args.label,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "compile_threads": torch._inductor.config.compile_threads,
        "cpus": len(os.sched_getaffinity(0)),
        "recompile_limit": limit,
        "setup_s": setup_s,
        "blob_load_s": blob_load_s,
        "blob_bytes": blob_bytes,
        "buckets": per_bucket,
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_all": [round(1e3 * t, 1) for t in times],
        "peak_gib": peak,
        "counters": cache_counters(),
        "time_metrics": {k: round(sum(v), 2) for k, v in compilation_time_metrics.items()},
        "kernels_total_s": round(sum(k["s"] for k in kernels), 1),
        "kernels_top": sorted(kernels, key=lambda k: -k["s"])[:25],
        "kernels_n": len(kernels),
    }
    first = per_bucket[0]["first_step_s"]
    print(
        f"[{args.label}] cold first step {first:.1f}s, step {summary['step_ms']:.1f} ms, "
        f"peak {peak:.1f} GiB, {len(kernels)} Triton kernels {summary['kernels_total_s']}s",
        flush=True,
    )
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
