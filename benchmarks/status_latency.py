"""Latency of `fab status` against the real test host (SSH -> pct shim -> LXC), and of
FLEET_TARGET=all with several targets. Appends a section to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/status_latency.py [--repeat 10] [--targets 4]

Needs tests/hosts/setup to have run. Starts a long selftest run in a fresh workdir in the
container (so status has a live run with events and a log to read), measures, then stops
the run and removes the workdir. Reports median / min / max wall seconds of:
- `fab status --json` as a subprocess (what a user or a script sees, Python start-up included);
- `fleet.status.fetch.fetch_status` in process on one open connection (the one round trip + parse);
- `FLEET_TARGET=all fab status --json` with N targets (polled in parallel).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from testkit import _host_problem, ct200_target, render_inventory, run_fab  # noqa: E402

from fleet.inventory import load_inventory, select_targets  # noqa: E402
from fleet.status.fetch import fetch_status  # noqa: E402
from fleet.target import open_target  # noqa: E402


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> str:
    med, lo, hi = statistics.median(samples), min(samples), max(samples)
    return f"median {med:.3f} s (min {lo:.3f}, max {hi:.3f}, n={len(samples)})"


def fab_ok(
    args: list[str], config: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = run_fab(args, config, env=env, timeout=120)
    if result.returncode not in (0, 5) and not (args[0] == "status" and result.returncode in (10, 11, 12)):
        raise SystemExit(f"fab {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--tmp", default="/tmp", help="where the temporary fleet.toml goes")
    args = parser.parse_args()
    hosts = _host_problem()
    if isinstance(hosts, str):
        print(hosts, file=sys.stderr)
        return 1
    workdir = f"/workspace/fleet-bench-{uuid.uuid4().hex[:10]}"
    target = ct200_target(hosts, workdir)
    target["run"] = {
        "module": "training.selftest",
        "config": "selftest",
        "overrides": ["--selftest.steps=100000", "--selftest.step_seconds=0.2"],
        "env": {},
    }
    config = Path(args.tmp) / f"fleet-bench-{uuid.uuid4().hex[:6]}.toml"
    config.write_text(render_inventory({"ct200": target}, "ct200"))
    all_config = config.with_suffix(".all.toml")
    names = {f"t{i}": target for i in range(args.targets)}
    all_config.write_text(render_inventory(names, "t0"))
    try:
        fab_ok(["deploy"], config)
        fab_ok(["train"], config)
        deadline = time.monotonic() + 60
        while True:
            res = fab_ok(["status", "--json"], config)
            if not res.stdout.strip():
                raise SystemExit(f"fab status gave no JSON ({res.returncode}): {res.stderr.strip()}")
            data = json.loads(res.stdout)
            if data["state"] == "training" and data["step"]:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"run did not reach training: {data}")
            time.sleep(0.5)
        fab = timed(lambda: fab_ok(["status", "--json"], config), args.repeat)
        (spec,) = select_targets(load_inventory(config), "ct200", allow_all=False)
        with open_target(spec) as tgt:
            fetch_status(tgt)  # connect once
            inproc = timed(lambda: fetch_status(tgt), args.repeat)
            baseline = timed(lambda: tgt.run(["true"]), args.repeat)

        def fresh() -> None:
            with open_target(spec) as tgt:
                fetch_status(tgt)

        connect = timed(fresh, args.repeat)
        env = {"FLEET_TARGET": "all"}
        many = timed(lambda: fab_ok(["status", "--json"], all_config, env), max(3, args.repeat // 2))
    finally:
        run_fab(["stop", "--force"], config, timeout=60)
        hosts.pct_exec("rm", "-rf", "--", workdir, check=False)
        config.unlink(missing_ok=True)
        all_config.unlink(missing_ok=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    lines = [
        "",
        f"## fab status latency — {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"commit {commit.stdout.strip() or 'uncommitted'}. Target: the test host "
        "(sshd on 127.0.0.1 -> pct shim -> LXC container), a live selftest run. "
        "Command: `.venv/bin/python benchmarks/status_latency.py "
        f"--repeat {args.repeat} --targets {args.targets}`",
        "",
        f"- `fab status --json` (subprocess, Python start-up included): {summary(fab)}",
        f"- one status fetch + parse in process, connection reused: {summary(inproc)}",
        f"- baseline, `true` through the same connection (SSH + pct shim alone): {summary(baseline)}",
        f"- one status fetch + parse in process, new SSH connection each: {summary(connect)}",
        f"- `FLEET_TARGET=all fab status --json`, {args.targets} targets in parallel: {summary(many)}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with (REPO / "benchmarks" / "RESULTS.md").open("a") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
