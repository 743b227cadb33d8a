"""What pinning a checkpoint's host buffers costs the training thread, on one GPU.

    python benchmarks/pin_bench.py --gib 8                      # default pinned allocator
    python benchmarks/pin_bench.py --gib 8 --trainer-settings   # the trainer's (training.__main__):
                                                                # malloc + cudaHostRegister, 8 threads

A stand-in state of ``--gib`` GiB of fp32 GPU tensors (256 MiB each, as a drafter's weights and
AdamW moments) and a stand-in training thread (a 4096^3 bf16 matmul, synchronised, in a loop).
Prints, as one JSON line: the loop's median iteration alone; the first ``CheckpointWriter.save``
(buffers pinned inside it) and a second one (buffers reused), in seconds blocked; and
``reserve`` run in the background while the loop runs: how long the reservation took and the
loop's slowest iteration and total delay meanwhile (what the background pinning costs training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument(
        "--trainer-settings", action="store_true", help="the allocator settings the trainer uses"
    )
    args = parser.parse_args()
    if args.trainer_settings:
        from training.__main__ import allocator_settings

        allocator_settings()

    import torch

    from training.run.checkpoint import CheckpointWriter

    device = torch.device("cuda")
    state = {f"p{i}": torch.randn(64, 1024, 1024, device=device) for i in range(4 * args.gib)}
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def iteration() -> float:
        started = time.perf_counter()
        (a @ a).sum().item()
        return time.perf_counter() - started

    for _ in range(5):
        iteration()
    alone = [iteration() for _ in range(50)]

    with tempfile.TemporaryDirectory() as tmp:
        writer = CheckpointWriter(Path(tmp) / "a", keep=1)
        first = writer.save(1, state)
        writer.wait()
        second = writer.save(2, state)
        writer.wait()

        reserving = CheckpointWriter(Path(tmp) / "b", keep=1)
        started = time.perf_counter()
        reserving.reserve(state)
        during: list[float] = []
        while reserving.busy:
            during.append(iteration())
        reserve_s = time.perf_counter() - started
        after_reserve = reserving.save(1, state)
        reserving.wait()

    base = statistics.median(alone)
    print(
        json.dumps(
            {
                "bench": "pin_bench",
                "gib": args.gib,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "iteration_ms": 1e3 * base,
                "first_save_blocking_s": first,
                "second_save_blocking_s": second,
                "reserve_s": reserve_s,
                "save_after_reserve_blocking_s": after_reserve,
                "iterations_during_reserve": len(during),
                "slowest_iteration_during_reserve_s": max(during, default=0.0),
                "training_delay_during_reserve_s": sum(during) - base * len(during),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
