"""Target forward benchmark: tokens/s and MFU of one target rank, fast path vs torch fallback.

    # on one H200: the Qwen3.6-27B hybrid shape (random bf16 weights built on the GPU)
    python benchmarks/target_bench.py --path fast --triton-cache /tmp/tbt   # cold Triton cache
    python benchmarks/target_bench.py --path fast --triton-cache /tmp/tbt   # the same dir, warm
    python benchmarks/target_bench.py --path fallback
    # the script itself on a CPU
    python benchmarks/target_bench.py --config tiny-qwen3.5-cpu --model.kind=random --device cpu \
        --path fallback --batch 2 --length 128

What is timed is the trainer's own target forward (``training.model.target.target_forward``: the
decoder up to the deepest layer the drafter reads, hooks on the chosen layers; ``--layers all``:
every layer) on ``--batch`` x ``--length`` random tokens, after ``--warmup`` untimed calls; the
first call is timed on its own (``first_call_s``: on the fast path it compiles and autotunes
flash-linear-attention's Triton kernels unless ``--triton-cache`` already holds them; a fresh
temp dir by default, so the default is a cold start).

``--path fast`` requires the delta rule on a kernel (exits 2 otherwise); ``--path fallback`` hides
``fla`` and ``causal_conv1d`` from this process before transformers is imported
(``training.model.kernels.hide_kernels``), so transformers takes its torch fallback for every
linear-attention function. Which implementation each function ran is in the output (``kernels``).

FLOPs: ``training.model.flops.forward_flops`` (matmul FLOPs; attention scores counted causal, the
useful half; the delta rule in its chunked form). MFU = achieved FLOP/s / the dense bf16 matmul rate
measured on the same device (``--peak-tflops`` to give one). One JSON line on stdout (the last);
``--append-results`` adds a block to benchmarks/RESULTS.md. One extra forward, after the timed ones,
is split by layer kind with CUDA events (``seconds_by_kind``: linear-attention mixers, full-attention
mixers, MLPs, the rest).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3.6-27b-random")
    parser.add_argument("--path", choices=("fast", "fallback"), default="fast")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5, help="timed forwards")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards after the first call")
    parser.add_argument("--layers", choices=("dflash", "all"), default="dflash")
    parser.add_argument("--triton-cache", default="", help="TRITON_CACHE_DIR (default: a fresh temp dir)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="skip the peak matmul probe")
    parser.add_argument("--append-results", action="store_true")
    return parser.parse_known_args()


def main() -> int:
    args, overrides = parse_args()
    # Both must happen before transformers imports modeling_qwen3_5 (its kernel choice is made then)
    # and before the first Triton compile (the cache dir is read then).
    triton_dir = Path(args.triton_cache or tempfile.mkdtemp(prefix="target-bench-triton-"))
    triton_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    from training.model import kernels as kernel_paths

    if args.path == "fallback":
        kernel_paths.hide_kernels()
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from topology_bench import peak_matmul_flops

    from training.config import ConfigError, load_config
    from training.model.drafter import select_target_layers
    from training.model.flops import TargetShape, forward_flops
    from training.model.target import build_random_target, decoder_layers, num_layers, target_forward

    config = load_config(args.config, [*overrides, f"--model.device={args.device}"])
    if config.model.kind != "random":
        raise SystemExit(
            f"target_bench: {args.config} is model.kind={config.model.kind}; give a random config"
        )
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    model = build_random_target(config.model, device, dtype)
    build_s = time.perf_counter() - started
    found = kernel_paths.linear_attention_kernels(model)
    print(found.line(), file=sys.stderr, flush=True)
    try:
        if args.path == "fast":
            kernel_paths.require_fast_path(
                found, device_type="cuda", required=True, who="target_bench --path fast"
            )
    except ConfigError as exc:
        print(f"error: {exc} (or measure it: --path fallback)", file=sys.stderr)
        return 2

    layers = num_layers(model)
    if args.layers == "all":
        layer_ids = list(range(layers))
    else:
        n = config.drafter.num_target_layers
        layer_ids = list(config.drafter.target_layer_ids) or select_target_layers(layers, n)
    shape = TargetShape.from_config(model.config)
    flops = forward_flops(shape, args.batch, args.length, layers_run=max(layer_ids) + 1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (args.batch, args.length), generator=generator).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        target_forward(model, ids, layer_ids)
        sync()
        return time.perf_counter() - t0

    first_call_s = timed()
    for _ in range(args.warmup):
        timed()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed() for _ in range(args.iters)]
    by_kind = seconds_by_kind(
        model, decoder_layers(model), lambda: target_forward(model, ids, layer_ids), device
    )
    seconds = statistics.median(times)
    tokens = args.batch * args.length
    if args.peak_tflops > 0:
        peak = args.peak_tflops * 1e12
    else:
        peak = peak_matmul_flops(
            args.device, 8192 if device.type == "cuda" else 1024, 50 if device.type == "cuda" else 3
        )
    summary: dict[str, Any] = {
        "bench": "target",
        "config": args.config,
        "path": args.path,
        "kernels": dict(found.kernels),
        "fast_path": found.fast_path,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "fla": _version("fla-core") if args.path == "fast" else "hidden",
        "batch": args.batch,
        "length": args.length,
        "layers_run": max(layer_ids) + 1,
        "layers": layers,
        "layer_ids": layer_ids,
        "build_s": build_s,
        "first_call_s": first_call_s,
        "triton_cache": str(triton_dir),
        "autotune_results_after": kernel_paths.autotune_results(triton_dir),
        "median_forward_s": seconds,
        "forward_s": times,
        "tokens_per_s": tokens / seconds,
        "flops_per_forward": flops["total"],
        "flops_by_term": {k: v for k, v in flops.items() if k != "total"},
        "tflops": flops["total"] / seconds / 1e12,
        "peak_matmul_tflops": peak / 1e12,
        "mfu": flops["total"] / seconds / peak,
        "seconds_by_kind": by_kind,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
    }
    if args.append_results:
        append_results(summary, sys.argv[1:])
    print(json.dumps(summary), flush=True)
    return 0


def seconds_by_kind(model: Any, layers: Any, forward: Any, device: Any) -> dict[str, float]:
    """One forward split by what ran: linear-attention mixers, full-attention mixers, MLPs, rest
    (embedding, norms, rotary, hooks). CUDA events on GPU (no sync inside), wall clock on CPU."""
    import torch

    kinds: dict[str, list[Any]] = {"linear_attention": [], "full_attention": [], "mlp": []}
    for layer in layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            kinds["linear_attention"].append(mixer)
        elif getattr(layer, "self_attn", None) is not None:
            kinds["full_attention"].append(layer.self_attn)
        if getattr(layer, "mlp", None) is not None:
            kinds["mlp"].append(layer.mlp)
    cuda = device.type == "cuda"
    marks: dict[str, list[tuple[Any, Any]]] = {k: [] for k in kinds}
    handles = []

    def stamp() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    for kind, modules in kinds.items():
        for module in modules:
            opened: list[Any] = []
            handles.append(
                module.register_forward_pre_hook(lambda _m, _a, opened=opened: opened.append(stamp()))
            )
            handles.append(
                module.register_forward_hook(
                    lambda _m, _a, _o, opened=opened, kind=kind: marks[kind].append((opened.pop(), stamp()))
                )
            )
    try:
        if cuda:
            torch.cuda.synchronize(device)
        start = stamp()
        forward()
        end = stamp()
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        for handle in handles:
            handle.remove()

    def span(a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if cuda else b - a

    result = {kind: sum(span(a, b) for a, b in pairs) for kind, pairs in marks.items()}
    result["total"] = span(start, end)
    result["rest"] = result["total"] - sum(result[k] for k in kinds)
    return result


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def append_results(summary: dict[str, Any], argv: list[str]) -> None:
    """A block in benchmarks/RESULTS.md: date, machine, command, the numbers."""
    kinds = summary["seconds_by_kind"]
    tokens = f"{summary['batch']} x {summary['length']} tokens"
    layers = f"layers 0..{summary['layers_run'] - 1} of {summary['layers']}"
    speed = (
        f"median forward {summary['median_forward_s']:.3f} s = {summary['tokens_per_s']:,.0f} tok/s, "
        f"{summary['tflops']:.0f} TFLOP/s, MFU {100 * summary['mfu']:.1f}% "
        f"(of a measured {summary['peak_matmul_tflops']:.0f} TFLOP/s)"
    )
    lines = [
        f"## target forward ({summary['config']}, {summary['path']} path) — "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, {summary['device']}; "
        f"torch {summary['torch']}, transformers {summary['transformers']}, fla {summary['fla']}",
        f"- command: `python benchmarks/target_bench.py {' '.join(argv)}`",
        f"- kernels: {', '.join(f'{k} {v}' for k, v in summary['kernels'].items())}",
        f"- {tokens}, {layers}: {speed}",
        f"- first call {summary['first_call_s']:.1f} s ({summary['autotune_results_after']} autotune results "
        "in the Triton cache after it)",
        f"- one forward by kind: linear-attention mixers {kinds['linear_attention']:.3f} s, full-attention "
        f"mixers {kinds['full_attention']:.3f} s, MLPs {kinds['mlp']:.3f} s, rest {kinds['rest']:.3f} s",
    ]
    with open(REPO / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as handle:
        handle.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
