"""tests/hosts/setup is idempotent: a second run reuses sshd, the rootfs cache and the container."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from testkit import TestHost

pytestmark = pytest.mark.hosts

SETUP = Path(__file__).resolve().with_name("setup")
STATE = Path(__file__).resolve().with_name(".state")


@pytest.mark.skipif(os.geteuid() != 0, reason="tests/hosts/setup needs root")
def test_second_setup_run_changes_nothing(hosts: TestHost) -> None:
    env_before = (STATE / "hosts.env").read_text()
    pid_before = Path(hosts.sshd_pidfile).read_text()
    result = subprocess.run([str(SETUP)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "sshd already running" in result.stderr
    assert "rootfs cache" in result.stderr and "reused" in result.stderr
    assert f"container {hosts.ct_name} already running" in result.stderr
    assert Path(hosts.sshd_pidfile).read_text() == pid_before
    assert (STATE / "hosts.env").read_text() == env_before


def test_setup_rejects_unknown_arguments() -> None:
    result = subprocess.run(
        [str(SETUP), "--frobnicate"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    if os.geteuid() == 0:
        assert "unknown argument '--frobnicate'" in result.stderr
    else:
        assert "run as root" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="tests/hosts/setup needs root")
def test_container_200_has_shm_and_its_hostname_once_after_every_setup(hosts: TestHost) -> None:
    result = subprocess.run([str(SETUP)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    etc_hosts = hosts.pct_exec("cat", "/etc/hosts").stdout.splitlines()
    assert etc_hosts.count(f"127.0.1.1 {hosts.ct_name}") == 1
    assert hosts.pct_exec("getent", "hosts", hosts.ct_name).stdout.split()[0] == "127.0.1.1"
    mounts = [m for m in hosts.pct_exec("cat", "/proc/mounts").stdout.splitlines() if " /dev/shm " in m]
    assert len(mounts) == 1 and mounts[0].startswith("shm /dev/shm tmpfs "), mounts


def test_container_trusts_this_machines_cas(hosts: TestHost) -> None:
    """Like a Proxmox container on this network: the CAs this machine added are in its bundle."""
    bundle = hosts.pct_exec("cat", "/etc/ssl/certs/ca-certificates.crt").stdout
    for cert in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")):
        body = "".join(
            line for line in cert.read_text().splitlines() if line and not line.startswith("-----")
        )
        assert body[:200] in bundle.replace("\n", ""), f"{cert} is not in the container's CA bundle"
