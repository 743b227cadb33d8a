"""Pinned envs end to end: `fab` -> SSH (127.0.0.1) -> pct shim -> LXC container 200.

The container has no uv: fleet pushes the controller's binary to <workdir>/bin/uv, finds the
container's python3, builds the small `smoke` env (PyPI reachable from the container), and the
drift / rebuild / failed rebuild / rollback flow runs against it for real.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import testkit

from fleet import envs, remote
from fleet.errors import EnvError
from fleet.inventory import load_inventory
from fleet.target import open_target

if TYPE_CHECKING:
    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts


def ct(hosts: TestHost, *argv: str) -> subprocess.CompletedProcess[str]:
    return hosts.pct_exec(*argv, check=False, timeout=300)


def readlink(hosts: TestHost, path: str) -> str:
    return ct(hosts, "readlink", "--", path).stdout.strip()


def imports(hosts: TestHost, envs_dir: str) -> int:
    """Exit code of importing six and idna with the current env's python (the shipped probe)."""
    probe = f"{envs_dir}/smoke/current/fleet-env/env_probe.py"
    python = f"{envs_dir}/smoke/current/bin/python"
    return ct(hosts, python, "-I", probe, "verify", "--import", "six", "--import", "idna").returncode


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("fleet: ")]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    return lines[0]


