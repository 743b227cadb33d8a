"""Fleet's own overhead: `fab deploy train` until the run's process is up, and `fab status` latency.

    .venv/bin/python benchmarks/fleet_overhead.py [--repeat 3] [--status-repeat 5] [--test-host] [--no-append]

Target: the one FLEET_CONFIG / FLEET_TARGET select (default: ./fleet.toml's default target), or,
with --test-host, container 200 of the real SSH + LXC test host (tests/hosts/setup) running the
stdlib selftest workload in a throw-away workdir.

What is measured (wall clock, one machine: the test host is 127.0.0.1, the container shares its clock):

- deploy+train overhead: from just before `fab deploy train` is started until the run's wrapper
  (remote/run.sh) writes `<run-dir>/launched_at` — i.e. everything fleet does (Python + Fabric start,
  inventory, SSH, deploy's 3 commands, the GPU gate, the launch) and nothing of the run's own start-up.
- `fab status`: the whole command, as the user runs it, with the run live.
- `runs.basic_status` in-process: the one round trip alone (no interpreter/Fabric start-up).
- `fab --list`: the floor any `fab` command pays (interpreter + imports).

Each run is stopped (`fab stop`) before the next. Results are printed and appended to
benchmarks/RESULTS.md (date, machine, commit, command). Goals: <= 5 s and <= 1 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet import runs  # noqa: E402
from fleet.inventory import load_inventory, select_targets  # noqa: E402
from fleet.target import Target, open_target  # noqa: E402

FAB = REPO / ".venv" / "bin" / "fab"
RESULTS = REPO / "benchmarks" / "RESULTS.md"
HOSTS_ENV = REPO / "tests" / "hosts" / ".state" / "hosts.env"


def fab(args: Sequence[str], env: Mapping[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.time()
    result = subprocess.run([str(FAB), *args], cwd=REPO, env=dict(env), capture_output=True, text=True)
    return time.time() - start, result


def host_facts() -> dict[str, str]:
    facts = {}
    for line in HOSTS_ENV.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            words = shlex.split(value)
            facts[key] = words[0] if words else ""
    return facts


def test_host_inventory(directory: Path, label: str) -> Path:
    """A fleet.toml with target `ct200` on the test host (selftest workload, fresh workdir).

    Its `commands.tmux` is a wrapper with a private socket (`tmux -L <label>`), as the tests use:
    container 200 is shared, and one tmux session `fleet-run` per server means one run per server.
    """
    facts = host_facts()
    workdir = f"/workspace/{label}"
    wrapper = Path(facts["FLEET_TEST_CT_ROOTFS"]) / "tmp" / f"{label}-tmux"
    wrapper.write_text(f'#!/bin/sh\nexec tmux -L {label} "$@"\n')
    wrapper.chmod(0o755)
    text = f"""default_target = "ct200"

[targets.ct200]
host = "{facts["FLEET_TEST_SSH_USER"]}@{facts["FLEET_TEST_SSH_HOST"]}:{facts["FLEET_TEST_SSH_PORT"]}"
identity_file = "{facts["FLEET_TEST_IDENTITY"]}"
known_hosts = "{facts["FLEET_TEST_KNOWN_HOSTS"]}"
container = {{ type = "pct", id = {facts["FLEET_TEST_CT_ID"]} }}
workdir = "{workdir}"
gpus = 0
env = ""

[targets.ct200.run]
module = "training.selftest"
config = "selftest"
overrides = ["--selftest.steps=100000", "--selftest.step_seconds=0.5"]

