"""Time to first step with a cold compile cache, a warm cache dir, and a Mega-Cache blob loaded
into an empty dir; miss counts of each; the same start with compile excluded.

    python benchmarks/compile_bench.py                       # GPU: qwen3-8b-h200 and its buckets
    python benchmarks/compile_bench.py --device cpu          # tiny CPU mode (one shape, CPU inductor)
    python benchmarks/compile_bench.py --max-shapes 2 --index-check --out /tmp/cb

Each measurement is a fresh process (``--child MODE``) that does what a training process does
before its first step: import torch, activate the compile cache (``training.compile.cache``),
build the data plan and a drafter (``training.run.warm``: stand-in target, real drafter, real
compiled attention), then run one optimizer-free training step per shape (``warm_step``):

- ``cold``: an empty cache root; afterwards it saves ``megacache.bin`` + ``manifest.json``.
- ``warm``: a new process on the same cache dir (blob not loaded: the dir alone).
- ``blob``: an empty root holding only manifest + blob; ``load_cache_artifacts`` first.

Per mode: ``first_step_s`` = spawn -> end of the first shape's step (interpreter + imports +
setup + compile or cache load + step), ``all_shapes_s`` = spawn -> every shape stepped once,
the counters (fxgraph / aotautograd hit and miss) and the setup seconds. "Compile excluded" =
spawn -> setup done + the first shape's step timed again in the same process once compiled
(``nocompile_first_step_s``, per mode; ``<mode>_vs_nocompile`` = the ratio within one process).
Goal: ``warm_vs_nocompile`` <= 1.2 with zero misses.

``--index-check`` (2+ GPUs): after ``cold`` ran on ``cuda:0`` (CUDA_VISIBLE_DEVICES=0), a process
with CUDA_VISIBLE_DEVICES=1 (it sees its GPU as ``cuda:0``) and one that uses ``cuda:1`` with both
GPUs visible run on the warm dir: do they hit or miss?

Last line of output: one JSON summary. Nothing is written to benchmarks/RESULTS.md; paste it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY_CPU = [
    "--compile.enabled=on",
    "--data.num_buckets=1",
    "--data.max_length=64",
    "--data.token_budget=4096",
    "--data.max_batch_size=64",
    "--data.corpus_files=2",
    "--data.eval_prompts=0",
    "--drafter.num_layers=1",
    "--drafter.full_attention_layers=0",
    "--drafter.num_anchors=8",
    "--train.torch_threads=1",
]


# ------------------------------------------------------------------ child: one measured process
def compilation_time_metrics() -> dict[str, list[float]]:
    """Dynamo's per-section compile seconds of this process (empty when torch lacks them)."""
    from torch._dynamo import utils

    return dict(getattr(utils, "compilation_time_metrics", {}))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process start up to every shape's first step; the spawn time comes from the parent."""
    spawned = float(args.spawned)
    import torch

    from training.compile.cache import (
        CacheDir,
        Manifest,
        activate,
        cache_counters,
        save_blob,
        triton_version,
    )
    from training.config import load_config
    from training.model import attention
    from training.model.target import load_tokenizer, model_source, resolve_device, resolve_dtype
    from training.run.core import build_drafter, load_train_data, set_threads
    from training.run.warm import (
        StandInTarget,
        compile_shapes,
        config_hash,
        set_compile_guards,
        target_config,
        warm_step,
    )

    config = load_config(args.config, args.overrides)
    device = resolve_device(config.model.device)
    set_threads(config)
    active = activate(Path(args.cache_root), device, load=args.mode != "warm")
    if device.type == "cpu":
        attention.set_cpu_compile(True)
    folder, tok_dir = model_source(config)
    tokenizer = load_tokenizer(tok_dir)
    planner = load_train_data(config, tokenizer, Path(args.cache_root).parent / "data-cache").planner
    dtype = resolve_dtype(config.model.dtype, device)
    stand_in = StandInTarget(target_config(config, folder), device, dtype)
    drafter = build_drafter(config, stand_in, device, tokenizer)
    shapes = compile_shapes(planner)[: args.max_shapes or None]
    limit = set_compile_guards(config, drafter, len(shapes))
    setup_done = time.time()
    gen = torch.Generator().manual_seed(0)
    marks: list[float] = []
    for shape in shapes:
        warm_step(drafter, shape, device=device, hidden_dtype=dtype, generator=gen)
        marks.append(time.time())
        done = marks[-1] - spawned
        print(f"{args.mode}: shape {shape} stepped at +{done:.1f}s", file=sys.stderr, flush=True)
    counters = cache_counters()
    again = time.time()
    warm_step(drafter, shapes[0], device=device, hidden_dtype=dtype, generator=gen)
    steady_first = time.time() - again
    result: dict[str, Any] = {
        "mode": args.mode,
        "device": str(device),
        "key": active.cache.key.text,
        "shapes": len(shapes),
        "recompile_limit": limit,
        "setup_s": round(setup_done - spawned, 3),
        "blob_load_s": round(active.load_seconds, 3),
        "blob_entries": active.blob_entries,
        "first_step_s": round(marks[0] - spawned, 3),
        "all_shapes_s": round(marks[-1] - spawned, 3),
        "nocompile_first_step_s": round(setup_done - spawned + steady_first, 3),
        "steady_step_s": round(steady_first, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else 0,
        "shape_s": [round(b - a, 3) for a, b in zip([setup_done, *marks], marks, strict=False)],
        # Where the compile time went (Dynamo's dynamo_timed sections, seconds summed).
        "compile_times": {k: round(sum(v), 3) for k, v in compilation_time_metrics().items()},
        **counters,
    }
    if args.mode == "cold":
        cache: CacheDir = active.cache
        blob_bytes, _entries = save_blob(cache.blob_path)
        cache.write_manifest(
            Manifest(
                key=cache.key.text,
                config=config.name,
                config_hash=config_hash(config),
                buckets=tuple(int(b) for b in planner.boundaries),
                shapes=tuple(shapes),
                variants=len(drafter.variants()),
                recompile_limit=limit,
                seconds=round(marks[-1] - spawned, 3),
                torch=cache.key.torch,
                triton=triton_version(),
                device=cache.key.device,
                blob_bytes=blob_bytes,
                created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                complete=True,
                counters=counters,
            )
        )
        result["blob_bytes"] = blob_bytes
    return result


# ------------------------------------------------------------------ parent: spawn and compare
def spawn(
    mode: str, root: Path, config: str, overrides: list[str], max_shapes: int, env: dict[str, str]
) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--cache-root", str(root)]
    argv += ["--config", config, "--max-shapes", str(max_shapes), "--spawned", repr(time.time())]
    argv += [f"--override={o}" for o in overrides]
    # The child's stderr goes to a file next to the caches: readable even when a time limit
    # kills this benchmark mid-compile.
    log = root.parent / f"{mode}-{root.name}-{env.get('CUDA_VISIBLE_DEVICES', 'all')}.log"
    with log.open("w") as err:
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"compile_bench: child {mode} failed (exit {proc.returncode}), log {log}:\n{tail}")
    result = json.loads(lines[-1])
    print(
        f"{mode:>6}: first step {result['first_step_s']:.1f}s, all {result['shapes']} shapes "
        f"{result['all_shapes_s']:.1f}s, setup {result['setup_s']:.1f}s, compile excluded "
        f"{result['nocompile_first_step_s']:.1f}s; fxgraph {result['fxgraph_hit']} hit / "
        f"{result['fxgraph_miss']} miss, aotautograd {result['aotautograd_hit']} hit / "
        f"{result['aotautograd_miss']} miss; peak memory {result['peak_mem_gib']} GiB",
        flush=True,
    )
    return result


