"""Pinned uv environments on targets: provision, build, verify, switch, check, rebuild, roll back.

An env is ``envs/<name>/{pyproject.toml,uv.lock}`` in this repo. On a target it is built as a venv
at ``<workdir>/envs/<name>-<hash>`` (hash of the lock + python + platform; a rebuild of the same
hash gets a ``-N`` suffix so the old build stays on disk), in a staging path first:

1. provision: the controller's own uv binary is pushed to ``<workdir>/bin/uv`` when the target
   has no uv of the same version; a Python matching ``requires-python`` is found (or uv installs
   one where it can); tmux is checked (apt-get installs it in a container when missing).
2. the env definition (pyproject + lock + ``env_probe.py``) travels as a tar;
   ``uv venv --relocatable`` + ``uv sync --locked --no-install-project`` (copy link mode, so an edit
   in the venv can never corrupt the shared uv cache), output streamed as progress.
3. verify with the shipped ``env_probe.py``: imports torch when the lock has it, records its
   version and CUDA build, ``torch.cuda.is_available()`` on GPU targets, and refuses a torch whose
   CUDA is newer than the driver's (``nvidia-smi`` header ``CUDA Version: X.Y``).
4. manifest ``fleet-env/manifest.json`` inside the env dir; rename into place; switch
   ``<workdir>/envs/<name>/current`` atomically (symlink + rename); the old one becomes ``previous``.

A failed build removes its staging dir and leaves ``current`` as it was.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import platform
import posixpath
import re
import secrets
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet import remote
from fleet.env_drift import DriftReport, diff_env, parse_lock, parse_uv_check
from fleet.errors import ConfigError, EnvError, tail_lines
from fleet.gpu_arch import CAPS_FIELDS, arch_mismatch, jit_only, parse_caps, sm
from fleet.inventory import TargetSpec
from fleet.target import CommandResult, Target

PROBE = remote.path("env_probe.py")
DEF_DIR = "fleet-env"  # inside an env dir: pyproject.toml, uv.lock, env_probe.py, manifest.json
HASH_LEN = 16
LINK_MODE = "copy"
CUDA_RE = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


@dataclass(frozen=True)
class EnvDef:
    """An env definition of this repo (``envs/<name>/``)."""

    name: str
    pyproject: bytes
    lock: bytes
    requires_python: str

    @property
    def lock_sha256(self) -> str:
        return hashlib.sha256(self.lock).hexdigest()

    @property
    def has_torch(self) -> bool:
        return "torch" in parse_lock(self.lock.decode("utf-8"), f"envs/{self.name}/uv.lock")


@dataclass(frozen=True)
class EnvInfo:
    """The env a target uses now (``ensure_env``/``rebuild_env``/``rollback_env`` result)."""

    target: str
    name: str
    managed: bool
    python: str
    path: str = ""
    env_hash: str = ""
    torch: str = ""
    torch_cuda: str = ""
    cuda_available: bool | None = None
    built: bool = False
    build_seconds: float = 0.0

    def describe(self) -> str:
        """``<path>, torch 2.11.0 (CUDA 13.0)`` for messages."""
        if not self.managed:
            return f"unmanaged ({self.python})"
        cuda = f" (CUDA {self.torch_cuda})" if self.torch_cuda else ""
        return f"{self.path}, torch {self.torch}{cuda}" if self.torch else self.path


def python_for(spec: TargetSpec) -> str:
    """The interpreter runs on ``spec`` use: the managed env's python, else ``commands.python``."""
    return spec.run_python


def load_env_def(repo_root: Path, name: str) -> EnvDef:
    """Read ``envs/<name>/`` of the repo; ConfigError when it is missing or malformed."""
    base = Path(repo_root) / "envs" / name
    try:
        pyproject = (base / "pyproject.toml").read_bytes()
        lock = (base / "uv.lock").read_bytes()
    except FileNotFoundError as err:
        raise ConfigError(
            f"env {name!r}: {err.filename} is missing; create envs/{name}/pyproject.toml and run "
            f"`uv lock` there (see envs/README.md), or fix the target's env key"
        ) from None
    try:
        project = tomllib.loads(pyproject.decode("utf-8")).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"envs/{name}/pyproject.toml: not valid TOML ({err}); fix it") from None
    requires = str(project.get("requires-python", "")).strip()
    if not requires:
        raise ConfigError(f'envs/{name}/pyproject.toml: set [project] requires-python (e.g. "==3.11.*")')
    return EnvDef(name, pyproject, lock, requires)


