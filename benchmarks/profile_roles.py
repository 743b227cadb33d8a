"""Where each role's time goes: torch.profiler's top kernels of the target forward and of the drafter step.

    # on one H200 (the 1+1 shape: qwen3-8b-h200, one 4 x 4096 bucket); warm compile cache: ~2 min
    FLEET_COMPILE_CACHE=/tmp/cb/cold python benchmarks/profile_roles.py --config qwen3-8b-h200 \\
        --out /tmp/profile --data.num_buckets=1 --data.corpus_files=300
    # the script itself on a CPU (tiny model; CPU ops instead of kernels)
    python benchmarks/profile_roles.py --config tiny-cpu --device cpu --out /tmp/profile-cpu

Builds the run's target and drafter on one device as the split probe does (``training.run.plan``:
``Trainer.setup``), runs ``--warmup`` batches (every compile happens there), then profiles
``--steps`` batches of each role on its own: the target forward (``target_forward``: the hidden
states a target rank sends) and the drafter step (``drafter_step``: forward, backward, clipping,
AdamW). What a role's rank does besides (the NCCL transfer of the hidden states, waiting for the
other role) is not in these profiles. Per role: the top ``--top`` kernels by GPU time (on a CPU:
operators by self CPU time) with calls, total ms, share of the role's time and mean µs, and the
share of the role's GPU time in matmul kernels (cuBLAS/CUTLASS GEMMs) and in attention
(flex/flash/SDPA kernels). Writes ``<out>/profile.md`` (the tables) and ``<out>/profile.json``,
and prints the JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MATMUL = ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "nvjet", "matmul", "addmm", "::mm", "bmm")
ATTENTION = ("flex", "flash", "attention", "sdpa", "triton_tem_fused")


def kind(name: str) -> str:
    """A kernel's kind, by its name: matmul, attention or other."""
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    return "other"


def top_kernels(prof: Any, device: str, top: int) -> dict[str, Any]:
    """The profile's kernels (GPU) or operators (CPU, self time) aggregated by name, largest first."""
    rows: dict[str, list[float]] = {}
    if device == "cuda":
        from torch.autograd import DeviceType

        for evt in prof.events():
            if evt.device_type == DeviceType.CUDA:
                entry = rows.setdefault(evt.name, [0, 0.0])
                entry[0] += 1
                entry[1] += evt.time_range.elapsed_us()
    else:
        for avg in prof.key_averages():
            if avg.self_cpu_time_total > 0:
                rows[avg.key] = [avg.count, float(avg.self_cpu_time_total)]
    total = sum(us for _, us in rows.values()) or 1.0
    by_kind: dict[str, float] = {}
    for name, (_, us) in rows.items():
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us / total
    ranked = sorted(rows.items(), key=lambda item: -item[1][1])[:top]
    return {
        "total_ms": total / 1e3,
        "share_by_kind": by_kind,
        "top": [
            {
                "name": name,
                "kind": kind(name),
                "calls": int(calls),
                "ms": us / 1e3,
                "share": us / total,
                "mean_us": us / max(calls, 1),
            }
            for name, (calls, us) in ranked
        ],
    }


def profile(fn: Callable[[], None], steps: int, device: str) -> Any:
    """``fn`` run ``steps`` times under torch.profiler (CUDA activity on a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def markdown(summary: dict[str, Any]) -> str:
    """The tables of ``profile.md``."""
    unit = "kernels (GPU time)" if summary["device"].startswith("cuda") else "operators (self CPU time)"
    lines = [
        f"# Top {unit} per role — {summary['config']}, {summary['device']}",
        "",
        f"Command: `python benchmarks/profile_roles.py {' '.join(summary['argv'])}`; "
        f"{summary['steps']} batches profiled per role after {summary['warmup']} warm-up batches; "
        f"{summary['date']} UTC.",
    ]
    for role, r in summary["roles"].items():
        kinds = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(r["share_by_kind"].items()))
        lines += [
            "",
            f"## {role}: {r['total_ms'] / summary['steps']:.1f} ms a batch ({kinds}); "
            f"wall {r['wall_ms_per_batch']:.1f} ms a batch",
            "",
            "| # | kernel | kind | calls | ms | share | mean µs |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for i, k in enumerate(r["top"], 1):
            name = k["name"].replace("|", "\\|")
            name = name if len(name) <= 100 else name[:97] + "..."
            lines.append(
                f"| {i} | `{name}` | {k['kind']} | {k['calls']} | {k['ms']:.2f} | "
                f"{100 * k['share']:.1f}% | {k['mean_us']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-8b-h200")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=3, help="batches before profiling (compiles)")
    parser.add_argument("--steps", type=int, default=3, help="batches profiled per role")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--out", default="", help="folder for profile.md / profile.json (default: a temp dir)"
    )
    args, overrides = parser.parse_known_args()
    overrides = list(overrides)
    if args.device == "cpu":
        overrides.append("--model.device=cpu")

    import datetime as dt

    import torch

    from training.config import load_config
    from training.model.target import target_forward
    from training.run.core import batch_anchors
    from training.run.single import Trainer

    config = load_config(args.config, overrides)
    scratch = Path(tempfile.mkdtemp(prefix="fleet-profile-"))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="profile-roles-"))
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config, scratch)
    try:
        trainer.setup(quiet_data=True)
        device = trainer.device

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def prepared() -> tuple[Any, ...]:
            batch = trainer.next_batch()
            ids, mask = batch.input_ids.to(device), batch.loss_mask.to(device)
            anchors = batch_anchors(config, mask, batch.lengths, batch.position)
            return ids, mask, anchors

        for _ in range(args.warmup):  # compiles happen here, not in the profiles
            ids, mask, anchors = prepared()
            hidden = target_forward(trainer.target, ids, trainer.layer_ids)
            trainer.drafter_step(ids, mask, hidden, anchors)
        sync()
        ids, mask, anchors = prepared()
        hidden = target_forward(trainer.target, ids, trainer.layer_ids)
        sync()
        roles: dict[str, Any] = {}
        work = {
            "target forward": lambda: target_forward(trainer.target, ids, trainer.layer_ids),
            "drafter step": lambda: trainer.drafter_step(ids, mask, hidden, anchors),
        }
        for role, fn in work.items():
            started = time.perf_counter()
            prof = profile(fn, args.steps, args.device)
            wall = time.perf_counter() - started
            roles[role] = {
                **top_kernels(prof, args.device, args.top),
                "wall_ms_per_batch": 1e3 * wall / args.steps,
            }
        summary = {
            "bench": "profile_roles",
            "config": args.config,
            "device": str(device)
            + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
            "batch": list(ids.shape),
            "anchors_per_row": int(anchors.shape[1]),
            "warmup": args.warmup,
            "steps": args.steps,
            "argv": sys.argv[1:],
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
            "roles": roles,
        }
    finally:
        trainer.close()
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "profile.md").write_text(markdown(summary), encoding="utf-8")
    (out / "profile.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(f"profile tables: {out / 'profile.md'}", file=sys.stderr)
    brief = {
        "bench": "profile_roles",
        "out": str(out),
        "batch": summary["batch"],
        "roles": {
            r: {"ms_per_batch": v["total_ms"] / args.steps, "share_by_kind": v["share_by_kind"]}
            for r, v in roles.items()
        },
    }
    print(json.dumps(brief), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
