"""The README's two commands on a fresh Debian container: wall time and disk, cold and warm uv cache.

    .venv/bin/python benchmarks/fresh_setup.py [--cache cold|warm|both] [--pytest-args ARGS] [--no-append]

Each round makes a new container from the cached debootstrap rootfs (tests/freshct.py; run
tests/hosts/setup once first), installs the README's prerequisites with apt, clones this
checkout's HEAD, then runs and times, as a new user would:

1. ``./bootstrap && .venv/bin/fab deploy train`` until it returns (env built, run started), and
   until the tiny run has finished (``fab status``: finished);
2. ``./bootstrap --dev`` then ``.venv/bin/python -m pytest ARGS`` (the README's test command;
   ``--pytest-args`` narrows it, e.g. to the fast tier).

``cold``: the container's uv cache is a new empty folder (torch and its CUDA wheels are
downloaded from PyPI); ``warm``: it is this machine's uv cache, bind-mounted (nothing to
download). Disk: ``du`` of .venv, .fleet (the target env, releases, the run), the trainer cache
and the uv cache folder (cold only). Prints JSON lines; appends a block to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import freshct  # noqa: E402
from fleet_overhead import commit, machine  # noqa: E402

from fleet.envs import controller_uv  # noqa: E402

RESULTS = REPO / "benchmarks" / "RESULTS.md"
FIRST = "./bootstrap && .venv/bin/fab deploy train"
GIB = 1024**3


def host_uv_cache() -> Path:
    out = subprocess.run([controller_uv()[0], "cache", "dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def run_end(ct: freshct.FreshContainer, limit_s: float = 3600) -> dict:
    """`fab status --json` once the tiny run has ended (polled every 5 s)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        res = ct.sh("cd /root/fleet && .venv/bin/fab status --json")
        if res.stdout.strip().startswith("{"):
            status = json.loads(res.stdout)
            if status.get("state") in ("finished", "stopped", "failed") and not status.get("alive"):
                return status
        time.sleep(5)
    raise TimeoutError(f"the tiny run did not end within {limit_s} s")


def one_round(mode: str, pytest_args: str, cold_dir: Path) -> dict:
    name = f"fleet-bench-fresh-{mode}"
    cache = cold_dir if mode == "cold" else host_uv_cache()
    ct = freshct.create(name, uv_cache=cache)
    try:
        packages = " ".join(freshct.readme_prerequisites())
        apt, apt_s = freshct.timed(
            ct,
            f"apt-get update -qq && apt-get install -y -qq --no-install-recommends {packages}",
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=1800,
        )
        if apt.returncode != 0:
            raise RuntimeError(f"apt-get failed: {apt.stderr[-2000:]}")
        ct.sh("cd /root && git clone -q fleet.git fleet", check=True)
        cloned = ct.sh("git -C /root/fleet rev-parse --short HEAD", check=True).stdout.strip()
        cache_before = ct.du_bytes(freshct.CT_UV_CACHE) if mode == "cold" else 0
        started = time.monotonic()
        first = ct.sh(f"cd /root/fleet && {FIRST}", timeout=3600)
        first_s = time.monotonic() - started
        if first.returncode != 0:
            raise RuntimeError(f"{FIRST} failed: {first.stderr[-2000:]}")
        status = run_end(ct)
        trained_s = time.monotonic() - started
        disk1 = {
            "venv": ct.du_bytes("/root/fleet/.venv"),
            "fleet": ct.du_bytes("/root/fleet/.fleet"),
            "trainer_cache": ct.du_bytes("/root/.cache/fleet-training"),
        }
        if mode == "cold":
            disk1["uv_cache"] = ct.du_bytes(freshct.CT_UV_CACHE) - cache_before
        dev, dev_s = freshct.timed(ct, "cd /root/fleet && ./bootstrap --dev", timeout=3600)
        if dev.returncode != 0:
            raise RuntimeError(f"./bootstrap --dev failed: {dev.stderr[-2000:]}")
        pytest = f"cd /root/fleet && .venv/bin/python -m pytest -q -p no:cacheprovider {pytest_args}"
        tests, tests_s = freshct.timed(ct, pytest, timeout=7200)
        disk2 = {"venv": ct.du_bytes("/root/fleet/.venv")}
        if mode == "cold":
            disk2["uv_cache"] = ct.du_bytes(freshct.CT_UV_CACHE) - cache_before
        return {
            "mode": mode,
            "commit": cloned,
            "apt_s": round(apt_s, 1),
            "first_command_s": round(first_s, 1),
            "first_command_to_run_end_s": round(trained_s, 1),
            "run": {k: status.get(k) for k in ("state", "step", "total_steps", "process_exit_code")},
            "disk_after_first_gib": {k: round(v / GIB, 2) for k, v in disk1.items()},
            "bootstrap_dev_s": round(dev_s, 1),
            "pytest_s": round(tests_s, 1),
            "pytest_summary": (tests.stdout.strip().splitlines() or [""])[-1],
            "disk_after_second_gib": {k: round(v / GIB, 2) for k, v in disk2.items()},
        }
    finally:
        ct.destroy()


def append_results(results: list[dict], argv: str) -> None:
    """A block in RESULTS.md: one table row per round (times in s, disk in GiB)."""
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "",
        f"## Fresh machine: the README's two commands — {when}",
        "",
        f"- machine: {machine()}; checkout {commit()}; a new Debian bookworm LXC container per round "
        "(tests/freshct.py), the README's apt prerequisites, `git clone` of HEAD (commit per row)",
        "- command: `" + f".venv/bin/python benchmarks/fresh_setup.py {argv}".rstrip() + "`",
        "",
        "| uv cache | commit | apt | cmd 1 returns | tiny run ended | `./bootstrap --dev` | `pytest` "
        "| disk after cmd 1: .venv / .fleet / uv cache | .venv after cmd 2 | pytest result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        d1, d2 = r["disk_after_first_gib"], r["disk_after_second_gib"]
        cache = f"{d1['uv_cache']}" if "uv_cache" in d1 else "shared"
        lines.append(
            f"| {r['mode']} | {r['commit']} | {r['apt_s']} | {r['first_command_s']} | "
            f"{r['first_command_to_run_end_s']} | {r['bootstrap_dev_s']} | {r['pytest_s']} | "
            f"{d1['venv']} / {d1['fleet']} / {cache} | {d2['venv']} | {r['pytest_summary']} |"
        )
    with open(RESULTS, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
    parser.add_argument("--pytest-args", default="", help="appended to `python -m pytest` (default: none)")
    parser.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    modes = ["cold", "warm"] if args.cache == "both" else [args.cache]
    results = []
    with tempfile.TemporaryDirectory(prefix="fleet-cold-uv-cache-", dir="/var/tmp") as cold:
        for mode in modes:
            result = one_round(mode, args.pytest_args, Path(cold))
            print(json.dumps(result), flush=True)
            results.append(result)
            shutil.rmtree(cold, ignore_errors=True)
            Path(cold).mkdir(exist_ok=True)
    if not args.no_append:
        append_results(results, " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
