"""The clean-GPU gate end to end: `fab` -> SSH -> pct shim -> LXC container 200.

nvidia-smi is the only stand-in: the shim (tests/shims/nvidia-smi) replays a recorded H200
capture, installed at the same path on the host and inside the container, as on a Proxmox host
with GPUs passed through. Everything else is real: ssh, pct -> lxc-attach, sh, ps, tmux.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "shims" / "nvidia-smi"
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
LONG_RUN = ["--selftest.steps=100000", "--selftest.step_seconds=0.2"]

Replay = Callable[..., None]


@pytest.fixture
def nvidia_smi(hosts: TestHost) -> Iterator[tuple[str, Replay]]:
    """The shim's path (same on host and in the container) and ``replay(container=, host=)``."""
    base = f"/opt/fleet-gpu-shim-{uuid.uuid4().hex[:10]}"
    roots = {"host": Path(base), "container": hosts.ct_path(base)}
    for root in roots.values():
        root.mkdir(parents=True)
        shutil.copy2(SHIM, root / "nvidia-smi")
        (root / "nvidia-smi.fixture").write_text("fx\n")

    def replay(container: str, host: str | None = None, host_pid: int | None = None) -> None:
        for where, scenario in (("container", container), ("host", host or container)):
            shutil.rmtree(roots[where] / "fx", ignore_errors=True)
            shutil.copytree(FIXTURES / scenario, roots[where] / "fx")
        if host_pid is not None:  # the busy capture, with PID 566 replaced by a real host process
            apps = roots["host"] / "fx" / "apps.csv"
            apps.write_text(apps.read_text().replace("566,", f"{host_pid},"))

    yield f"{base}/nvidia-smi", replay
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    return lines[0]


def with_gpus(fleet: RemoteFleet, shim: str) -> None:
    commands = {**fleet.target["commands"], "nvidia_smi": shim}
    fleet.write(
        gpus=2,
        commands=commands,
        gpu_gate={"timeout_s": 10},
        run={"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {}},
    )


def no_run_started(fleet: RemoteFleet) -> None:
    hosts, workdir = fleet.hosts, fleet.workdir
    latest = hosts.pct_exec("test", "-e", f"{workdir}/runs/latest", check=False)
    assert latest.returncode == 1, f"{workdir}/runs/latest exists: a run was started"
    panes = hosts.pct_exec(
        "tmux", "list-panes", "-a", "-F", "#{session_name} #{pane_start_command}", check=False
    )  # other tests may own a tmux server in this container: none of its panes may be ours
    assert workdir not in panes.stdout, panes.stdout


def test_busy_gpu_refuses_train_and_names_pid_566(
    remote_fleet: RemoteFleet, nvidia_smi: tuple[str, Replay]
) -> None:
    shim, replay = nvidia_smi
    with_gpus(remote_fleet, shim)
    replay("busy")
    deployed = remote_fleet.fab("deploy")
    assert deployed.returncode == 0, deployed.stderr

    refused = remote_fleet.fab("train")
    assert refused.returncode == 7, refused.stdout + refused.stderr
    line = one_line_error(refused)
    assert "566" in line and "fab gpus --wait" in line and "Nothing was killed" in line, line
    no_run_started(remote_fleet)

    shown = remote_fleet.fab("gpus")
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "566 python3" in shown.stdout and "NOT CLEAN" in shown.stdout, shown.stdout
    assert "566" in one_line_error(shown)


def test_pids_are_checked_on_the_host_not_in_the_container(
    remote_fleet: RemoteFleet, nvidia_smi: tuple[str, Replay]
) -> None:
    # The container's nvidia-smi sees no process (its PID namespace); the host sees PID 566.
    shim, replay = nvidia_smi
    with_gpus(remote_fleet, shim)
    replay(container="idle", host="busy")
    refused = remote_fleet.fab("deploy", "train")
    assert refused.returncode == 7, refused.stdout + refused.stderr
    assert "566" in one_line_error(refused)
    no_run_started(remote_fleet)


def test_container_driver_mismatch_is_refused(
    remote_fleet: RemoteFleet, nvidia_smi: tuple[str, Replay]
) -> None:
    shim, replay = nvidia_smi
    with_gpus(remote_fleet, shim)
    replay(container="nvml_mismatch", host="idle")
    shown = remote_fleet.fab("gpus", "--json")
    assert shown.returncode == 1
    assert "container 200: NVML driver/library version mismatch" in one_line_error(shown)


def test_idle_gpus_let_the_run_start(remote_fleet: RemoteFleet, nvidia_smi: tuple[str, Replay]) -> None:
    shim, replay = nvidia_smi
    with_gpus(remote_fleet, shim)
    replay("idle")
    shown = remote_fleet.fab("gpus")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "ct200: CLEAN" in shown.stdout, shown.stdout

    started = remote_fleet.fab("deploy", "train")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "ct200: 2 GPU(s) clean" in started.stdout and "started" in started.stdout, started.stdout
    latest = remote_fleet.hosts.pct_exec("test", "-e", f"{remote_fleet.workdir}/runs/latest", check=False)
    assert latest.returncode == 0


def host_pids_of(workdir: str) -> list[int]:
    """Host-side PIDs of the selftest processes whose command line names ``workdir``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if b"training.selftest" in cmdline and any(workdir.encode() in arg for arg in cmdline):
            pids.append(int(proc.name))
    return pids


def test_our_own_run_on_the_gpu_suggests_fab_stop(
    remote_fleet: RemoteFleet, nvidia_smi: tuple[str, Replay]
) -> None:
    shim, replay = nvidia_smi
    with_gpus(remote_fleet, shim)
    replay("idle")
    started = remote_fleet.fab("deploy", "train")
    assert started.returncode == 0, started.stdout + started.stderr
    deadline = time.monotonic() + 60  # a generous wait for the process, not a speed check
    while not (pids := host_pids_of(remote_fleet.workdir)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert pids, "the selftest run's process never appeared on the host"

    replay(container="idle", host="busy", host_pid=pids[0])  # the host's driver: our run holds GPU 0
    again = remote_fleet.fab("train")  # the live run is refused first, before the GPU gate
    assert again.returncode == 5, again.stdout + again.stderr
    line = one_line_error(again)
    assert "is live" in line and "`fab stop`" in line and "GPU" not in again.stdout, line
    shown = remote_fleet.fab("gpus")
    assert f"PID {pids[0]} on GPU 0 (this project run): root: " in shown.stdout, shown.stdout
    assert "training.selftest" in shown.stdout