def test_env_build_drift_rebuild_fail_rollback(remote_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    fleet.write(env="smoke")
    envs_dir = f"{workdir}/envs"

    assert fleet.fab("env-check").returncode == 6  # not built yet: EnvError
    deployed = ok(fleet.fab("deploy", timeout=600))  # builds the missing env before the upload
    assert re.search(r"env smoke built \(.*/envs/smoke-[0-9a-f]{16}\)", deployed.stdout), deployed.stdout
    first = readlink(hosts, f"{envs_dir}/smoke/current")
    assert first.startswith("../smoke-")
    python = f"{envs_dir}/smoke/current/bin/python"
    assert imports(hosts, envs_dir) == 0
    assert ok(ct(hosts, f"{workdir}/bin/uv", "--version")).stdout.split()[1] == envs.controller_uv()[1]
    manifest = json.loads(ok(ct(hosts, "cat", f"{envs_dir}/{first[3:]}/fleet-env/manifest.json")).stdout)
    assert manifest["installed"] == {"idna": "3.10", "six": "1.17.0"} and manifest["verified"]
    assert ok(fleet.fab("env-check")).stdout.count("no drift") == 1

    # drift: an extra package and another version of a locked one, installed by hand
    uv_env = [f"UV_CACHE_DIR={workdir}/uv-cache", "UV_NO_CONFIG=1", "UV_SYSTEM_CERTS=1"]
    ok(
        ct(
            hosts,
            "env",
            *uv_env,
            f"{workdir}/bin/uv",
            "pip",
            "install",
            "-q",
            "--python",
            python,
            "attrs",
            "six==1.16.0",
        )
    )
    check = fleet.fab("env-check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "attrs" in check.stdout and "six" in check.stdout and "1.16.0" in check.stdout
    data = json.loads(fleet.fab("env-check", "--json").stdout)
    assert data["drift"] is True
    assert [d["name"] for d in data["extra"]] == ["attrs"]
    assert [(d["name"], d["expected"], d["found"]) for d in data["changed"]] == [("six", "1.17.0", "1.16.0")]
    refused = fleet.fab("deploy")
    assert refused.returncode == 6 and "fab env-rebuild" in error_line(refused)

    # rebuild: a fresh venv next to the drifted one; the check passes; the drifted one stays on disk
    rebuilt = ok(fleet.fab("env-rebuild", timeout=600))
    assert "rebuilt" in rebuilt.stdout
    second = readlink(hosts, f"{envs_dir}/smoke/current")
    assert second != first and readlink(hosts, f"{envs_dir}/smoke/previous") == first
    assert ct(hosts, "test", "-x", f"{envs_dir}/{first[3:]}/bin/python").returncode == 0
    assert ok(fleet.fab("env-check")).returncode == 0
    ok(fleet.fab("deploy"))

    # a rebuild that cannot succeed (no file matches the lock's hashes) leaves the env current
    inv = load_inventory(fleet.config)
    env_def = envs.load_env_def(envs.PROBE.parents[2], "smoke")
    broken = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, env_def.lock.decode())
    with (
        open_target(inv.targets["ct200"]) as target,
        pytest.raises(EnvError, match=r"current env is unchanged"),
    ):
        envs.build_env(target, dataclasses.replace(env_def, lock=broken.encode()), reuse=False)
    assert readlink(hosts, f"{envs_dir}/smoke/current") == second
    assert imports(hosts, envs_dir) == 0
    assert not [n for n in ct(hosts, "ls", "-A", envs_dir).stdout.split() if n.startswith(".staging")]

    # rollback: back to the previous (drifted) build, and the check says so
    rolled = ok(fleet.fab("env-rollback"))
    assert first[3:] in rolled.stdout and readlink(hosts, f"{envs_dir}/smoke/current") == first
    assert fleet.fab("env-check").returncode == 1
    ok(fleet.fab("env-rollback"))
    assert readlink(hosts, f"{envs_dir}/smoke/current") == second

    # --gc keeps current and previous (nothing else exists here)
    gc = ok(fleet.fab("env-rebuild", "--gc", timeout=600))
    third = readlink(hosts, f"{envs_dir}/smoke/current")
    left = set(ct(hosts, "ls", "-A", envs_dir).stdout.split())
    assert {third[3:], second[3:]} <= left and first[3:] not in left, gc.stdout


def test_parallel_first_deploys_build_the_env_once(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    """Three `fab deploy` at once into a workdir without the env: one builds it, the others wait
    for that build under the env's lock and reuse it; one build on disk, no stale lock.

    The test holds the env's build lock (fleet's own lock script) until all three deploys say
    they wait for it: however fast each deploy starts, all three meet at the lock."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    envs_dir = f"{fleet.workdir}/envs"
    lock = f"{envs_dir}/.build-smoke.lock"
    fleet.write(env="smoke")
    holder = subprocess.Popen(
        [hosts.pct, "exec", str(hosts.ct_id), "--", *remote.sh("env_lock.sh", lock, "test")],
        stdin=subprocess.PIPE,
    )
    logs = [tmp_path / f"deploy-{i}.log" for i in range(3)]
    try:
        testkit.wait_for(
            "the test's lock", lambda: ct(hosts, "cat", "--", lock).stdout.strip() == "test", timeout=300
        )
        procs = []
        for log in logs:
            with log.open("w") as out:
                procs.append(
                    testkit.fab_popen("deploy", config=fleet.config, stdout=out, stderr=subprocess.STDOUT)
                )
        waiting = "another deploy is building env smoke"
        testkit.wait_for(
            "three waiting deploys", lambda: all(waiting in log.read_text() for log in logs), timeout=300
        )
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    outs = []
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=600) == 0, log.read_text()
        outs.append(log.read_text())
    building = [line for out in outs for line in out.splitlines() if "building env smoke-" in line]
    assert len(building) == 1, outs
    builds = ct(hosts, "ls", "--", envs_dir).stdout.split()
    assert len([b for b in builds if b.startswith("smoke-")]) == 1, builds
    assert imports(hosts, envs_dir) == 0
    # The lock went with the deploys: a fourth one takes it at once.
    again = ok(fleet.fab("deploy"))
    assert "another deploy is building" not in again.stdout + again.stderr


def test_junk_env_manifest_is_named_not_called_a_broken_env(remote_fleet: RemoteFleet) -> None:
    """A build whose fleet-env/manifest.json is junk still runs: env-check and deploy name the
    manifest as the cause (one line, exit 6) and `fab env-rebuild` repairs it."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    envs_dir = f"{fleet.workdir}/envs"
    fleet.write(env="smoke")
    ok(fleet.fab("deploy", timeout=600))
    manifest = f"{envs_dir}/smoke/current/fleet-env/manifest.json"
    ct(hosts, "sh", "-c", 'printf "{not json" > "$1"', "x", manifest)
    for args in (("env-check",), ("deploy",)):
        res = fleet.fab(*args, timeout=600)
        assert res.returncode == 6, res.stdout + res.stderr
        line = error_line(res)
        assert "manifest" in line and "not JSON" in line and "does not run" not in line, line
        assert "env-rebuild" in line, line
    ok(fleet.fab("env-rebuild", timeout=600))
    ok(fleet.fab("env-check"))
    assert imports(hosts, envs_dir) == 0
