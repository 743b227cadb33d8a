"""`fab doctor` end to end: the real `fab` -> SSH -> the Proxmox host (pct config) and `pct exec` ->
the LXC container, on a well-configured container and with one planted fault each.

The stand-ins (the test host has no GPU): `nvidia-smi` is the shim replaying real captures
(`tests/fixtures/nvidia-smi/pcie_nop2p/`, installed on the host and in the container); the
container's NVIDIA device nodes are made with `mknod` and a real host's device numbers; its
`libnvidia-ml.so.*` / `libcuda.so.*` are empty files named like the driver's. `pct config 200` is
the shim reading the config `tests/hosts/setup` writes. Everything else (df, ulimit, getent,
/dev/shm, /etc/hosts, the mounts) is the real container's.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from testkit import HOSTS_ENV, parse_hosts_env

if TYPE_CHECKING:
    import subprocess

    from testkit import RemoteFleet, TestHost

pytestmark = [pytest.mark.hosts, pytest.mark.exclusive_host]

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "shims" / "nvidia-smi"
SCENARIO = REPO / "tests" / "fixtures" / "nvidia-smi" / "pcie_nop2p"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
DRIVER = "580.159.04"  # what the H200 captures' nvidia-smi reports (the module the libs must match)
# a real host's device numbers: nvidiaN + nvidiactl 195, nvidia-uvm 511, nvidia-caps 236
NODES = (
    ("nvidia0", 195, 0), ("nvidia1", 195, 1), ("nvidiactl", 195, 255),
    ("nvidia-uvm", 511, 0), ("nvidia-uvm-tools", 511, 1),
    ("nvidia-caps/nvidia-cap1", 236, 1), ("nvidia-caps/nvidia-cap2", 236, 2),
)  # fmt: skip


@dataclass
class GpuContainer:
    """Container 200 made to look like a GPU container, and the undo steps of each planted fault."""

    fleet: RemoteFleet
    conf: Path
    undo: list[Callable[[], object]] = field(default_factory=list)

    @property
    def hosts(self) -> TestHost:
        return self.fleet.hosts

    def sh(self, script: str) -> str:
        return self.hosts.pct_exec("sh", "-c", script).stdout

    def doctor(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.fleet.fab("doctor", *args, timeout=120)


def install_libs(ct: GpuContainer, version: str) -> None:
    ct.sh(
        f"cd {LIBDIR} && rm -f libnvidia-ml.so* libcuda.so* && for l in libnvidia-ml libcuda; do "
        f': > "$l.so.{version}" && ln -sf "$l.so.{version}" "$l.so.1"; done'
    )


@pytest.fixture
def gpu_ct(remote_fleet: RemoteFleet, hosts: TestHost) -> Iterator[GpuContainer]:
    conf_dir = Path(parse_hosts_env(HOSTS_ENV.read_text()).get("FLEET_TEST_PCT_CONF_DIR", ""))
    conf = conf_dir / f"{hosts.ct_id}.conf"
    if not conf.is_file():
        pytest.fail(f"{conf} is missing: run tests/hosts/setup (it writes the containers' pct configs)")
    saved_conf = conf.read_text()
    base = f"/opt/fleet-doctor-shim-{uuid.uuid4().hex[:10]}"
    roots = (Path(base), hosts.ct_path(base))
    for root in roots:
        root.mkdir(parents=True)
        shutil.copy2(SHIM, root / "nvidia-smi")
        (root / "nvidia-smi.fixture").write_text("fx\n")
        shutil.copytree(SCENARIO, root / "fx")
    ct = GpuContainer(remote_fleet, conf)
    nodes = " && ".join(f"mknod -m 666 /dev/{name} c {major} {minor}" for name, major, minor in NODES)
    ct.sh(f"mkdir -p /dev/nvidia-caps && {nodes}")
    install_libs(ct, DRIVER)
    commands = {**remote_fleet.target["commands"], "nvidia_smi": f"{base}/nvidia-smi"}
    run = {"module": "training", "config": "tiny-cpu", "overrides": [], "env": {}}
    remote_fleet.write(gpus=2, topology="1+1", commands=commands, run=run, gpu_gate={"timeout_s": 10})
    try:
        yield ct
    finally:
        for step in reversed(ct.undo):
            step()
        conf.write_text(saved_conf)
        hosts.pct_exec(
            "sh", "-c", f"rm -rf /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm* /dev/nvidia-caps "
            f"{LIBDIR}/libnvidia-ml.so* {LIBDIR}/libcuda.so*", check=False,
        )  # fmt: skip
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def fault_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one FAIL line naming the fault; `fab doctor` exited 1 with one error line, no traceback."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("fleet: ct200: not fit to train: "), result.stderr
    lines = [x for x in result.stdout.splitlines() if x.startswith("FAIL ") and all(n in x for n in needles)]
    assert len(lines) == 1, f"no single FAIL line with {needles}:\n{result.stdout}"
    return lines[0]


def test_a_well_configured_gpu_container_passes(gpu_ct: GpuContainer) -> None:
    result = gpu_ct.doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ct200: OK: fit to train" in result.stdout and "\nFAIL " not in result.stdout, result.stdout
    assert "GPU0\t X \tPHB" in result.stdout  # the host's topology, printed
    data = json.loads(gpu_ct.doctor("--json").stdout)
    checks = {f["check"]: f for f in data["findings"]}
    assert data["ok"] is True and checks["GPU mount entries"]["status"] == "ok"
    assert checks["hostname"]["message"].startswith(f"{gpu_ct.hosts.ct_name} resolves to ")
    assert checks["libcuda.so"]["message"] == f"libcuda.so.{DRIVER} matches the kernel module {DRIVER}"


def test_a_missing_device_line_is_named(gpu_ct: GpuContainer) -> None:
    # the container config loses /dev/nvidia1's mount entry: the container has no such node either
    gpu_ct.conf.write_text(
        "".join(x for x in gpu_ct.conf.read_text().splitlines(True) if "dev/nvidia1 " not in x)
    )
    gpu_ct.sh("rm /dev/nvidia1")
    line = fault_line(gpu_ct.doctor(), "no lxc.mount.entry for /dev/nvidia1")
    assert 'add "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" to ' in line
    assert "/etc/pve/lxc/200.conf" in line


def test_a_library_that_does_not_match_the_module_is_named(gpu_ct: GpuContainer) -> None:
    install_libs(gpu_ct, "575.57.08")
    result = gpu_ct.doctor()
    line = fault_line(result, "libcuda.so.575.57.08 does not match the kernel module 580.159.04")
    assert "Driver/library version mismatch" in line and "install the 580.159.04 user-space driver" in line
    assert (
        sum(
            "does not match the kernel module" in x
            for x in result.stdout.splitlines()
            if x.startswith("FAIL")
        )
        == 2
    )


def test_a_tiny_dev_shm_is_named(gpu_ct: GpuContainer) -> None:
    gpu_ct.sh("mount -t tmpfs -o size=64m shm /dev/shm")  # over the container's 4 GiB one
    gpu_ct.undo.append(lambda: gpu_ct.hosts.pct_exec("umount", "/dev/shm", check=False))
    line = fault_line(gpu_ct.doctor(), "/dev/shm in container 200 is 64 MiB")
    assert "NCCL and DataLoader workers need >= 1.0 GiB" in line and "lxc.mount.entry: tmpfs dev/shm" in line


def test_an_unresolvable_hostname_is_named(gpu_ct: GpuContainer) -> None:
    hosts_file = gpu_ct.hosts.ct_path("/etc/hosts")
    saved = hosts_file.read_text()
    gpu_ct.undo.append(lambda: hosts_file.write_text(saved))
    hosts_file.write_text("".join(x for x in saved.splitlines(True) if gpu_ct.hosts.ct_name not in x))
    name = gpu_ct.hosts.ct_name
    line = fault_line(gpu_ct.doctor(), f"the hostname '{name}' of container 200 does not resolve")
    assert f'add "127.0.1.1 {name}" to /etc/hosts in container 200' in line


def test_a_full_disk_is_named(gpu_ct: GpuContainer) -> None:
    workdir = gpu_ct.fleet.workdir  # a full 8 MiB tmpfs stands in for a full volume
    gpu_ct.sh(f"mkdir -p {workdir} && mount -t tmpfs -o size=8m fill {workdir} && "
              f"(dd if=/dev/zero of={workdir}/fill bs=1M 2>/dev/null || true)")  # fmt: skip
    gpu_ct.undo.append(lambda: gpu_ct.hosts.pct_exec("umount", workdir, check=False))
    line = fault_line(gpu_ct.doctor(), f"0 KiB free on {workdir} (workdir {workdir})")
    assert "the run needs ~2.0 GiB" in line and "checkpoints" in line


def test_a_cpu_target_says_the_gpu_checks_do_not_apply(gpu_ct: GpuContainer) -> None:
    fleet = gpu_ct.fleet
    fleet.target = {k: v for k, v in fleet.target.items() if k != "topology"}
    fleet.write(gpus=0)
    result = gpu_ct.doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpus = 0: passthrough, driver, topology and health do not apply" in result.stdout
    assert "GPU mount entries" not in result.stdout