def def_tar(env_def: EnvDef) -> bytes:
    """The tar that carries an env definition (and the probe that runs there) to a target."""
    buf = io.BytesIO()
    files = {
        "pyproject.toml": env_def.pyproject,
        "uv.lock": env_def.lock,
        "env_probe.py": PROBE.read_bytes(),
    }
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def env_hash(lock: bytes, interp: dict[str, Any]) -> str:
    """Content address of a build: the lock, the exact interpreter and the platform."""
    digest = hashlib.sha256(lock)
    for key in ("implementation", "version", "system", "machine", "libc"):
        digest.update(b"\0" + str(interp.get(key, "")).encode())
    return digest.hexdigest()[:HASH_LEN]


def driver_cuda(nvidia_smi_output: str) -> tuple[int, int] | None:
    """The driver's CUDA version from the ``nvidia-smi`` header (``CUDA Version: 13.0``)."""
    m = CUDA_RE.search(nvidia_smi_output)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_mismatch(torch_cuda: str, driver: tuple[int, int] | None) -> str:
    """Why a torch built for ``torch_cuda`` cannot run on the driver, or "" when it can.

    A driver runs CUDA builds up to its own major.minor (newer minors of the same major only
    with reduced features): torch's CUDA major.minor must not exceed the driver's.
    """
    if not torch_cuda or driver is None:
        return ""
    parts = torch_cuda.split(".")
    try:
        built = (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0)
    except ValueError:
        return f"cannot read torch's CUDA version {torch_cuda!r}"
    if built > driver:
        return (
            f"torch is built for CUDA {built[0]}.{built[1]} but the driver supports CUDA "
            f"{driver[0]}.{driver[1]} (nvidia-smi); lock a torch for CUDA <= {driver[0]}.{driver[1]} "
            "(see envs/README.md) or update the driver"
        )
    return ""


