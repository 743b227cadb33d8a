"""The README's two commands on a fresh Debian machine (hosts tier).

A new LXC container from the cached debootstrap rootfs (tests/freshct.py), with only the
README's prerequisites installed by apt, a fresh `git clone` of this checkout's HEAD, then
exactly what a new user types: `./bootstrap && .venv/bin/fab deploy train`, which trains the tiny
default to the end (then `fab export --to` copies its drafter folder back), and the README's
test command restricted to the fast tier. Before the
prerequisites, `./bootstrap` on the bare image (python3 without venv or pip) must say in one line
what to install. The host's uv cache is shared with the container: torch is downloaded once per
machine (benchmarks/fresh_setup.py measures the cold case). Last, with python3-pip instead of
python3-venv, `./bootstrap` installs uv into .venv through the system pip, never into the system.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import freshct
import pytest
from testkit import TestHost

from fleet.envs import controller_uv

pytestmark = [pytest.mark.hosts, pytest.mark.slow]

FIRST = "./bootstrap && .venv/bin/fab deploy train"
# The README's test command on the fast tier, without the torchrun jobs of test_topology.py (minutes
# on 2 cores; they run on the host): the hosts tier needs the test host, the slow one time.
TESTS = (
    "./bootstrap --dev && .venv/bin/python -m pytest -q -p no:cacheprovider -m 'not slow and not hosts' "
    "--ignore=tests/training/test_topology.py"
)
# A 1+1 topology run: this container's hostname has no /etc/hosts line (none at all, as debootstrap
# leaves it), where torchrun --standalone never forms its rendezvous.
TOPOLOGY = (
    ".venv/bin/python -m training.topology --nproc-per-node=2 -m training train --config tiny-cpu "
    "--run-dir /tmp/topology-run --topology 1+1 --train.steps=2 --train.torch_threads=1 "
    "--eval.num_prompts=0 --checkpoint.every=0"
)
RUN_END_S = 1800  # the tiny run still going after this is a hang (not a speed check)


def _uv_cache() -> Path:
    out = subprocess.run([controller_uv()[0], "cache", "dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def fresh(hosts: TestHost) -> Iterator[freshct.FreshContainer]:
    """A fresh container (named after this checkout's test containers), removed afterwards."""
    prefix = hosts.ct_name.removesuffix(f"ct{hosts.ct_id}")
    ct = freshct.create(f"{prefix}fresh", uv_cache=_uv_cache())
    yield ct
    ct.destroy()


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_readme_commands_on_a_fresh_debian(fresh: freshct.FreshContainer) -> None:
    ct = fresh
    # 1. The bare image: python3 without venv/ensurepip or pip, no uv, no git. The repo's files
    # as a download of HEAD would give them.
    bare_image = ct.sh("python3 -c 'import ensurepip'; python3 -m pip --version; command -v git uv")
    assert "No module named" in bare_image.stderr and bare_image.stdout.strip() == "", bare_image
    ct.path("/root/bare").mkdir()
    _export_head(ct.path("/root/bare"))
    bare = ct.sh("cd /root/bare && ./bootstrap")
    assert bare.returncode == 1
    assert "sudo apt-get install python3-venv" in _one_line(bare.stderr)
    assert not ct.path("/root/bare/.venv").exists()

    # 2. The README's prerequisites, a fresh clone, the first command.
    packages = freshct.readme_prerequisites()
    apt = ct.sh(
        "apt-get update -qq && apt-get install -y -qq --no-install-recommends " + " ".join(packages),
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=1200,
    )
    assert apt.returncode == 0, apt.stderr[-3000:]
    clone = ct.sh("cd /root && git clone -q fleet.git fleet")
    assert clone.returncode == 0, clone.stderr
    first, _ = freshct.timed(ct, f"cd /root/fleet && {FIRST}", timeout=1800)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Traceback" not in first.stderr and "started" in first.stdout, first.stdout
    status = _wait_for_run_end(ct)
    assert status["state"] == "finished" and status["process_exit_code"] == 0, status
    assert status["step"] == status["total_steps"] == 150, status
    venv_site = "/root/fleet/.venv/lib/python3.11/site-packages"
    assert not ct.path(f"{venv_site}/torch").exists()  # the controller stays light
    # The trained drafter leaves the trainer: `fab export --to` brings the serving folder back.
    exported = ct.sh("cd /root/fleet && .venv/bin/fab export --to /root/drafter", timeout=900)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    assert "step 150 exported" in exported.stdout, exported.stdout
    drafter = json.loads(ct.path("/root/drafter/config.json").read_text())
    assert (
        drafter["architectures"] == ["DFlashDraftModel"]
        and ct.path("/root/drafter/model.safetensors").exists()
    )

    # 3. The README's test command, fast tier, on a machine `fab doctor` finds fit (the hostname
    # resolves, as on a Proxmox container); then a topology run where the hostname does not resolve.
    hosts = ct.path("/etc/hosts")
    bare_hosts = hosts.read_text() if hosts.exists() else ""
    hosts.write_text(bare_hosts + f"127.0.1.1\t{ct.name}\n")
    tests, _ = freshct.timed(ct, f"cd /root/fleet && {TESTS}", timeout=2400)
    hosts.write_text(bare_hosts)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout.splitlines()[-1], tests.stdout[-2000:]
    unresolved = ct.sh("getent hosts $(hostname)")
    assert unresolved.returncode != 0, unresolved.stdout
    topology = ct.sh(f"cd /root/fleet && {TOPOLOGY}", timeout=900)
    assert topology.returncode == 0, topology.stderr[-3000:]
    assert "cannot be retrieved" not in topology.stderr

    # 4. pip without ensurepip (python3-pip, no python3-venv) on a PEP 668 Python: uv goes into
    # .venv through the system pip, nothing into the system Python.
    swap = ct.sh(
        "apt-get remove -y -qq python3-venv python3.11-venv && "
        "apt-get install -y -qq --no-install-recommends python3-pip",
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=900,
    )
    assert swap.returncode == 0, swap.stderr[-3000:]
    assert ct.path("/usr/lib/python3.11/EXTERNALLY-MANAGED").exists()
    assert ct.sh("python3 -c 'import ensurepip'").returncode != 0
    with_pip = ct.sh("cd /root/bare && ./bootstrap")
    assert with_pip.returncode == 0, with_pip.stderr
    assert "uv not found: installing uv==" in with_pip.stderr and len(with_pip.stderr.splitlines()) == 3
    assert ct.path("/root/bare/.venv/bin/uv").exists()
    system = ct.sh("python3 -m pip list --format=freeze")
    assert system.returncode == 0 and not any(line.startswith("uv==") for line in system.stdout.splitlines())


def _export_head(dest: Path) -> None:
    """The files of HEAD (what a download of the repo gives), without git inside the container."""
    archive = subprocess.run(
        ["git", "-C", str(freshct.REPO), "archive", "HEAD"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _wait_for_run_end(ct: freshct.FreshContainer) -> dict:
    deadline = time.monotonic() + RUN_END_S
    while True:
        res = ct.sh("cd /root/fleet && .venv/bin/fab status --json")
        status = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {"raw": res.stderr}
        if status.get("state") in ("finished", "stopped", "failed") and not status.get("alive"):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"the tiny run did not end within {RUN_END_S} s: {status}")
        time.sleep(10)
