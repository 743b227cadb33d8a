"""The pct shim of the test host: pct's output format and exit codes, over the real container."""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from testkit import TestHost

pytestmark = pytest.mark.hosts

TRICKY = "a b;$(touch /tmp/{m})`touch /tmp/{m}`'\"\\ $HOME"


def pct(hosts: TestHost, *args: str, stdin: str | None = None, env: dict[str, str] | None = None):
    return subprocess.run(
        [hosts.pct, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False, env=env
    )


def exists_in_ct(hosts: TestHost, path: str) -> bool:
    return hosts.pct_exec("test", "-e", path, check=False).returncode == 0


def test_status_running_and_stopped(hosts: TestHost) -> None:
    running = pct(hosts, "status", str(hosts.ct_id))
    assert (running.returncode, running.stdout) == (0, "status: running\n")
    stopped = pct(hosts, "status", str(hosts.stopped_ct_id))
    assert (stopped.returncode, stopped.stdout) == (0, "status: stopped\n")


def test_status_of_unknown_or_bad_vmid_is_a_pct_error(hosts: TestHost) -> None:
    unknown = pct(hosts, "status", "999")
    assert unknown.returncode == 255
    assert unknown.stdout == ""
    assert unknown.stderr == "Configuration file 'nodes/fleet-test/lxc/999.conf' does not exist\n"
    bad = pct(hosts, "status", "abc")
    assert bad.returncode == 255
    assert "vmid: type check ('integer') failed - got 'abc'" in bad.stderr


def test_list_has_pct_columns(hosts: TestHost) -> None:
    listed = pct(hosts, "list")
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert lines[0].rstrip() == "VMID       Status     Lock         Name"
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows[str(hosts.ct_id)] == ["running", hosts.ct_name]
    assert rows[str(hosts.stopped_ct_id)] == ["stopped", hosts.stopped_ct_name]
    # Fixed-width columns as pct prints them: "%-10s %-10s %-12s %-20s".
    row = next(line for line in lines if line.startswith(str(hosts.ct_id)))
    assert row[11:18] == "running" and row[35:].rstrip() == hosts.ct_name


def test_exec_keeps_the_exit_code_and_stdio(hosts: TestHost) -> None:
    failed = pct(hosts, "exec", str(hosts.ct_id), "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (failed.returncode, failed.stdout, failed.stderr) == (7, "out\n", "err\n")
    echoed = pct(hosts, "exec", str(hosts.ct_id), "--", "cat", stdin="through stdin\n")
    assert (echoed.returncode, echoed.stdout) == (0, "through stdin\n")


def test_exec_runs_inside_the_container(hosts: TestHost) -> None:
    inside = pct(hosts, "exec", str(hosts.ct_id), "--", "cat", "/proc/sys/kernel/hostname")
    assert inside.returncode == 0
    assert inside.stdout.strip() == hosts.ct_name
    assert os.uname().nodename != hosts.ct_name


def test_exec_passes_argv_literally(hosts: TestHost) -> None:
    marker = f"pct-marker-{uuid.uuid4().hex[:8]}"
    arg = TRICKY.format(m=marker)
    echoed = pct(hosts, "exec", str(hosts.ct_id), "--", "printf", "%s", arg)
    assert (echoed.returncode, echoed.stdout) == (0, arg)
    assert not exists_in_ct(hosts, f"/tmp/{marker}")
    assert not Path(f"/tmp/{marker}").exists()


def test_exec_clears_the_environment(hosts: TestHost) -> None:
    env = {**os.environ, "FLEET_SHIM_SECRET": "s3cret"}
    shown = pct(hosts, "exec", str(hosts.ct_id), "--", "env", env=env)
    assert shown.returncode == 0
    assert "FLEET_SHIM_SECRET" not in shown.stdout
    assert "PATH=" in shown.stdout
    kept = pct(hosts, "exec", str(hosts.ct_id), "--keep-env", "1", "--", "env", env=env)
    assert "FLEET_SHIM_SECRET=s3cret" in kept.stdout


def test_exec_keeps_the_environment_like_pve8_when_called_as_pct_pve8(
    hosts: TestHost, tmp_path: Path
) -> None:
    pve8 = tmp_path / "pct-pve8"
    pve8.symlink_to(hosts.pct)
    env = {**os.environ, "FLEET_SHIM_SECRET": "s3cret"}
    kept = subprocess.run(
        [str(pve8), "exec", str(hosts.ct_id), "--", "env"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert kept.returncode == 0 and "FLEET_SHIM_SECRET=s3cret" in kept.stdout
    cleared = subprocess.run(
        [str(pve8), "exec", str(hosts.ct_id), "--keep-env", "0", "--", "env"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert cleared.returncode == 0 and "FLEET_SHIM_SECRET" not in cleared.stdout


def test_exec_in_stopped_container_fails_like_lxc_attach(hosts: TestHost) -> None:
    result = pct(hosts, "exec", str(hosts.stopped_ct_id), "--", "true")
    assert result.returncode != 0
    assert "lxc-attach" in result.stderr
    assert pct(hosts, "exec", "999", "--", "true").returncode == 255


def test_usage_errors(hosts: TestHost) -> None:
    missing = pct(hosts, "exec", str(hosts.ct_id))
    assert (missing.returncode, missing.stderr.strip()) == (255, "missing command")
    assert pct(hosts, "exec").returncode == 255
    assert "400 not enough arguments" in pct(hosts, "exec").stderr
    unknown = pct(hosts, "frobnicate")
    assert unknown.returncode == 255
    assert "unknown command 'pct frobnicate'" in unknown.stderr
    assert pct(hosts).returncode == 255


def test_push_and_pull_round_trip(hosts: TestHost, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(256)) * 10)
    dest = f"/tmp/pct-push-{uuid.uuid4().hex[:8]}"
    try:
        assert pct(hosts, "push", str(hosts.ct_id), str(source), dest).returncode == 0
        back = tmp_path / "back.bin"
        assert pct(hosts, "pull", str(hosts.ct_id), dest, str(back)).returncode == 0
        assert back.read_bytes() == source.read_bytes()
    finally:
        hosts.pct_exec("rm", "-f", dest, check=False)
    refused = pct(hosts, "push", str(hosts.stopped_ct_id), str(source), dest)
    assert (refused.returncode, refused.stderr.strip()) == (255, "can only push files to a running CT")


def test_exec_over_ssh_quoted_once_per_layer(hosts: TestHost) -> None:
    """The way fleet reaches the container: ssh host 'shlex.join([pct, exec, ID, --, argv])'."""
    marker = f"ssh-marker-{uuid.uuid4().hex[:8]}"
    arg = TRICKY.format(m=marker)
    remote = shlex.join([hosts.pct, "exec", str(hosts.ct_id), "--", "printf", "%s", arg])
    ssh = [
        "ssh", "-F", "none", "-p", str(hosts.ssh_port), "-i", hosts.identity, "-o", "IdentitiesOnly=yes",
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={hosts.known_hosts}",
        f"{hosts.ssh_user}@{hosts.ssh_host}", remote,
    ]  # fmt: skip
    result = subprocess.run(ssh, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (0, arg)
    assert not exists_in_ct(hosts, f"/tmp/{marker}")
    assert not Path(f"/tmp/{marker}").exists()


def test_config_prints_the_gpu_container_setup_wrote(hosts: TestHost) -> None:
    shown = pct(hosts, "config", str(hosts.ct_id))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"hostname: {hosts.ct_name}" in lines and "memory: 16384" in lines
    keys = [line.split(":")[0] for line in lines if not line.startswith("lxc.")]
    assert keys == sorted(keys), "pct prints the keys sorted"
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" in lines
    assert "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" in lines
    plain = pct(hosts, "config", str(hosts.stopped_ct_id))
    assert plain.returncode == 0 and "nvidia" not in plain.stdout
