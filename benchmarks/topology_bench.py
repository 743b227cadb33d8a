"""N+M topology benchmark: tokens/s, MFU and idle fraction per role, plan's prediction vs measured.

    # on 2x H200 (the lead): 1+1 with the Qwen3-8B shape (random weights, nothing downloaded)
    python benchmarks/topology_bench.py --config qwen3-8b-h200 --topology 1+1 --steps 60
    # one padded shape (one compile, pure steady state): add --data.num_buckets=1
    # correctness check on a CPU (tiny model, gloo)
    python benchmarks/topology_bench.py --config tiny-cpu --topology 1+1 --steps 8 --device cpu

Steps: (1) the peak matmul rate of this device (bf16 on GPU, fp32 on CPU), measured;
(2) ``python -m training plan --json`` (the split advisor's probe) -> predicted tokens/s of
the topology; (3) the real job under torchrun with ``pipeline.balance_window_s`` small;
(4) from its events.jsonl, after ``--warmup-steps`` (compile): measured tokens/s (drafter
step events), idle fraction per role (``balance`` events: wait_s / window_s), MFU per role.

FLOPs (useful work only; training/model/flops.py, one tested module):
  target forward on the real tokens = ``forward_flops`` (dense Qwen3 and the qwen3_5 hybrid:
                                   matmuls, causal attention, the chunked delta rule) over the
                                   layers the trainer runs (up to the deepest chosen one)
  drafter step (fwd + bwd)       = ``drafter_step_flops``: fc (no input gradient), the layers on
                                   the block tokens, every layer's context K/V projections, the
                                   visible attention pairs, the frozen lm_head (input gradient only)
                                   on the labelled positions; the anchors' expected spans
                                   (``AnchorStats.expected``) at the batch's mean length, with the
                                   step event's ``labelled`` count where the event has it
MFU = achieved FLOP/s per rank / peak, against two peaks: the bf16 8192^3 matmul rate measured
here (``mfu``) and the H200's 989 TFLOP/s dense bf16 spec (``mfu_spec``, on a GPU only); ``mfu``
over wall time, ``mfu_busy`` over the role's busy time. Prints one JSON line (last line of stdout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.config import RunConfig, load_config  # noqa: E402
from training.events import read_events  # noqa: E402
from training.model.flops import (  # noqa: E402
    H200_BF16_DENSE_PEAK,
    AnchorStats,
    DrafterShape,
    TargetShape,
    drafter_step_flops,
    forward_flops,
)
from training.model.tinymodel import target_text_config  # noqa: E402
from training.run.core import drafter_config  # noqa: E402


def peak_matmul_flops(device: str, size: int, iters: int) -> float:
    """Measured dense matmul FLOP/s (bf16 on CUDA, fp32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * iters / (time.perf_counter() - started)


@dataclass(frozen=True)
class FlopShapes:
    """What the FLOP counts of a run need: the target's shape, the layers its forward runs (up
    to the deepest chosen one) and the drafter's shape."""

    target: TargetShape
    layers_run: int
    drafter: DrafterShape


def flop_shapes(config: RunConfig) -> FlopShapes:
    """From the config (tiny/random) or the model folder's config.json."""
    m = config.model
    if m.kind == "pretrained":
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(Path(m.path).expanduser()), local_files_only=True)
    else:
        hf = target_text_config(m, m.vocab_size)
    ts = TargetShape.from_config(hf)
    chosen = drafter_config(config).resolved_target_layers(ts.layers)
    return FlopShapes(ts, max(chosen) + 1, DrafterShape.from_configs(hf, config.drafter, len(chosen)))


def target_flops(shapes: FlopShapes, event: dict[str, Any]) -> float:
    """Forward FLOPs of the target decoder on one step's batch (real tokens; causal attention)."""
    rows = max(int(event["sequences"]), 1)
    mean_len = event["tokens"] / rows
    return forward_flops(shapes.target, rows, mean_len, layers_run=shapes.layers_run)["total"]


