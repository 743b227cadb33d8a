"""The status fetch's cost on the target: fleet/remote/status_fetch.sh of a base revision against
the working tree's, on a run dir whose events.jsonl and train.log are larger than the 256 KiB the
fetch reads of each, and whether the tails arrive byte for byte through the one framing.

    .venv/bin/python benchmarks/wire_bench.py [--base main] [--repeat 60] [--shell dash]

Both scripts run alternately (so load on a shared machine falls on both alike); the median and the
minimum wall time per call are printed. The base must be a revision whose status_fetch.sh takes
the random-boundary arguments (WORKDIR TMUX SESSION BYTES BOUNDARY NVSMI FIELDS LOGBYTES).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fleet.status.fetch import TAIL_BYTES, fetch_argv, parse_fetch

REPO = Path(__file__).resolve().parents[1]


def make_run(root: Path) -> Path:
    run = root / "runs" / "20261201T000000Z-bench"
    run.mkdir(parents=True)
    (root / "runs" / "latest").symlink_to(run.name)
    with (run / "events.jsonl").open("w") as fh:
        for i in range(6000):
            fh.write(json.dumps({"event": "step", "step": i, "loss": 1.0 / (i + 1)}) + "\n")
    with (run / "train.log").open("w") as fh:
        for i in range(8000):
            fh.write(f"step {i}/8000 loss=1.234 acc1=0.5 tokens/s=12345\n")
        fh.write("@@fleet end 0 0\n@@B end\n")  # lines a framing must not read as headers
    return run


def timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    return (time.perf_counter() - start) * 1000, out.decode("utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--shell", default="dash")
    args = ap.parse_args()
    show = ["git", "-C", str(REPO), "show", f"{args.base}:fleet/remote/status_fetch.sh"]
    base_text = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = make_run(root)
        tail = str(TAIL_BYTES)
        base = [args.shell, "-c", base_text, "fleet-status-fetch", tmp, "/nonexistent/tmux", "fleet-run"]
        base += [tail, "@@B", "", "index", tail]
        here = [args.shell, *fetch_argv(tmp, "/nonexistent/tmux", "")[1:]]
        times: dict[str, list[float]] = {"base": [], "tree": []}
        out = ""
        for _ in range(args.repeat):
            times["base"].append(timed(base)[0])
            ms, out = timed(here)
            times["tree"].append(ms)
        got = parse_fetch(out)
        exact = all(
            text == (run / name).read_bytes()[-TAIL_BYTES:].decode().rstrip("\n")
            for name, text in (("events.jsonl", got.events_text), ("train.log", got.log_text))
        )
    for name, xs in times.items():
        print(f"{name}: median {statistics.median(xs):.1f} ms, min {min(xs):.1f} ms ({args.repeat} calls)")
    print(f"tails byte for byte through the framing: {exact}")


if __name__ == "__main__":
    main()
