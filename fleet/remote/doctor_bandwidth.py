"""`fab doctor --bandwidth`: how fast one target rank can hand hidden states to one drafter rank.

Runs in the target's env (``python -I -c <this file> ARGS``, the run's environment on stdin:
nothing is deployed, nothing written). Two processes, forked before either touches CUDA, set up
the way the trainer's ranks are: each sees only its own GPU (``CUDA_VISIBLE_DEVICES``) as
``cuda:0`` and joins a 2-rank ``torch.distributed`` group (NCCL on GPUs, gloo between two CPU
processes). Rank 0 sends a tensor of ``--bytes`` (one batch of hidden states: token budget x
target layers x hidden x dtype) to rank 1, ``--warmup`` times untimed then ``--iterations``
times timed; each timed transfer starts together on both ranks (a one-element all_reduce) and
ends when rank 1's stream is done.
Prints one JSON line: backend, devices, bytes, iterations, seconds, gb_per_s (bytes / median
seconds), torch and NCCL versions; or ``{"error": ...}`` and exit 1.

    python -I -c "$(cat doctor_bandwidth.py)" --bytes 671088640 --gpus 0,1   # NCCL: GPU 0 -> GPU 1
    python -I -c "$(cat doctor_bandwidth.py)" --bytes 1572864 --cpu          # gloo, two CPU processes
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_main(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    try:
        results.put(measure(rank, args, port))
    except BaseException as exc:  # the parent reports it as one line
        message = " ".join(str(exc).split()) or traceback.format_exc().strip().splitlines()[-1]
        results.put({"error": f"rank {rank}: {type(exc).__name__}: {message}"})


def measure(rank: int, args: argparse.Namespace, port: int) -> dict[str, Any] | None:
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else []
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus[rank])  # as the trainer's ranks: own GPU = cuda:0
    import torch
    import torch.distributed as dist

    if gpus:
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no GPU (CUDA_VISIBLE_DEVICES={gpus[rank]})")
        torch.cuda.set_device(0)
        device, backend, dtype = torch.device("cuda", 0), "nccl", torch.bfloat16
    else:
        torch.set_num_threads(1)
        device, backend, dtype = torch.device("cpu"), "gloo", torch.float32
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = max(1, args.bytes // itemsize)
        payload = torch.ones(numel, dtype=dtype, device=device) * (rank + 1)
        start = torch.zeros(1, device=device)
        seconds = []
        for step in range(args.warmup + args.iterations):
            dist.all_reduce(start)  # both ranks begin the transfer together
            if gpus:
                torch.cuda.synchronize()
            began = time.perf_counter()
            if rank == 0:
                dist.send(payload, dst=1)
            else:
                dist.recv(payload, src=0)
            if gpus:
                torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - began)
        if rank == 0:
            return None
        if float(payload[0]) != 1.0:
            raise RuntimeError("the received tensor does not hold what rank 0 sent")
        median = statistics.median(seconds)
        devices = (
            [f"GPU{g} ({torch.cuda.get_device_name(0)})" for g in gpus]
            if gpus
            else ["cpu rank 0", "cpu rank 1"]
        )
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else ""
        return {
            "backend": backend,
            "devices": devices,
            "bytes": numel * itemsize,
            "iterations": args.iterations,
            "seconds": [round(s, 6) for s in seconds],
            "gb_per_s": numel * itemsize / median / 1e9,
            "torch": torch.__version__,
            "nccl": nccl,
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="doctor_bandwidth", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bytes", type=int, required=True, help="bytes per transfer (one batch of hidden states)"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", default="", help="T,D: the sending (target) and receiving (drafter) GPU")
    where.add_argument("--cpu", action="store_true", help="two CPU processes over gloo")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    if args.gpus and len(args.gpus.split(",")) != 2:
        parser.error("--gpus takes two GPU indices: T,D")
    ctx = mp.get_context("fork")  # this file arrives as `-c`: there is no module to re-import
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, args, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout + 30
    answers: list[dict[str, Any]] = []
    while len(answers) < 2 and time.monotonic() < deadline:
        if any("error" in a for a in answers):
            break  # the other rank may wait for it forever
        try:
            answers.append(results.get(timeout=1.0) or {})
        except Exception:  # queue.Empty: keep waiting while a rank lives
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    errors = [a["error"] for a in answers if "error" in a]
    result = next((a for a in answers if "gb_per_s" in a), None)
    if errors or result is None:
        why = errors[0] if errors else f"no answer within {args.timeout:g}s (a rank hung: NCCL/gloo setup?)"
        print(json.dumps({"error": why}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
