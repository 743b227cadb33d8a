"""What verified checkpoints cost: the manifest's read-back sha256 at write time and the check
before a resume, against the plain write (torch.save + fsync + rename) they replaced.

    python benchmarks/ckpt_verify_bench.py --mib 1024 [--dir DIR]

A stand-in state of ``--mib`` MiB of fp32 CPU tensors (64 MiB each, as a drafter's weights and
AdamW moments). Prints one JSON line: seconds for the plain write, the verified write
(``training.run.checkpoint._write_file``: the same + the read-back sha256 + the manifest), the
check (``verify_checkpoint``: sha256 against the manifest) and the check of a checkpoint without a
manifest (zip CRCs + a memory-mapped load), each the median of ``--repeat`` runs, and the sha256
throughput. The page cache is warm (the file was just written): a cold read from disk is slower.
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
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    args = parser.parse_args()

    import torch

    from training.run import checkpoint as ck

    chunk = 16 * 2**20  # fp32 elements in 64 MiB
    state = {f"t{i}": torch.randn(chunk) for i in range(max(1, args.mib // 64))}
    times: dict[str, list[float]] = {
        "plain_write_s": [],
        "verified_write_s": [],
        "verify_s": [],
        "legacy_check_s": [],
    }
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        run = Path(tmp)
        for _ in range(args.repeat):
            plain = run / "plain.pt"
            t0 = time.perf_counter()
            with open(run / ".plain.tmp", "wb") as handle:
                torch.save({**state, "step": 1}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(run / ".plain.tmp", plain)
            times["plain_write_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            path = ck._write_file(run, 1, {**state, "step": 1})
            times["verified_write_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert ck.verify_checkpoint(path, 1) == ""
            times["verify_s"].append(time.perf_counter() - t0)
            ck.manifest_path(path).unlink()
            t0 = time.perf_counter()
            assert ck.verify_checkpoint(path, 1) == ""
            times["legacy_check_s"].append(time.perf_counter() - t0)
        size = path.stat().st_size
    result = {k: round(statistics.median(v), 3) for k, v in times.items()}
    result["bytes"] = size
    result["sha256_gb_per_s"] = round(size / result["verify_s"] / 1e9, 2)
    result["torch"] = torch.__version__
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
