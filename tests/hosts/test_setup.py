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


def test_container_is_like_a_proxmox_one(hosts: TestHost) -> None:
    """Its hostname resolves (torchrun's rendezvous needs that) and it trusts this machine's CAs."""
    resolved = hosts.pct_exec(
        "python3", "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"
    )
    assert resolved.stdout.strip().startswith("127."), resolved.stdout + resolved.stderr
    bundle = hosts.pct_exec("cat", "/etc/ssl/certs/ca-certificates.crt").stdout
    for cert in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")):
        body = "".join(
            line for line in cert.read_text().splitlines() if line and not line.startswith("-----")
        )
        assert body[:200] in bundle.replace("\n", ""), f"{cert} is not in the container's CA bundle"
