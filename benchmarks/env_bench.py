"""Pinned envs: `env-check` time on a synced env, and a rebuild of the torch env with a warm uv cache.

    .venv/bin/python benchmarks/env_bench.py [--env local-cpu] [--repeat 5] [--test-host] [--no-append]

Target: with --test-host, container 200 of the real SSH + LXC test host (tests/hosts/setup) in a
throw-away workdir; else this machine (a local target in a temporary workdir). The env is
`envs/<--env>` of this repo; `local-cpu` is torch 2.13.0 (PyPI's CUDA build on x86_64),
transformers, datasets, ...; the container downloads it from PyPI itself.

Measured (wall clock):
- the first build (cold uv cache in a fresh container workdir; not a goal, for context);
- `env-rebuild` with the uv cache now warm (goal <= 30 s): provision + uv sync (copy mode) +
  verification (imports torch) + manifest + atomic switch;
- `check_env` in process on the synced env, connection reused (goal <= 2 s), and the whole
  `fab env-check` command (Python + Fabric start-up and SSH included).
Results are printed and appended to benchmarks/RESULTS.md (date, machine, commit, command).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from fleet_overhead import HOSTS_ENV, commit, machine, summary  # noqa: E402

from fleet import envs  # noqa: E402
from fleet.inventory import load_inventory  # noqa: E402
from fleet.target import open_target  # noqa: E402

FAB = REPO / ".venv" / "bin" / "fab"
RESULTS = REPO / "benchmarks" / "RESULTS.md"


def host_facts() -> dict[str, str]:
    """KEY=VALUE facts of the test host (tests/hosts/.state/hosts.env)."""
    facts = {}
    for line in HOSTS_ENV.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            words = shlex.split(value)
            facts[key.strip()] = words[0] if words else ""
    return facts


def inventory(tmp: Path, test_host: bool, env: str) -> Path:
    path = tmp / "fleet.toml"
    if not test_host:
        path.write_text(f'[targets.local]\nhost = "local"\nworkdir = "wd"\nenv = "{env}"\n')
        return path
    f = host_facts()
    path.write_text(
        "[targets.ct200]\n"
        f'host = "{f["FLEET_TEST_SSH_USER"]}@{f["FLEET_TEST_SSH_HOST"]}:{f["FLEET_TEST_SSH_PORT"]}"\n'
        f'identity_file = "{f["FLEET_TEST_IDENTITY"]}"\n'
        f'known_hosts = "{f["FLEET_TEST_KNOWN_HOSTS"]}"\n'
        f'container = {{ type = "pct", id = {f["FLEET_TEST_CT_ID"]} }}\n'
        f'workdir = "/workspace/fleet-env-bench-{os.getpid()}"\n'
        f'env = "{env}"\n'
        f'[targets.ct200.commands]\npct = "{f["FLEET_TEST_PCT"]}"\n'
    )
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="local-cpu", help="envs/<name> to build (default local-cpu)")
    parser.add_argument("--repeat", type=int, default=5, help="env-check measurements")
    parser.add_argument("--test-host", action="store_true", help="use container 200 of tests/hosts")
    parser.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument(
        "--link-mode", default=envs.LINK_MODE, help="uv link mode to compare (fleet uses copy)"
    )
    args = parser.parse_args()
    envs.LINK_MODE = args.link_mode
    if args.test_host and not HOSTS_ENV.exists():
        print(f"no test host: {HOSTS_ENV} missing; run tests/hosts/setup", file=sys.stderr)
        return 2

    tmp = tempfile.TemporaryDirectory(prefix="fleet-env-bench-")
    config = inventory(Path(tmp.name), args.test_host, args.env)
    spec = next(iter(load_inventory(config).targets.values()))
    print(f"target {spec.name} ({spec.display}), workdir {spec.workdir}, env {args.env}", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_CONFIG"] = str(config)
    check_api: list[float] = []
    check_fab: list[float] = []
    with open_target(spec) as target:
        t0 = time.perf_counter()
        first = envs.rebuild_env(target, REPO)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = envs.rebuild_env(target, REPO)
        warm_s = time.perf_counter() - t0
        print(f"first build {cold:.1f} s, rebuild (warm cache) {warm_s:.1f} s: {warm.describe()}", flush=True)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = envs.check_env(target, REPO)
            check_api.append(time.perf_counter() - t0)
            assert not report.drift, report.summary()
            t0 = time.perf_counter()
            result = subprocess.run([FAB, "env-check"], cwd=REPO, env=env, capture_output=True, text=True)
            check_fab.append(time.perf_counter() - t0)
            assert result.returncode == 0, result.stdout + result.stderr
        checked, hashed = report.checked, report.hashed_files
        target.run(["rm", "-rf", "--", spec.workdir], check=False)
    tmp.cleanup()

    cache = "cold uv cache" if args.test_host else "this machine's uv cache, warm"
    lines = [
        f"- first build in a fresh workdir ({cache}; context): {cold:.1f} s ({first.describe()})",
        f"- `env-rebuild` with a warm uv cache (goal <= 30 s): {warm_s:.1f} s",
        f"- `check_env` in process on the synced env ({checked} distributions, {hashed} files hashed; "
        f"goal <= 2 s): {summary(check_api)}",
        f"- the whole `fab env-check` command (interpreter start-up included): {summary(check_fab)}",
    ]
    print("\n".join(lines))
    if not args.no_append:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/env_bench.py " + " ".join(sys.argv[1:])
        block = [
            "",
            f"## pinned envs — {now}",
            "",
            f"- target: `{spec.name}` ({spec.display}), env `{args.env}`, uv link mode {args.link_mode}; "
            f"machine: {machine()}; commit: {commit()}",
            f"- command: `{command.strip()}`",
            *lines,
            "",
        ]
        with RESULTS.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