def _ratio(result: dict[str, Any]) -> float:
    return round(result["first_step_s"] / max(result["nocompile_first_step_s"], 1e-9), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config", default="", help="default: qwen3-8b-h200 (cuda) / tiny-cpu (cpu)")
    parser.add_argument("--override", action="append", default=[], help="--section.key=value (repeat)")
    parser.add_argument("--max-shapes", type=int, default=0, help="warm only the first N shapes (0 = all)")
    parser.add_argument(
        "--index-check", action="store_true", help="cuda:0 via CUDA_VISIBLE_DEVICES vs cuda:1"
    )
    parser.add_argument("--out", default="", help="work folder (default: a temporary one, removed)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cache-root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", default="0", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode, args.overrides = args.child, list(args.override)
        print(json.dumps(child(args)), flush=True)
        return 0

    config = args.config or ("qwen3-8b-h200" if args.device == "cuda" else "tiny-cpu")
    overrides = list(args.override) or (TINY_CPU if args.device == "cpu" else [])
    overrides.append(f"--model.device={args.device}")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="compile-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("cold", "blob", "index"):
        shutil.rmtree(work / name, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("FLEET_TRAINING_CACHE", str(work / "training-cache"))
    gpu_env = {**env, "CUDA_VISIBLE_DEVICES": "0"} if args.device == "cuda" else env
    started = time.time()
    cold = spawn("cold", work / "cold", config, overrides, args.max_shapes, gpu_env)
    warm = spawn("warm", work / "cold", config, overrides, args.max_shapes, gpu_env)
    key_dir = work / "cold" / cold["key"]
    (work / "blob" / cold["key"]).mkdir(parents=True)
    for name in ("manifest.json", "megacache.bin"):
        shutil.copy2(key_dir / name, work / "blob" / cold["key"] / name)
    blob = spawn("blob", work / "blob", config, overrides, args.max_shapes, gpu_env)
    summary: dict[str, Any] = {
        "bench": "compile_cache",
        "config": config,
        "overrides": overrides,
        "device": args.device,
        "key": cold["key"],
        "shapes": cold["shapes"],
        "blob_bytes": cold.get("blob_bytes", 0),
        "cold": cold,
        "warm": warm,
        "blob": blob,
        # Each ratio against the same process's start with compile excluded (same load on the box).
        "cold_vs_nocompile": _ratio(cold),
        "warm_vs_nocompile": _ratio(warm),
        "blob_vs_nocompile": _ratio(blob),
        "warm_misses": warm["fxgraph_miss"] + warm["aotautograd_miss"],
        "blob_misses": blob["fxgraph_miss"] + blob["aotautograd_miss"],
    }
    if args.index_check and args.device == "cuda":
        # Same warm dir: a process whose GPU is physical 1 but seen as cuda:0 ...
        cvd1 = {**env, "CUDA_VISIBLE_DEVICES": "1"}
        seen0 = spawn("warm", work / "cold", config, overrides, args.max_shapes, cvd1)
        # ... and one that addresses physical 1 as cuda:1 (both visible).
        idx1 = [*overrides, "--model.device=cuda:1"]
        both = {**env, "CUDA_VISIBLE_DEVICES": "0,1"}
        seen1 = spawn("warm", work / "cold", config, idx1, args.max_shapes, both)
        keys = ("fxgraph_hit", "fxgraph_miss", "aotautograd_hit", "aotautograd_miss", "first_step_s")
        summary["index_check"] = {
            "cvd1_as_cuda0": {k: seen0[k] for k in keys},
            "cuda1": {k: seen1[k] for k in keys},
        }
    summary["wall_s"] = round(time.time() - started, 1)
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