@functools.cache
def controller_uv() -> tuple[str, str]:
    """(path, version) of the uv this controller pushes to targets without it.

    The controller venv's own uv first (``uv`` is a locked dependency: the version fleet was tested
    with), then the one on PATH (its real binary, not a pyenv/asdf shell shim).
    """
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("uv")
    if found is None:
        raise EnvError("uv is not installed on this machine; run ./bootstrap (it installs uv into .venv)")
    path = Path(found).resolve()
    if path.read_bytes()[:4] != b"\x7fELF":  # a shim script: ask uv itself where it lives
        out = subprocess.run(
            [found, "run", "--no-project", "--no-config", "--", "printenv", "UV"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0 or not out.stdout.strip():
            raise EnvError(f"{found} is a wrapper and the real uv binary was not found; set PATH to it")
        path = Path(out.stdout.strip()).resolve()
    version = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=True)
    return str(path), version.stdout.split()[1]


# --- uv's errors, one line each ----------------------------------------------------------------

_UV_CAUSE = re.compile(r"^\s*(?:error|cause|Caused by):\s*(.+?)\s*$", re.MULTILINE)
_UV_NO_WHEEL = re.compile(r"Distribution `([^ `]+)==([^ `]+) @")
_UV_ON_PLATFORM = re.compile(
    r"You're on \w+ \(`([^`]+)`\), but `[^`]+` \(v[^)]+\) only has wheels for the following platforms: (.+?);"
)
_UV_ENVIRONMENTS = re.compile(r"supported environments: (.+)$", re.MULTILINE)
_UV_PACKAGE = re.compile(r"`([A-Za-z0-9_.-]+==[^`\s]+)`")
_MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_")
_NETWORK_CAUSES = (
    "dns error",
    "Connection refused",
    "timed out",
    "operation timed out",
    "tunnel error",
    "Network is unreachable",
    "No route to host",
    "certificate",
    "Connection reset",
)


def _uv_causes(output: str) -> list[str]:
    """The ``error:`` line and its ``cause:`` chain, in order."""
    return [m.group(1) for m in _UV_CAUSE.finditer(output)]


def explain_uv_failure(output: str, env: str) -> str:
    """What went wrong in a failed ``uv sync --locked`` of ``envs/<env>`` and what to do, as one
    line, from uv's own (multi-line) output. Pure; tested on recorded real uv output."""
    where = f"envs/{env}"
    causes = _uv_causes(output)
    first = causes[0] if causes else (tail_lines(output, 1) or "no output")
    last = causes[-1] if causes else first
    if "needs to be updated, but `--locked` was provided" in output:
        return f"{where}/uv.lock is out of date with its pyproject.toml: run `uv lock` in {where}, commit it"
    if "not compatible with the lockfile's supported environments" in output:
        m = _UV_ENVIRONMENTS.search(output)
        locked = m.group(1).strip() if m else "other platforms"
        return (
            f"{where}/uv.lock is locked for {locked} only and this target is not one of them: add the "
            f"target's platform to [tool.uv] environments in {where}/pyproject.toml and run `uv lock` there"
        )
    if "doesn't have a source distribution or wheel for the current platform" in output:
        m, on = _UV_NO_WHEEL.search(output), _UV_ON_PLATFORM.search(output)
        dist = f"{m.group(1)} {m.group(2)}" if m else "a locked package"
        if on is None:
            return f"{dist} has no wheel for this target's platform: pin a version that has one in {where}"
        mine, theirs = on.group(1), on.group(2).replace("`", "")
        need = [tuple(map(int, g)) for g in _MANYLINUX.findall(theirs)]
        have = _MANYLINUX.search(mine)
        if need and have and tuple(map(int, have.groups())) < min(need):
            glibc = "{}.{}".format(*min(need))
            return (
                f"{dist} needs glibc >= {glibc} (its wheels: {theirs}) and this target has glibc "
                f"{have.group(1)}.{have.group(2)}: use a newer OS image there, or pin an older "
                f"{dist.split()[0]} in {where}"
            )
        return f"{dist} has no wheel for this target ({mine}; it has {theirs}): pin another one in {where}"
    if "Hash mismatch" in output:
        pkg = _UV_PACKAGE.search(output)
        what = pkg.group(1) if pkg else "a package"
        return (
            f"the file downloaded for {what} does not have the sha256 that {where}/uv.lock records (a proxy "
            f"or mirror served another file, or the lock was edited): check the index, or run `uv lock` again"
        )
    if "No space left on device" in output:
        return (
            "no space left on the target's disk (an env with torch needs ~6 GB, plus the uv cache): free "
            "space in the workdir, or put the uv cache on a larger disk (target key uv_cache)"
        )
    if "Failed to generate package metadata" in output and "@ path+" in output:
        return (
            f"{where} names a local file that this target does not have ({last}): take the package from "
            f"a registry in {where}/pyproject.toml and run `uv lock` there"
        )
    if ("Failed to download" in output or "Failed to fetch" in output) and any(
        k in output for k in _NETWORK_CAUSES
    ):
        pkg = _UV_PACKAGE.search(first)
        what = pkg.group(1) if pkg else "the locked packages"
        return (
            f"cannot download {what} from PyPI ({last}): give the target HTTPS access to pypi.org and "
            "files.pythonhosted.org (DNS, proxy, firewall), or share a uv cache that holds them "
            "(target key uv_cache, envs/README.md)"
        )
    return f"uv: {first}" + (f" ({last})" if last != first else "")


# --- target side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProvisionFacts:
    """What the provisioning probe found on a target (``parse_provision``)."""

    machine: str
    tmux: str  # "" when missing
    uv: dict[str, str]  # candidate path -> its version


def parse_provision(text: str) -> ProvisionFacts:
    """Parse ``remote/env_provision.sh``'s output (tab-separated lines). Pure."""
    machine, tmux, uv = "", "", {}
    for line in text.splitlines():
        kind, _, rest = line.partition("\t")
        if kind == "machine":
            machine = rest.strip()
        elif kind == "tmux":
            tmux = rest.strip()
        elif kind == "uv":
            path, _, version = rest.partition("\t")
            words = version.split()
            uv[path] = words[1] if len(words) > 1 else ""
    return ProvisionFacts(machine, tmux, uv)


class Provisioner:
    """Finds or installs what a target needs to build envs (uv, Python, tmux)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.spec = target.spec
        self.layout = target.spec.layout

    def uv_env(self, **extra: str) -> dict[str, str]:
        env = {
            "UV_PYTHON_INSTALL_DIR": posixpath.join(self.layout.workdir, "python"),
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_LINK_MODE": LINK_MODE,
            "UV_NO_CONFIG": "1",
            "UV_NO_PROGRESS": "1",
            "UV_SYSTEM_CERTS": "1",  # trust the target's CA store (TLS-inspecting proxies, mirrors)
        }
        cache = self.spec.uv_cache or ("" if self.spec.is_local else self.layout.uv_cache)
        if cache:  # a local target without uv_cache shares this machine's (warm) uv cache
            env["UV_CACHE_DIR"] = cache
        env.update(extra)
        return env

    def provision(self) -> tuple[str, str]:
        """(uv path, tmux version) on the target: one probe, then push uv / install tmux if needed."""
        _local, version = controller_uv()
        commands = self.spec.commands
        argv = remote.sh("env_provision.sh", commands.tmux, commands.uv, self.layout.uv_binary)
        facts = parse_provision(self.target.run(argv).stdout)
        uv = next((path for path, v in facts.uv.items() if v == version), "")
        if not uv:
            uv = self._push_uv(facts.machine, version)
        return uv, facts.tmux or self._install_tmux()

    def _push_uv(self, machine: str, version: str) -> str:
        local_path, _ = controller_uv()
        if machine != platform.machine():
            raise EnvError(
                f"{self.target.name}: needs uv {version} for {machine}; this machine's uv is for "
                f"{platform.machine()}; install uv {version} there and set commands.uv"
            )
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(local_path, arcname="uv")
        print(f"{self.target.name}: pushing uv {version} to {self.layout.uv_binary}", flush=True)
        self.target.put_tar(io.BytesIO(buf.getvalue()), posixpath.dirname(self.layout.uv_binary))
        return self.layout.uv_binary

    def _install_tmux(self) -> str:
        """Install tmux with apt-get in a container; elsewhere say how."""
        tmux, where = self.spec.commands.tmux, self.spec.display
        if self.spec.container is None:
            raise EnvError(
                f"{self.target.name}: tmux is not installed on {where} (`{tmux} -V` failed); install it "
                "(apt-get install tmux) or set commands.tmux; fleet installs it only in containers"
            )
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "tmux"]
        got = self.target.run_stream(install, env=env, check=False)
        if got.exit_code != 0:
            self.target.run_stream(["apt-get", "update", "-q"], env=env, check=False)
            got = self.target.run_stream(install, env=env, check=False)
        res = self.target.run([tmux, "-V"], check=False)
        if got.exit_code != 0 or res.exit_code != 0:
            raise EnvError(
                f"{self.target.name}: tmux is missing in {where} and `apt-get install tmux` failed "
                f"({tail_lines(got.stderr, 1) or 'no apt-get?'}); install it by hand"
            )
        return res.stdout.strip()

    def python_facts(self, uv: str, env_def: EnvDef, probe: str) -> dict[str, Any]:
        """The interpreter for the env: probe ``interp`` of the first Python on the target that
        matches requires-python (uv's discovery: the managed ones under ``<workdir>/python``, then
        PATH: ``python3``, ``python3.X``, ...). When none matches, uv is asked to download one (a
        standalone CPython from GitHub), which needs network; failing that, one line says what is
        there and what to install."""
        request = env_def.requires_python
        argv = remote.sh("env_find_python.sh", uv, request, probe)
        res = self.target.run(argv, env=self.uv_env(), check=False)
        if res.exit_code == 3:
            print(
                f"{self.target.name}: no Python matching {request!r} on {self.spec.display}; "
                "asking uv to download one",
                flush=True,
            )
            dl = self.uv_env(UV_PYTHON_DOWNLOADS="automatic")
            install = self.target.run([uv, "python", "install", request], env=dl, check=False)
            if install.exit_code != 0:
                raise EnvError(self._no_python(env_def, install.stderr))
            res = self.target.run(argv, env=self.uv_env(), check=False)
        return _loads(self.target, res, "interp")

    def _no_python(self, env_def: EnvDef, uv_output: str) -> str:
        python = self.spec.commands.python
        found = self.target.run([python, "-V"], check=False)
        there = (found.stdout or found.stderr).strip() if found.exit_code == 0 else "none"
        causes = _uv_causes(uv_output)
        why = causes[-1] if causes else (tail_lines(uv_output, 1) or "no output")
        return (
            f"{self.target.name}: no Python matching {env_def.requires_python!r} (requires-python of "
            f"envs/{env_def.name}) on {self.spec.display} (`{python} -V`: {there}) and uv could not "
            f"download one ({why}): install one there (Debian/Ubuntu: apt-get install python3; "
            "Debian 12+, Ubuntu 24.04+ and Proxmox VE 8+ ship a matching one)"
        )


def _loads(target: Target, res: CommandResult, what: str) -> dict[str, Any]:
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError:
        raise EnvError(
            f"{target.name}: env_probe.py {what} failed (exit {res.exit_code}): "
            f"{tail_lines(res.stderr or res.stdout, 2)}"
        ) from None
    if not isinstance(data, dict):
        raise EnvError(f"{target.name}: env_probe.py {what} printed no JSON object")
    return data


def _probe(target: Target, env_dir: str, *args: str) -> CommandResult:
    """Run this controller's env_probe.py with ``env_dir``'s own python.

    The script goes over on stdin (``python -I -``) rather than from the copy shipped into the
    env at build time: an env built by an older fleet is then checked by the current probe.
    """
    python = posixpath.join(env_dir, "bin", "python")
    env = Provisioner(target).uv_env()
    return target.run([python, "-I", "-", *args], env=env, check=False, stdin=PROBE.read_bytes())


def _info(target: Target, name: str, manifest: dict[str, Any], built: bool) -> EnvInfo:
    return EnvInfo(
        target=target.name,
        name=name,
        managed=True,
        python=target.spec.layout.env_python(name),
        path=str(manifest.get("path", "")),
        env_hash=str(manifest.get("env_hash", "")),
        torch=str(manifest.get("torch", "")),
        torch_cuda=str(manifest.get("torch_cuda", "")),
        cuda_available=manifest.get("cuda_available"),
        built=built,
        build_seconds=float(manifest.get("build_seconds", 0.0)),
    )


LOCK_QUIET_S = 3.0
LOCK_WAIT_S = 20.0  # one remote wait per this many seconds while another deploy builds


@contextlib.contextmanager
def build_lock(target: Target, name: str) -> Iterator[None]:
    """Hold the build lock of env ``name`` on ``target`` for the ``with`` block.

    Parallel first deploys would each download and install the same env; under the lock the second
    one waits, then its reuse check finds the first one's build. The lock is an flock held by a
    command whose stdin this controller keeps open (``env_lock.sh``): it ends with this block, or
    with this process or its connection, so a dead deploy never leaves a stale lock behind.
    """
    envs = target.spec.layout.envs
    lock = posixpath.join(envs, f".build-{name}.lock")
    token = secrets.token_hex(8)
    released = threading.Event()
    outcome: dict[str, Any] = {}

    def held_open() -> Iterator[bytes]:
        released.wait()
        yield from ()

    def hold() -> None:
        try:
            outcome["result"] = target.run(
                remote.sh("env_lock.sh", lock, token), stdin=held_open(), check=False
            )
        except Exception as err:  # surfaced by the waiting loop below, in the caller's thread
            outcome["error"] = err

    target.run(["mkdir", "-p", "--", envs])  # also opens the connection before a second thread uses it
    holder = threading.Thread(target=hold, name=f"env-lock-{name}", daemon=True)
    holder.start()

    def held(seconds: float) -> bool:
        """Whether the lock holds our token within ``seconds`` (one call, waiting on the target)."""
        if not holder.is_alive():
            if "error" in outcome:
                raise outcome["error"]
            res: CommandResult = outcome["result"]
            raise EnvError(
                f"{target.name}: could not take the build lock of env {name} ({lock}, exit "
                f"{res.exit_code}): {tail_lines(res.stderr or res.stdout, 1)}"
            )
        argv = remote.sh("env_lock_wait.sh", lock, token, str(int(seconds)))
        return target.run(argv, timeout=seconds + 60, check=False).stdout.strip() == "held"

    try:
        # Our own holder needs a moment (a command over the connection) to write its token: only
        # a lock still not ours after that is another deploy's.
        if not held(LOCK_QUIET_S):
            print(
                f"{target.name}: another deploy is building env {name}; waiting for it ({lock})", flush=True
            )
            while not held(LOCK_WAIT_S):
                pass
        yield
    finally:
        released.set()
        holder.join(30)


def build_env(target: Target, env_def: EnvDef, *, reuse: bool = True) -> EnvInfo:
    """Build ``env_def`` on ``target`` and make it current; the old current becomes ``previous``.

    ``reuse``: when a verified build of the same hash exists, switch to it instead of building.
    """
    started = time.monotonic()
    prov = Provisioner(target)
    layout = target.spec.layout
    staging = posixpath.join(layout.envs, f".staging-{env_def.name}-{secrets.token_hex(4)}")
    def_dir = posixpath.join(staging, DEF_DIR)
    venv = posixpath.join(staging, "venv")
    finalized = False
    with build_lock(target, env_def.name):
        try:
            target.put_tar(io.BytesIO(def_tar(env_def)), def_dir)
            uv, tmux = prov.provision()
            interp = prov.python_facts(uv, env_def, posixpath.join(def_dir, "env_probe.py"))
            ehash = env_hash(env_def.lock, interp)
            final_base = layout.env_dir(env_def.name, ehash)
            if reuse:
                res = _probe(target, final_base, "rollback", final_base, env_def.name)
                if res.exit_code == 0:  # a verified earlier build of this hash: switch back to it
                    return _info(
                        target, env_def.name, _loads(target, res, "rollback")["manifest"], built=False
                    )
            size = (
                " (with torch: ~3 GB to download into an empty uv cache, ~6 GB on disk)"
                if env_def.has_torch
                else ""
            )
            print(
                f"{target.name}: building env {env_def.name}-{ehash} (python {interp['version']}){size}",
                flush=True,
            )
            sync = [uv, "sync", "--locked", "--no-install-project", "--link-mode", LINK_MODE]
            argv = remote.sh("env_sync.sh", uv, interp["executable"], venv, *sync)
            # Captured, not streamed: uv's failure is a page of causes; the user gets one line from it,
            # and the whole output stays in a log on the target.
            res = target.run(argv, env=prov.uv_env(UV_PROJECT_ENVIRONMENT=venv), cwd=def_dir, check=False)
            if res.exit_code != 0:
                log = posixpath.join(layout.envs, env_def.name, "build-failed.log")
                target.run(remote.sh("save_stdin.sh", log), stdin=res.stderr.encode(), check=False)
                raise EnvError(
                    f"{target.name}: `uv sync --locked` of envs/{env_def.name} failed: "
                    f"{explain_uv_failure(res.stderr, env_def.name)}; the current env is unchanged "
                    f"(uv's output: {log})"
                )
            synced = time.monotonic()
            installed = re.search(r"^Installed (\d+) packages? in (.+)$", res.stderr, re.MULTILINE)
            manifest = _verify(target, env_def, venv, def_dir)
            manifest.update(
                env=env_def.name,
                env_hash=ehash,
                lock_sha256=env_def.lock_sha256,
                python=interp["version"],
                platform=f"{interp['system']}-{interp['machine']}-{interp['libc']}",
                uv=uv,
                tmux=tmux,
                built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                build_seconds=round(time.monotonic() - started, 1),
                verified=True,
            )
            probe = [posixpath.join(venv, "bin", "python"), "-I", posixpath.join(def_dir, "env_probe.py")]
            data = json.dumps(manifest).encode()
            res = target.run([*probe, "finalize", staging, final_base, env_def.name], stdin=data, check=False)
            done = _loads(target, res, "finalize")
            if res.exit_code != 0:
                raise EnvError(f"{target.name}: the new env could not be put in place: {done.get('error')}")
            finalized = True  # the probe removed the staging dir
            # The whole build's time: uv's "Installed N packages in 14s" leaves out resolving, downloading,
            # the venv and the verification, most of a first build.
            packages = f"{installed[1]} packages, " if installed else ""
            ended = time.monotonic()
            print(
                f"{target.name}: built env {env_def.name}-{ehash} in {ended - started:.0f}s "
                f"({packages}set-up and uv sync {synced - started:.0f}s, verification {ended - synced:.0f}s)",
                flush=True,
            )
            return _info(target, env_def.name, done["manifest"], built=True)
        finally:
            if not finalized:
                target.run(["rm", "-rf", "--", staging], check=False)


def _verify(target: Target, env_def: EnvDef, venv: str, def_dir: str) -> dict[str, Any]:
    """Run the shipped probe in the new venv; the manifest fields it yields. EnvError on failure."""
    python = posixpath.join(venv, "bin", "python")
    gpus = target.spec.gpus > 0
    args = ["verify", "--dists"] + (["--torch"] if env_def.has_torch else []) + (["--cuda"] if gpus else [])
    res = target.run([python, "-I", posixpath.join(def_dir, "env_probe.py"), *args], check=False)
    checked = _loads(target, res, "verify")
    if not checked.get("ok"):
        raise EnvError(
            f"{target.name}: the new env failed verification: {checked.get('error')}; not switched"
        )
    manifest: dict[str, Any] = {
        "installed": {d["name"]: d["version"] for d in checked["dists"]["dists"]},
        "synced_at": checked["dists"]["now"],
        "torch": checked.get("torch", ""),
        "torch_cuda": checked.get("torch_cuda", ""),
        "torch_arch_list": checked.get("torch_arch_list", []),
    }
    if gpus and env_def.has_torch:
        smi = target.run([target.spec.commands.nvidia_smi], check=False)
        driver = driver_cuda(smi.stdout) if smi.exit_code == 0 else None
        if driver is None:
            raise EnvError(
                f"{target.name}: gpus = {target.spec.gpus} but `{target.spec.commands.nvidia_smi}` gave no "
                f"CUDA version ({tail_lines(smi.stderr, 1)}); check the driver or commands.nvidia_smi"
            )
        manifest["driver_cuda"] = f"{driver[0]}.{driver[1]}"
        why = cuda_mismatch(manifest["torch_cuda"], driver)
        if why:
            raise EnvError(f"{target.name}: envs/{env_def.name}: {why}; not switched")
        if not checked.get("cuda_available"):
            raise EnvError(
                f"{target.name}: torch {manifest['torch']} in the new env cannot see the GPUs "
                "(torch.cuda.is_available() is False); not switched"
            )
        manifest["cuda_available"] = True
        caps = target.run([target.spec.commands.nvidia_smi, *CAPS_QUERY], check=False)
        answer = {"exit_code": caps.exit_code, "output": caps.stdout + caps.stderr}
        why, _ = gpu_arch_problem(env_def.name, manifest, answer)
        if why:
            raise EnvError(f"{target.name}: {why}; not switched")
    return manifest


CAPS_QUERY = (f"--query-gpu={','.join(CAPS_FIELDS)}", "--format=csv")


def gpu_arch_problem(env: str, manifest: dict[str, Any], caps: dict[str, Any] | None) -> tuple[str, str]:
    """(why the env's torch cannot run on the GPUs, a note when that could not be told): from the
    manifest's ``torch_arch_list`` and ``nvidia-smi``'s compute capabilities (``caps``: its exit
    code and output, None on a CPU target)."""
    torch = str(manifest.get("torch", ""))
    if caps is None or not torch or not manifest.get("torch_cuda"):
        return "", ""  # no GPUs, no torch, or a CPU-only torch (`fab doctor` names that one)
    arch_list = [str(a) for a in manifest.get("torch_arch_list") or []]
    if not arch_list:
        return "", (
            f"env {env}'s manifest does not record torch's GPU architectures (built by an older fleet): "
            "`fab env-rebuild` records them"
        )
    try:
        gpus = parse_caps(str(caps.get("output", ""))) if caps.get("exit_code") == 0 else None
    except ValueError:
        gpus = None
    if not gpus:
        said = tail_lines(str(caps.get("output", "")), 1) or f"exit {caps.get('exit_code')}"
        return "", f"the GPUs' compute capability was not read (nvidia-smi compute_cap: {said})"
    why = arch_mismatch(env, torch, arch_list, gpus)
    jit = jit_only(arch_list, gpus)
    if why or not jit:
        return why, ""
    caps_seen = ", ".join(sorted({sm(g.cap) for g in jit}))
    return "", (
        f"env {env}'s torch has only PTX for {caps_seen} (no cubin): the driver JIT-compiles every kernel "
        "at first use (slow first start); a torch built for it avoids that"
    )


# --- the public operations (called by tasks.py) ------------------------------------------------


def _require_env(target: Target) -> str:
    name = target.spec.env
    if not name:
        raise EnvError(
            f'{target.name}: no managed env (env = ""; runs use commands.python); '
            f"set targets.{target.name}.env to a directory of envs/"
        )
    return name


def _check_data(target: Target, name: str, full: bool) -> dict[str, Any] | None:
    """The probe's ``check`` output for the current env (with the GPUs' compute capabilities on a
    GPU target); None when there is no built env."""
    spec = target.spec
    current = spec.layout.env_current(name)
    args = ["--full"] if full else []
    if spec.gpus > 0:
        args += ["--smi", spec.commands.nvidia_smi, "--smi-timeout", f"{spec.gpu_gate.timeout_s:g}"]
    res = _probe(target, current, "check", current, *args)
    damaged = _probe_error(res) if res.exit_code == 2 else ""
    if "is not JSON" in damaged:
        # The build is there but its record is junk: name the record, not the env, as the cause.
        why = damaged.removeprefix("ValueError: ")
        raise EnvError(f"{target.name}: the env at {current}: {why}; run `fab env-rebuild`")
    if res.exit_code in (126, 127) or (res.exit_code == 2 and "manifest.json" in res.stdout):
        return None
    if res.exit_code != 0:
        raise EnvError(
            f"{target.name}: the env at {current} does not run ({tail_lines(res.stderr or res.stdout, 2)}); "
            "run `fab env-rebuild`"
        )
    return _loads(target, res, "check")


def _probe_error(res: CommandResult) -> str:
    """The ``error`` of the probe's ``{"ok": false, ...}`` answer; "" when it gave none."""
    try:
        data = json.loads(res.stdout)
    except ValueError:
        return ""
    return str(data.get("error", "")) if isinstance(data, dict) else ""


def _report(target: Target, name: str, env_def: EnvDef, data: dict[str, Any], full: bool) -> DriftReport:
    manifest = data["manifest"]
    lock = parse_lock(env_def.lock.decode("utf-8"), f"envs/{name}/uv.lock")
    diffs = diff_env(lock, list(manifest.get("installed", {})), data["dists"], data["modified"])
    uv_status, uv_lines = parse_uv_check(data["uv_check"]["exit_code"], data["uv_check"]["output"])
    notes = () if full else ("files were hashed only where changed since the build; --full hashes all",)
    caps = data.get("gpu_caps") if target.spec.gpus > 0 else None
    gpu_arch, arch_note = gpu_arch_problem(name, manifest, caps)
    if arch_note:
        notes = (*notes, arch_note)
    return DriftReport(
        target=target.name,
        env=name,
        path=str(manifest.get("path", "")),
        env_hash=str(manifest.get("env_hash", "")),
        stale_lock=manifest.get("lock_sha256") != env_def.lock_sha256,
        uv_check=uv_status,
        uv_lines=uv_lines,
        checked=len(data["dists"]),
        hashed_files=int(data.get("hashed_files", 0)),
        notes=notes,
        gpu_arch=gpu_arch,
        **diffs,
    )


def check_env(target: Target, repo_root: Path, *, full: bool = False) -> DriftReport:
    """Compare the target's current venv with ``envs/<name>/uv.lock`` (one round trip)."""
    name = _require_env(target)
    env_def = load_env_def(repo_root, name)
    data = _check_data(target, name, full)
    if data is None:
        current = target.spec.layout.env_current(name)
        raise EnvError(
            f"{target.name}: env {name} is not built ({current} is missing); run `fab env-rebuild`"
        )
    return _report(target, name, env_def, data, full)


def ensure_env(target: Target, repo_root: Path) -> EnvInfo:
    """The env runs on ``target`` use: built when missing (or its lock changed); EnvError on drift
    or when its torch has no kernel for the GPUs' architecture."""
    spec = target.spec
    if not spec.env:
        return EnvInfo(target=target.name, name="", managed=False, python=spec.commands.python)
    env_def = load_env_def(repo_root, spec.env)
    data = _check_data(target, spec.env, full=False)
    if data is None or data["manifest"].get("lock_sha256") != env_def.lock_sha256:
        info = build_env(target, env_def)
        if info.built:
            return info
        data = _check_data(target, spec.env, full=False)  # an earlier build was reused: check it
        assert data is not None
    _refuse_unfit(target, _report(target, spec.env, env_def, data, full=False))
    return _info(target, spec.env, data["manifest"], built=False)


def _refuse_unfit(target: Target, report: DriftReport) -> None:
    """EnvError when the env drifted from its lock or its torch has no kernel for the GPUs."""
    if report.drift:
        raise EnvError(
            f"{target.name}: env {report.env} ({report.path}) has drifted from envs/{report.env}/uv.lock "
            f"({report.summary()}); run `fab env-rebuild`"
        )
    if report.gpu_arch:
        raise EnvError(f"{target.name}: refused: {report.gpu_arch}")


def refuse_drift(target: Target, repo_root: Path) -> None:
    """``fab train`` on a managed env: EnvError when it drifted from its lock or has no kernel for
    the GPUs' architecture, as ``fab deploy`` says."""
    spec = target.spec
    if not spec.env:
        return
    _refuse_unfit(target, check_env(target, repo_root))


def rebuild_env(target: Target, repo_root: Path) -> EnvInfo:
    """Build a fresh venv next to the current one; switch only after it verified."""
    name = _require_env(target)
    return build_env(target, load_env_def(repo_root, name), reuse=False)


def rollback_env(target: Target) -> EnvInfo:
    """Make the previous env current again (the current one becomes previous)."""
    name = _require_env(target)
    previous = posixpath.join(target.spec.layout.envs, name, "previous")
    res = _probe(target, previous, "rollback", previous, name)
    if res.exit_code in (126, 127):
        raise EnvError(f"{target.name}: env {name} has no previous build to roll back to ({previous})")
    data = _loads(target, res, "rollback")
    if res.exit_code != 0:
        raise EnvError(f"{target.name}: the previous env {previous} is unusable ({data.get('error')})")
    return _info(target, name, data["manifest"], built=False)


def gc_envs(target: Target) -> list[str]:
    """Remove env dirs that no ``current``/``previous`` link, release or run refers to."""
    name = _require_env(target)
    layout = target.spec.layout
    res = _probe(target, layout.env_current(name), "gc", layout.workdir)
    data = _loads(target, res, "gc")
    if res.exit_code != 0:
        raise EnvError(f"{target.name}: env gc failed: {data.get('error')}")
    return list(data["removed"])


__all__ = [
    "DriftReport",
    "EnvDef",
    "EnvInfo",
    "build_env",
    "check_env",
    "ensure_env",
    "gc_envs",
    "load_env_def",
    "python_for",
    "rebuild_env",
    "rollback_env",
]