def drafter_flops(config: RunConfig, shapes: FlopShapes, event: dict[str, Any]) -> float:
    """Forward + backward FLOPs of the drafter step of one ``step`` event: the context at the
    padded length (fc and K/V run on it), the anchors per row the trainer draws for it
    (num_anchors, at most T - 1: sample_anchors), their expected spans at the mean real length,
    the labelled positions as the event counts them."""
    rows, padded = max(int(event["sequences"]), 1), int(event["padded_length"])
    d = shapes.drafter
    per_row = max(1, min(config.drafter.num_anchors, padded - 1))
    stats = AnchorStats.expected(rows, event["tokens"] / rows, per_row, d.block_size, d.windows)
    if "labelled" in event:
        stats = replace(stats, labelled=float(event["labelled"]))
    return drafter_step_flops(d, padded, stats)["total"]


def run_plan(args: argparse.Namespace, env: dict[str, str], overrides: list[str]) -> dict[str, Any]:
    gpus = sum(int(x) for x in args.topology.split("+"))
    argv = [sys.executable, "-m", "training", "plan", "--config", args.config, "--gpus", str(gpus), "--json"]
    argv += ["--batches", str(args.plan_batches), "--warmup", str(args.plan_warmup), *overrides]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_job(args: argparse.Namespace, env: dict[str, str], overrides: list[str], run_dir: Path) -> float:
    nproc = sum(int(x) for x in args.topology.split("+"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv += ["-m", "training", "train", "--config", args.config, "--run-dir", str(run_dir)]
    argv += ["--topology", args.topology, f"--train.steps={args.steps}", "--train.log_every=1"]
    argv += [f"--pipeline.balance_window_s={args.window}", "--checkpoint.every=0", "--eval.num_prompts=0"]
    argv += [*overrides]
    started = time.monotonic()
    subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=sys.stderr, stderr=sys.stderr)
    return time.monotonic() - started


def last_new_shape_step(steps: list[dict[str, Any]]) -> int:
    """The step by which every padded shape (each a compile) has been trained once."""
    shapes = {e["padded_length"] for e in steps}
    seen: set[int] = set()
    for e in sorted(steps, key=lambda e: (e["step"], e["rank"])):
        seen.add(e["padded_length"])
        if seen == shapes:
            return int(e["step"])
    return 0


def steady_windows(events: list[dict[str, Any]], role: str, t0: float, t1: float) -> list[dict[str, Any]]:
    """The role's balance windows that lie inside the measured steps [t0, t1] (1 s slack): not
    the start-up, not the final checkpoint (a target waits through the drafters' save). Falls
    back to every window ending after t0 when the run is too short for a whole window."""
    mine = [e for e in events if e["event"] == "balance" and e["role"] == role]
    inside = [e for e in mine if e["ts"] - e["window_s"] >= t0 - 1.0 and e["ts"] <= t1 + 1.0]
    return inside or [e for e in mine if e["ts"] > t0]


def summarize(
    events: list[dict[str, Any]],
    config: RunConfig,
    topology: str,
    warmup: int,
    peak: float,
    compiled: bool = True,
    spec_peak: float | None = H200_BF16_DENSE_PEAK,
) -> dict[str, Any]:
    """Tokens/s, idle and MFU per role over the steady steps. ``peak``: the measured matmul
    FLOP/s; ``spec_peak``: the device's spec sheet figure (None: no spec MFU, e.g. on a CPU)."""
    n, m = (int(x) for x in topology.split("+"))
    counts = flop_shapes(config)
    steps = [e for e in events if e["event"] == "step" and e["role"] == "drafter"]
    # Steady state: after --warmup-steps AND, when compiled, after every padded shape (bucket)
    # has been trained once (each new shape compiles on the drafter).
    shapes = {e["padded_length"] for e in steps}
    if compiled:
        warmup = max(warmup, last_new_shape_step(steps))
    warm = [e for e in steps if e["step"] > warmup]
    if not warm:
        raise SystemExit("no step events after the warm-up: raise --steps or use --data.num_buckets=1")
    t0 = max(e["ts"] for e in steps if e["step"] == warmup) if warmup else min(e["ts"] for e in steps)
    t1 = max(e["ts"] for e in warm)
    seconds = max(t1 - t0, 1e-9)
    tokens = sum(e["tokens"] for e in warm)
    t_flops = sum(target_flops(counts, e) for e in warm)
    d_flops = sum(drafter_flops(config, counts, e) for e in warm)
    roles: dict[str, Any] = {}
    for role, ranks, flops in (("target", n, t_flops), ("drafter", m, d_flops)):
        windows = steady_windows(events, role, t0, t1)
        window_s = sum(e["window_s"] for e in windows)
        busy_s = sum(e["busy_s"] for e in windows)
        wait_s = sum(e["wait_s"] for e in windows)
        busy = busy_s / window_s if window_s else None  # windows of all ranks of the role
        mfu = flops / ranks / seconds / peak
        mfu_spec = flops / ranks / seconds / spec_peak if spec_peak else None
        window_tokens = sum(e["tokens_per_s"] * e["window_s"] for e in windows)
        roles[role] = {
            "ranks": ranks,
            # one rank's rate while it computes: the plan's per-rank rate (training.run.plan)
            "tokens_per_busy_s": window_tokens / busy_s if busy_s else None,
            "idle_fraction": wait_s / window_s if window_s else None,
            "busy_fraction": busy,
            "mfu": mfu,
            "mfu_busy": mfu / busy if busy else None,
            "mfu_spec": mfu_spec,
            "mfu_spec_busy": mfu_spec / busy if busy and mfu_spec is not None else None,
            "tflops_per_rank": flops / ranks / seconds / 1e12,
            "tflop_per_batch": flops / len(warm) / 1e12,
        }
    step_times: list[float] = []
    for rank in {e["rank"] for e in warm}:
        stamps = sorted(e["ts"] for e in warm if e["rank"] == rank)
        step_times += [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "warmup_steps_used": warmup,
        "shapes": len(shapes),
        "measured_tokens_per_s": tokens / seconds,
        "measured_steps": len(warm) // max(m, 1),
        "median_step_s": statistics.median(step_times) if step_times else None,
        "spec_peak_tflops": spec_peak / 1e12 if spec_peak else None,
        # what each checkpoint cost the pipeline (blocking_s) and the whole write (total_s)
        "checkpoints": [
            {"step": e["step"], "blocking_s": e.get("blocking_s"), "total_s": e.get("total_s", e["seconds"])}
            for e in events
            if e["event"] == "checkpoint"
        ],
        "roles": roles,
    }


def append_results(summary: dict[str, Any], argv: list[str]) -> None:
    """A block in benchmarks/RESULTS.md: date, machine, command, the numbers."""
    import datetime as dt
    import platform

    roles = summary["roles"]

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    lines = [
        f"## topology {summary['topology']} ({summary['config']}) — "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M')} UTC",
        "",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, device {summary['device']}; "
        f"load average {os.getloadavg()[0]:.1f}",
        f"- command: `python benchmarks/topology_bench.py {' '.join(argv)}`",
        f"- measured {summary['measured_tokens_per_s']:,.0f} tok/s over {summary['measured_steps']} steps "
        f"(after {summary['warmup_steps_used']} warm-up steps, {summary['shapes']} shapes); "
        f"plan predicted {summary['predicted_tokens_per_s']:,.0f} tok/s "
        f"(error {pct(summary['prediction_error'])}; plan's best split {summary['plan_best']})",
        f"- peak: bf16 8192^3 matmul measured here {summary['peak_matmul_tflops']:.2f} TFLOP/s; "
        f"spec {summary['spec_peak_tflops'] or 0:.0f} TFLOP/s (H200 dense bf16; n/a on a CPU); "
        "FLOPs: training/model/flops.py",
    ]
    for c in summary["checkpoints"]:
        blocking = "n/a" if c["blocking_s"] is None else f"{c['blocking_s']:.2f} s"
        written = f"{c['total_s']:.2f} s"
        lines.append(f"- checkpoint step {c['step']}: training blocked {blocking}, written in {written}")
    for role, r in roles.items():
        lines.append(
            f"- {role} x{r['ranks']}: MFU {pct(r['mfu'])} of the measured peak (while busy "
            f"{pct(r['mfu_busy'])}), {pct(r['mfu_spec'])} of the spec "
            f"(while busy {pct(r['mfu_spec_busy'])}), idle {pct(r['idle_fraction'])}, "
            f"{r['tflops_per_rank']:.3f} TFLOP/s per rank, {r['tflop_per_batch']:.2f} TFLOP per batch"
        )
    path = REPO / "benchmarks" / "RESULTS.md"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n" + "\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-8b-h200")
    parser.add_argument("--topology", default="1+1")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out (compile, caches)")
    parser.add_argument("--window", type=float, default=5.0, help="balance window seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--plan-batches", type=int, default=4)
    parser.add_argument("--plan-warmup", type=int, default=3)
    parser.add_argument(
        "--matmul-size", type=int, default=0, help="peak probe size (default 8192 GPU, 1024 CPU)"
    )
    parser.add_argument("--run-dir", default="", help="keep the job's run dir here (default: a temp dir)")
    parser.add_argument("--append-results", action="store_true", help="add a block to benchmarks/RESULTS.md")
    parser.add_argument(
        "--summarize",
        default="",
        metavar="RUN_DIR",
        help="only re-read RUN_DIR/events.jsonl of an earlier job (needs --peak-tflops); print the roles",
    )
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="with --summarize: the measured peak")
    parser.add_argument(
        "--spec-tflops",
        type=float,
        default=H200_BF16_DENSE_PEAK / 1e12,
        help="the device's spec peak for mfu_spec (default: H200 dense bf16, 989; 0 = none)",
    )
    args, overrides = parser.parse_known_args()
    overrides = list(overrides)
    if args.summarize:
        config = load_config(args.config, overrides)
        events = read_events(Path(args.summarize) / "events.jsonl")
        result = summarize(
            events,
            config,
            args.topology,
            args.warmup_steps,
            args.peak_tflops * 1e12,
            spec_peak=args.spec_tflops * 1e12 or None,
        )
        print(json.dumps(result), flush=True)
        return 0
    if args.device == "cpu":
        overrides.append("--model.device=cpu")
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    config = load_config(args.config, overrides)
    size = args.matmul_size or (8192 if args.device == "cuda" else 1024)
    peak = peak_matmul_flops(args.device, size, 50 if args.device == "cuda" else 5)
    plan = run_plan(args, env, overrides)
    n, m = (int(x) for x in args.topology.split("+"))
    rates = plan["rates"]
    predicted = min(n * rates["target_tokens_per_s"], m * rates["drafter_tokens_per_s"])
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="topology-bench-"))
    wall = run_job(args, env, overrides, run_dir)
    mode = config.compile.enabled
    compiled = mode == "on" or (mode == "auto" and args.device == "cuda")
    events = read_events(run_dir / "events.jsonl")
    spec = args.spec_tflops * 1e12 if args.device == "cuda" else 0.0
    result = summarize(events, config, args.topology, args.warmup_steps, peak, compiled, spec or None)
    measured = result["measured_tokens_per_s"]
    summary = {
        "bench": "topology",
        "config": args.config,
        "topology": args.topology,
        "device": plan["rates"]["device"],
        "peak_matmul_tflops": peak / 1e12,
        "plan_rates": rates,
        "plan_best": f"{plan['best']['targets']}+{plan['best']['drafters']}",
        "predicted_tokens_per_s": predicted,
        "prediction_error": (predicted - measured) / measured if measured else None,
        "job_wall_s": wall,
        "run_dir": str(run_dir),
        **result,
    }
    if args.append_results:
        append_results(summary, sys.argv[1:])
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
