"""What an interpreter or a venv on a target holds, as one JSON object on stdout.

Shipped to the target inside every env definition tar (``<env>/fleet-env/env_probe.py``) and run
there as a script by the interpreter it describes (``python -I env_probe.py <command>``). Standard
library only: it must run in a bare interpreter and in a venv that holds anything, or nothing.

Commands:

``interp``
    This interpreter: version, implementation, machine, system, libc (hashed into the env path).
``dists [--since TS] [--full] [--no-files]``
    Every distribution in this interpreter's site-packages (name, version, INSTALLER, dist-info
    path) and the files that differ from their RECORD: missing, of another size, or, when their
    mtime or ctime is newer than ``--since`` (or always with ``--full``), of another sha256.
``verify [--torch] [--cuda] [--import MODULE ...] [--dists]``
    Import modules; with ``--torch`` report torch's version, its CUDA build, the architectures its
    kernels are built for (``torch.cuda.get_arch_list()``) and (``--cuda``)
    ``torch.cuda.is_available()`` and the device count. Exit 1 with ``{"ok": false, "error": ...}``
    when an import fails.
``check ENV_DIR [--full] [--smi NVIDIA_SMI [--smi-timeout S]]``
    For ``fab env-check``, one round trip: the env's manifest, ``dists`` since its build, the
    output of ``uv sync --locked --check`` (run by this script, with the caller's UV_* variables)
    and, with ``--smi``, the GPUs' compute capabilities (``nvidia-smi --query-gpu=...compute_cap``).
``finalize STAGING FINAL_BASE NAME`` (manifest JSON on stdin)
    Write the manifest into the verified staging venv, rename it to ``FINAL_BASE`` (or
    ``FINAL_BASE-N`` when taken), switch ``envs/NAME/current`` (old one -> ``previous``).
``rollback ENV_DIR NAME``
    Run by ENV_DIR's own python (so it is known to start): make that verified build (or the
    ``previous`` link's) current for env NAME.
``refs WORKDIR`` / ``gc WORKDIR``
    The env directories under ``WORKDIR/envs`` and the ones that ``current``/``previous`` links,
    release and run JSON files name; ``gc`` removes the others.

Errors a user can cause (no manifest, a dangling link) print ``{"ok": false, "error": ...}``, exit 2.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV_DIR_RE = re.compile(r"\benvs/([A-Za-z0-9_-]+-[0-9a-f]{16}(?:-[0-9]+)?)\b")
BUFFER = 1024 * 1024
DEF_DIR = "fleet-env"


def normalize_name(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def interp_info() -> dict[str, Any]:
    libc_name, libc_version = platform.libc_ver()
    return {
        "version": platform.python_version(),
        "implementation": sys.implementation.name,
        "machine": platform.machine(),
        "system": platform.system(),
        "libc": f"{libc_name}-{libc_version}" if libc_name else "",
        "executable": sys.executable,
        "prefix": sys.prefix,
        "now": time.time(),
    }


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    seen: list[Path] = []
    for key in ("purelib", "platlib"):
        path = Path(paths[key])
        if path.is_dir() and path not in seen:
            seen.append(path)
    return seen


def parse_record(text: str) -> list[tuple[str, str, int | None]]:
    """RECORD rows (CSV) as (path, hash, size); hash is ``algo=b64`` or ``""``, size None when absent."""
    rows = []
    for row in csv.reader(text.splitlines()):
        if not row or not row[0]:
            continue
        hash_value = row[1] if len(row) > 1 else ""
        size = row[2].strip() if len(row) > 2 else ""
        rows.append((row[0], hash_value, int(size) if size.isdigit() else None))
    return rows


def file_digest(path: str, algo: str) -> str:
    digest = hashlib.new(algo)
    with open(path, "rb") as handle:
        while chunk := handle.read(BUFFER):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def check_record(site: Path, dist_info: Path, since: float | None, full: bool) -> tuple[list[dict], int]:
    """Files of one distribution that differ from its RECORD, and how many were hashed."""
    record = dist_info / "RECORD"
    dist = dist_info.name
    try:
        rows = parse_record(record.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [{"dist": dist, "path": "RECORD", "reason": "missing RECORD"}], 0
    problems: list[dict] = []
    hashed = 0
    base = str(site)
    for rel, hash_value, size in rows:
        if not hash_value or rel.endswith(".pyc"):
            continue
        path = os.path.join(base, rel)  # plain strings: pathlib costs more than the stat here
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problems.append({"dist": dist, "path": rel, "reason": "missing"})
            continue
        if size is not None and st.st_size != size:
            problems.append({"dist": dist, "path": rel, "reason": f"size {st.st_size} != {size}"})
            continue
        touched = since is None or max(st.st_mtime, st.st_ctime) > since
        if not (full or touched):
            continue
        algo, _, expected = hash_value.partition("=")
        if algo not in hashlib.algorithms_available:
            continue
        hashed += 1
        if file_digest(path, algo) != expected:
            problems.append({"dist": dist, "path": rel, "reason": f"{algo} differs"})
    return problems, hashed


def parse_metadata_head(lines: Iterable[str]) -> tuple[str, str]:
    """Name and Version from the header block of a METADATA file (stops at the first blank line)."""
    name, version = "", ""
    for line in lines:
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if not sep:
            continue
        if key == "Name":
            name = value.strip()
        elif key == "Version":
            version = value.strip()
        if name and version:
            break
    return name, version


def read_dist(dist_info: Path) -> dict[str, Any]:
    meta_path = dist_info / "METADATA"
    name, version = "", ""
    if meta_path.is_file():
        with meta_path.open(encoding="utf-8", errors="replace") as handle:
            name, version = parse_metadata_head(handle)
    if not name:  # a broken dist-info: fall back to its directory name, name-version.dist-info
        stem = dist_info.name[: -len(".dist-info")]
        name, _, version = stem.partition("-")
    installer_path = dist_info / "INSTALLER"
    installer = installer_path.read_text(encoding="utf-8").strip() if installer_path.is_file() else ""
    return {
        "name": normalize_name(name),
        "version": version.strip(),
        "installer": installer,
        "dist_info": dist_info.name,
    }


def dists_info(since: float | None, full: bool, files: bool = True) -> dict[str, Any]:
    dists: list[dict[str, Any]] = []
    modified: list[dict[str, Any]] = []
    hashed = 0
    sites = site_dirs()
    for site in sites:
        for dist_info in sorted(site.glob("*.dist-info")):
            if not dist_info.is_dir():
                continue
            dists.append(read_dist(dist_info))
            if not files:
                continue
            problems, count = check_record(site, dist_info, since, full)
            modified.extend(problems)
            hashed += count
        for egg in sorted(site.glob("*.egg-info")):
            stem = egg.name[: -len(".egg-info")]
            name, _, version = stem.partition("-")
            dists.append(
                {"name": normalize_name(name), "version": version, "installer": "", "dist_info": egg.name}
            )
    return {
        "sites": [str(s) for s in sites],
        "dists": dists,
        "modified": modified,
        "hashed_files": hashed,
        "now": time.time(),
    }


def verify(modules: list[str], want_torch: bool, want_cuda: bool) -> tuple[dict[str, Any], int]:
    result: dict[str, Any] = {"ok": True, "imported": [], "python": platform.python_version()}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # any import failure is the answer, reported as data
            return {"ok": False, "error": f"import {name}: {type(err).__name__}: {err}"}, 1
        result["imported"].append(name)
    if want_torch:
        try:
            torch = importlib.import_module("torch")
        except Exception as err:  # as above: the failure is the report
            return {"ok": False, "error": f"import torch: {type(err).__name__}: {err}"}, 1
        result["imported"].append("torch")
        result["torch"] = str(torch.__version__)
        result["torch_cuda"] = torch.version.cuda or ""
        # The kernels' architectures (sm_XY cubins, compute_XY PTX): the build's, no GPU needed
        arch = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
        if torch.version.cuda and not arch:  # older torch lists them only where CUDA is available
            arch = str(getattr(torch._C, "_cuda_getArchFlags", lambda: "")() or "").split()
        result["torch_arch_list"] = arch
        if want_cuda:
            result["cuda_available"] = bool(torch.cuda.is_available())
            result["device_count"] = int(torch.cuda.device_count()) if result["cuda_available"] else 0
    return result, 0


def env_refs(workdir: Path) -> dict[str, Any]:
    envs_dir = workdir / "envs"
    present = sorted(p.name for p in envs_dir.iterdir() if p.is_dir() and ENV_DIR_RE.search(f"envs/{p.name}"))
    referenced: set[str] = set()
    sources = [*workdir.glob("releases/*/*.json"), *workdir.glob("runs/*/*.json")]
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        referenced.update(m.group(1) for m in ENV_DIR_RE.finditer(text))
    for link in envs_dir.glob("*/*"):
        if link.is_symlink():
            referenced.add(os.path.basename(os.readlink(link)))
    referenced.update(live_env_refs())
    return {"present": present, "referenced": sorted(referenced)}


def live_env_refs(proc: Path = Path("/proc")) -> set[str]:
    """Env dirs that running processes use: mapped libraries (torch's .so files) and open files.

    A run started through ``envs/<name>/current`` keeps using the build it resolved at start,
    even after ``current`` moved on; ``gc`` must not delete that build under it.
    """
    found: set[str] = set()
    for pid_dir in proc.glob("[0-9]*"):
        try:
            found.update(m.group(1) for m in ENV_DIR_RE.finditer((pid_dir / "maps").read_text()))
            for fd in os.listdir(pid_dir / "fd"):
                target = os.readlink(pid_dir / "fd" / fd)
                found.update(m.group(1) for m in ENV_DIR_RE.finditer(target))
        except OSError:  # the process ended, or is not ours to read
            continue
    return found


def gc(workdir: Path) -> dict[str, Any]:
    """Remove the env dirs nothing refers to (see ``env_refs``)."""
    refs = env_refs(workdir)
    removed = [name for name in refs["present"] if name not in refs["referenced"]]
    for name in removed:
        shutil.rmtree(workdir / "envs" / name)
    return {"removed": removed, "kept": refs["referenced"]}


# --- switching (atomic: a new symlink renamed over the old one) ---------------------------------


def switch_link(link: Path, dest_name: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(os.path.join("..", dest_name), tmp)
    os.replace(tmp, link)


def make_current(envs_dir: Path, name: str, dest: str) -> str:
    """Point ``<name>/current`` at ``dest``; the old target becomes ``<name>/previous``. Returns it."""
    current = envs_dir / name / "current"
    old = os.path.basename(os.readlink(current)) if current.is_symlink() else ""
    if old != dest:
        switch_link(current, dest)
        if old:
            switch_link(envs_dir / name / "previous", old)
    return old


def finalize(staging: Path, final_base: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Put a verified build in place: manifest, rename to a free ``<name>-<hash>[-N]``, switch."""
    venv = staging / "venv"
    final, n = final_base, 1
    while final.exists() or final.is_symlink():
        n += 1
        final = final_base.with_name(f"{final_base.name}-{n}")
    manifest = dict(manifest, path=str(final))
    os.replace(staging / DEF_DIR, venv / DEF_DIR)
    (venv / DEF_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.rename(venv, final)
    previous = make_current(final.parent, name, final.name)
    shutil.rmtree(staging, ignore_errors=True)
    return {"path": str(final), "previous": previous, "manifest": manifest}


def read_manifest(env_dir: Path) -> dict[str, Any]:
    """The build's manifest. A missing one propagates as OSError (no build there); a damaged one
    is named as such: the env itself may run fine, and "does not run" would send the user astray."""
    path = env_dir / DEF_DIR / "manifest.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise ValueError(f"its manifest {path} is not JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"its manifest {path} is not JSON of a build (not an object)")
    return manifest


def rollback(env_dir: Path, name: str) -> dict[str, Any]:
    """Make ``env_dir`` (a build, or the ``previous`` link; run by its own python) current for ``name``."""
    real = Path(os.path.realpath(env_dir))
    manifest = read_manifest(real)
    if not manifest.get("verified"):
        raise ValueError(f"{real} was never verified")
    old = make_current(real.parent, name, real.name)
    return {"path": str(real), "previous": old, "manifest": manifest}


def gpu_caps(smi: str, timeout_s: float) -> dict[str, Any]:
    """``nvidia-smi --query-gpu=index,name,compute_cap`` (the GPUs' architectures), as data."""
    argv = [smi, "--query-gpu=index,name,compute_cap", "--format=csv"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"exit_code": 124, "output": f"{smi}: no answer within {timeout_s:g} s"}
    except OSError as err:
        return {"exit_code": 127, "output": f"{smi}: {err}"}
    return {"exit_code": done.returncode, "output": done.stdout + done.stderr}


def check(env_dir: Path, full: bool, smi: str = "", smi_timeout: float = 10.0) -> dict[str, Any]:
    """Everything ``fab env-check`` needs, in one round trip: manifest, dists, ``uv sync --check``
    and, with ``smi``, the GPUs' compute capabilities."""
    manifest = read_manifest(env_dir)
    since = None if full else float(manifest.get("synced_at", 0))
    uv_bin = str(manifest.get("uv") or "uv")
    argv = [uv_bin, "sync", "--locked", "--check", "--no-install-project", "--offline"]
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(env_dir))
    uv: subprocess.Popen[str] | None = None
    uv_check: dict[str, Any] = {"exit_code": 127, "output": ""}
    try:  # uv checks while this process walks the RECORDs
        uv = subprocess.Popen(
            argv, cwd=env_dir / DEF_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as err:
        uv_check["output"] = f"{uv_bin}: {err}"
    out = dists_info(since, full)
    if uv is not None:
        try:
            output, _ = uv.communicate(timeout=120)
            uv_check = {"exit_code": uv.returncode, "output": output}
        except subprocess.TimeoutExpired:
            uv.kill()
            uv.communicate()
            uv_check["output"] = f"{uv_bin}: no answer within 120 s"
    out["manifest"] = manifest
    out["uv_check"] = uv_check
    if smi:
        out["gpu_caps"] = gpu_caps(smi, smi_timeout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env_probe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("interp")
    p_dists = sub.add_parser("dists")
    p_dists.add_argument("--since", type=float, default=None)
    p_dists.add_argument("--full", action="store_true", help="hash every file, whatever its times")
    p_dists.add_argument("--no-files", action="store_true", help="list distributions only")
    p_verify = sub.add_parser("verify")
    p_verify.add_argument("--torch", action="store_true")
    p_verify.add_argument("--cuda", action="store_true")
    p_verify.add_argument("--import", dest="modules", action="append", default=[])
    p_verify.add_argument("--dists", action="store_true", help="also list the distributions")
    p_check = sub.add_parser("check")
    p_check.add_argument("env_dir", type=Path)
    p_check.add_argument("--full", action="store_true")
    p_check.add_argument("--smi", default="", help="nvidia-smi: also read the GPUs' compute capabilities")
    p_check.add_argument("--smi-timeout", type=float, default=10.0)
    p_final = sub.add_parser("finalize", help="manifest JSON on stdin")
    p_final.add_argument("staging", type=Path)
    p_final.add_argument("final_base", type=Path)
    p_final.add_argument("name")
    p_roll = sub.add_parser("rollback")
    p_roll.add_argument("env_dir", type=Path)
    p_roll.add_argument("name")
    for name in ("refs", "gc"):
        sub.add_parser(name).add_argument("workdir", type=Path)
    args = parser.parse_args(argv)
    code = 0
    try:
        if args.command == "interp":
            out = interp_info()
        elif args.command == "dists":
            out = dists_info(args.since, args.full, not args.no_files)
        elif args.command == "verify":
            out, code = verify(args.modules, args.torch, args.cuda)
            if args.dists and code == 0:
                out["dists"] = dists_info(None, False, files=False)
        elif args.command == "check":
            out = check(args.env_dir, args.full, args.smi, args.smi_timeout)
        elif args.command == "finalize":
            out = finalize(args.staging, args.final_base, args.name, json.load(sys.stdin))
        elif args.command == "rollback":
            out = rollback(args.env_dir, args.name)
        elif args.command == "refs":
            out = env_refs(args.workdir)
        else:
            out = gc(args.workdir)
    except (OSError, ValueError) as err:  # a missing manifest, a broken link: reported as data
        out, code = {"ok": False, "error": f"{type(err).__name__}: {err}"}, 2
    json.dump(out, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
