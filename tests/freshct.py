"""A fresh Debian machine for the set-up tests and benchmarks: an LXC container made from the
debootstrapped rootfs that tests/hosts/setup caches (bookworm minbase + python3, tmux, procps,
ca-certificates; no /etc/hosts line for its hostname), host network, nothing else installed.

The repo arrives as a bare clone of this checkout's HEAD (``/root/fleet.git``): inside, the
README's commands start from ``git clone /root/fleet.git fleet``. Optionally the host's uv cache
is bind-mounted at the container's default uv cache path, so that a multi-GB torch download
happens once per machine, not once per test run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTFS_CACHE = Path(os.environ.get("FLEET_TEST_CACHE", "/var/cache/fleet-tests")) / "rootfs-bookworm"
CT_UV_CACHE = "/root/.cache/uv"  # uv's default cache dir for root
SITE_CAS = Path("/usr/local/share/ca-certificates")  # CAs this machine added (a TLS-inspecting proxy)
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}


def readme_prerequisites(readme: Path = REPO / "README.md") -> list[str]:
    """The Debian packages the README's prerequisites name (its ``apt-get install`` line)."""
    match = re.search(r"^(?:sudo )?apt-get install -y ([^\n`]+)$", readme.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{readme}: no `apt-get install -y ...` line under the prerequisites")
    return match.group(1).split()


def lxc_path() -> Path:
    return Path(
        subprocess.run(
            ["lxc-config", "lxc.lxcpath"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )


@dataclass
class FreshContainer:
    """A started container; ``sh`` runs a bash script in it as root with a clean environment."""

    name: str
    base: Path  # <lxcpath>/<name>

    @property
    def rootfs(self) -> Path:
        return self.base / "rootfs"

    def path(self, inside: str) -> Path:
        """Where a path inside the container is, seen from this machine."""
        return self.rootfs / inside.lstrip("/")

    def sh(
        self, script: str, *, env: dict[str, str] | None = None, timeout: float = 600, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        argv = ["lxc-attach", "-n", self.name, "--clear-env"]
        for key, value in {**BASE_ENV, **(env or {})}.items():
            argv += ["--set-var", f"{key}={value}"]
        argv += ["--", "bash", "-c", script]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise AssertionError(
                f"in {self.name}: {script!r} exited {done.returncode}:\n{done.stderr[-4000:]}"
            )
        return done

    def du_bytes(self, inside: str) -> int:
        """Disk used by a path inside the container (du -s, bytes; hard links counted once)."""
        out = self.sh(f"du -s -B1 {shlex.quote(inside)} 2>/dev/null | cut -f1", check=True).stdout.strip()
        return int(out or 0)

    def destroy(self) -> None:
        subprocess.run(["lxc-stop", "-n", self.name, "-k"], capture_output=True, check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def create(
    name: str,
    *,
    uv_cache: Path | None = None,
    binds: dict[Path, str] | None = None,
    rootfs_cache: Path = ROOTFS_CACHE,
) -> FreshContainer:
    """A new container ``name`` (an old one of that name is removed first), started, with the repo's
    HEAD as a bare clone at /root/fleet.git and this machine's site CAs trusted. ``uv_cache`` and
    ``binds`` (host folder -> absolute path inside) are per-machine caches bind-mounted in."""
    if not (rootfs_cache / ".fleet-complete").is_file():
        raise FileNotFoundError(f"{rootfs_cache} is not a complete rootfs cache: run tests/hosts/setup")
    base = lxc_path() / name
    ct = FreshContainer(name, base)
    ct.destroy()
    base.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(rootfs_cache), str(ct.rootfs)], check=True)
    init = shutil.which("init.lxc.static") or "/usr/sbin/init.lxc.static"
    shutil.copy(init, ct.path("/sbin/init.lxc"))
    ct.path("/etc/hostname").write_text(f"{name}\n")
    mounts = ""
    if uv_cache is not None:
        uv_cache.mkdir(parents=True, exist_ok=True)
        mounts = f"lxc.mount.entry = {uv_cache} {CT_UV_CACHE.lstrip('/')} none bind,create=dir 0 0\n"
    for host_dir, inside in (binds or {}).items():
        host_dir.mkdir(parents=True, exist_ok=True)
        mounts += f"lxc.mount.entry = {host_dir} {inside.lstrip('/')} none bind,create=dir 0 0\n"
    # As tests/hosts/setup: host network, no AppArmor, no cgroup limits; init.lxc reaps orphans.
    (base / "config").write_text(
        "lxc.include = /usr/share/lxc/config/common.conf\n"
        "lxc.arch = linux64\n"
        f"lxc.uts.name = {name}\n"
        f"lxc.rootfs.path = dir:{ct.rootfs}\n"
        "lxc.net.0.type = none\n"
        "lxc.apparmor.profile = unconfined\n"
        f"lxc.init.cmd = /sbin/init.lxc -n {name} -- /bin/sleep infinity\n" + mounts
    )
    subprocess.run(
        ["git", "clone", "-q", "--bare", "--no-hardlinks", str(REPO), str(ct.path("/root/fleet.git"))],
        check=True,
    )
    subprocess.run(["lxc-start", "-n", name, "-d"], check=True)
    subprocess.run(["lxc-wait", "-n", name, "-s", "RUNNING", "-t", "30"], check=True)
    # What Proxmox gives every container (as tests/hosts/setup does for ct200): a /dev/shm tmpfs,
    # which torch's multiprocessing and NCCL's shared-memory transport need.
    ct.sh(
        "mountpoint -q /dev/shm || { mkdir -p /dev/shm && "
        "mount -t tmpfs -o size=4g,mode=1777,nosuid,nodev shm /dev/shm; }",
        check=True,
    )
    cas = sorted(SITE_CAS.glob("*.crt"))
    if cas:
        dest = ct.path(str(SITE_CAS))
        dest.mkdir(parents=True, exist_ok=True)
        for cert in cas:
            shutil.copyfile(cert, dest / cert.name)
        ct.sh("update-ca-certificates >/dev/null", check=True)
    return ct


def timed(ct: FreshContainer, script: str, **kwargs) -> tuple[subprocess.CompletedProcess[str], float]:
    """``ct.sh(script)`` and its wall time in seconds."""
    started = time.monotonic()
    done = ct.sh(script, **kwargs)
    return done, time.monotonic() - started