[targets.ct200.commands]
pct = "{facts["FLEET_TEST_PCT"]}"
python = "python3"
tmux = "/tmp/{label}-tmux"
"""
    path = directory / "fleet.toml"
    path.write_text(text)
    return path


@dataclass
class Samples:
    deploy_train: list[float] = field(default_factory=list)
    command_wall: list[float] = field(default_factory=list)
    status_fab: list[float] = field(default_factory=list)
    status_api: list[float] = field(default_factory=list)


def measure(target: Target, env: Mapping[str, str], args: argparse.Namespace, samples: Samples) -> str:
    """``args.repeat`` rounds of deploy+train / status / stop; returns a problem line or ""."""
    spec = target.spec
    for i in range(args.repeat):
        # One tmux server holds one `fleet-run`: wait (bounded) while another run holds it.
        for _ in range(args.wait_free * 2):
            if runs.basic_status(target, 0).state != "live":
                break
            time.sleep(0.5)
        else:
            return "a run is live on the target; stop it first (`fab stop`)"
        start = time.time()
        wall, result = fab(["deploy", "train"], env)
        if result.returncode != 0:
            return f"`fab deploy train` failed:\n{result.stdout}{result.stderr}"
        status = runs.basic_status(target, 0)
        marker = f"{spec.layout.run_dir(status.run_id or '?')}/launched_at"
        for _ in range(100):  # the pane may take a moment to write it
            read = target.run(["cat", "--", marker], check=False)
            if read.exit_code == 0 and read.stdout.strip():
                break
            time.sleep(0.05)
        else:
            return f"the run never wrote {marker}"
        launched = float(read.stdout.strip())
        samples.deploy_train.append(launched - start)
        samples.command_wall.append(wall)
        for _ in range(args.status_repeat):
            seconds, _result = fab(["status"], env)
            samples.status_fab.append(seconds)
            t0 = time.perf_counter()
            runs.basic_status(target)
            samples.status_api.append(time.perf_counter() - t0)
        fab(["stop"], env)
        print(f"round {i + 1}: deploy+train overhead {launched - start:.3f} s (command {wall:.3f} s)")
    return ""


def summary(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):.3f} s, min {min(values):.3f} s, "
        f"max {max(values):.3f} s (n={len(values)})"
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = f"load average {os.getloadavg()[0]:.1f}"
    return f"{platform.node()}, {os.cpu_count()} CPUs ({cpu}), {load}, Python {platform.python_version()}"


def commit() -> str:
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    sha = head.stdout.strip() if head.returncode == 0 else "no commit yet"
    return f"{sha}{' (dirty)' if status.stdout.strip() else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="deploy+train rounds")
    parser.add_argument("--status-repeat", type=int, default=5, help="`fab status` calls per round")
    parser.add_argument("--test-host", action="store_true", help="use container 200 of tests/hosts")
    parser.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument("--wait-free", type=int, default=120, help="seconds to wait for a busy target")
    args = parser.parse_args()

    env = dict(os.environ)
    label = f"fleet-bench-{os.getpid()}"
    tmp = tempfile.TemporaryDirectory(prefix="fleet-bench-")
    if args.test_host:
        if not HOSTS_ENV.exists():
            print(f"no test host: {HOSTS_ENV} missing; run tests/hosts/setup", file=sys.stderr)
            return 2
        env["FLEET_CONFIG"] = str(test_host_inventory(Path(tmp.name), label))
        env.pop("FLEET_TARGET", None)
    inventory = load_inventory(Path(env["FLEET_CONFIG"]) if env.get("FLEET_CONFIG") else None)
    (spec,) = select_targets(inventory, env.get("FLEET_TARGET"), allow_all=False)
    print(f"target {spec.name} ({spec.display}), workdir {spec.workdir}")

    floor, _ = fab(["--list"], env)
    samples = Samples()
    with open_target(spec) as target:
        try:
            problem = measure(target, env, args, samples)
        finally:
            if args.test_host:
                target.run(["tmux", "-L", label, "kill-server"], check=False)
                target.run(["rm", "-rf", "--", spec.workdir, f"/tmp/{label}-tmux"], check=False)
            tmp.cleanup()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    deploy_train, command_wall = samples.deploy_train, samples.command_wall
    status_fab, status_api = samples.status_fab, samples.status_api

    lines = [
        f"- `fab deploy train` overhead (start -> run.sh up): {summary(deploy_train)}",
        f"- `fab deploy train` command wall time: {summary(command_wall)}",
        f"- `fab status` (run live): {summary(status_fab)}",
        f"- `runs.basic_status` in-process (one round trip): {summary(status_api)}",
        f"- `fab --list` (interpreter + imports floor): {floor:.3f} s",
    ]
    print("\n".join(lines))
    if not args.no_append:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        prefix = "".join(f"{k}={env[k]} " for k in ("FLEET_CONFIG", "FLEET_TARGET") if k in os.environ)
        command = prefix + "python benchmarks/fleet_overhead.py " + " ".join(sys.argv[1:])
        block = [
            "",
            f"## fleet overhead — {now}",
            "",
            f"- target: `{spec.name}` ({spec.display}); machine: {machine()}; commit: {commit()}",
            f"- command: `{command.strip()}`",
            *lines,
            "",
        ]
        with RESULTS.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(block))
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
