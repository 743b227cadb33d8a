"""The shared test helpers of tests/conftest.py: hosts.env parsing, inventory rendering, local tmux."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from fleet.inventory import load_inventory

if TYPE_CHECKING:
    from testkit import LocalTmux, TestHost

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def helpers() -> ModuleType:
    """tests/testkit.py, the shared helpers behind tests/conftest.py."""
    import testkit

    return testkit


def test_parse_hosts_env_reads_shell_quoted_values(helpers: ModuleType) -> None:
    text = "# comment\n\nA=plain\nB=/path/with\\ space\nC='single quoted'\nD=\n"
    assert helpers.parse_hosts_env(text) == {
        "A": "plain",
        "B": "/path/with space",
        "C": "single quoted",
        "D": "",
    }


def fake_host(helpers: ModuleType, tmp_path: Path) -> TestHost:
    return helpers.TestHost(
        ssh_host="127.0.0.1", ssh_port=2222, ssh_user="root", identity=str(tmp_path / "id"),
        known_hosts=str(tmp_path / "kh"), known_hosts_wrong="", known_hosts_empty="",
        sshd_pidfile="", pct=str(tmp_path / "pct"), ct_id=200, ct_name="fleet-ct200",
        ct_rootfs=str(tmp_path / "rootfs"), stopped_ct_id=201, stopped_ct_name="fleet-ct201",
    )  # fmt: skip


def test_rendered_inventory_is_what_fleet_loads(helpers: ModuleType, tmp_path: Path) -> None:
    host = fake_host(helpers, tmp_path)
    target = helpers.ct200_target(host, "/workspace/with space;$(x)`y`'\"")
    target["run"] = {**target["run"], "overrides": ["--a.b='q' \"x\""], "env": {"K": "v a;l$(u)e"}}
    config = tmp_path / "fleet.toml"
    config.write_text(helpers.render_inventory({"ct200": target}, "ct200"))
    assert tomllib.loads(config.read_text())["targets"]["ct200"]["workdir"] == target["workdir"]
    spec = load_inventory(config).targets["ct200"]
    assert spec.ssh is not None and (spec.ssh.hostname, spec.ssh.port, spec.ssh.user) == (
        "127.0.0.1",
        2222,
        "root",
    )
    assert spec.container is not None and (spec.container.type, spec.container.id) == ("pct", 200)
    assert spec.workdir == target["workdir"]
    assert spec.commands.pct == host.pct
    assert spec.run.module == "training.selftest"
    assert spec.run.overrides == ("--a.b='q' \"x\"",)
    assert dict(spec.run.env) == {"K": "v a;l$(u)e"}


def test_local_tmux_is_private(local_tmux: LocalTmux) -> None:
    local_tmux.run("new-session", "-d", "-s", "probe", "sleep 60")
    listed = local_tmux.run("list-sessions", "-F", "#{session_name} #{socket_path}")
    name, socket = listed.stdout.split()
    assert name == "probe"
    assert socket.startswith(str(local_tmux.socket_dir))
    assert os.environ["TMUX_TMPDIR"] == str(local_tmux.socket_dir)


def test_hosts_tier_skips_or_fails_without_a_host(tmp_path: Path) -> None:
    """Without hosts.env the tier is skipped with the reason; FLEET_TEST_REQUIRE_HOSTS=1 fails it."""
    test = REPO / "tests" / "hosts" / "test_pct_shim.py::test_status_running_and_stopped"
    env = {**os.environ, "FLEET_TEST_HOSTS_ENV": str(tmp_path / "missing.env")}
    env.pop("FLEET_TEST_REQUIRE_HOSTS", None)
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test)]
    skipped = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert skipped.returncode == 0, skipped.stdout
    assert "1 skipped" in skipped.stdout and "run tests/hosts/setup" in skipped.stdout
    env["FLEET_TEST_REQUIRE_HOSTS"] = "1"
    failed = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert failed.returncode == 1, failed.stdout
    assert "run tests/hosts/setup" in failed.stdout
