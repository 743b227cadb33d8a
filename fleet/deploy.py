"""Versioned deploys: one tar stream -> ``releases/<id>/`` -> atomic switch of ``current`` -> prune.

A deploy costs two commands on the target (two SSH round trips), both fixed scripts from
``fleet/remote/`` run as ``sh -c <script> <name> <args...>`` (arguments positional, never interpolated):

1. ``deploy_prepare.sh``: create the workdir skeleton, report the existing releases, where
   ``current`` points and the release of a live run;
2. ``deploy_install.sh`` with the release as one tar stream on stdin (``training/``,
   ``remote/run.sh``, ``fleet-run.json``, ``MANIFEST.json`` last): take the workdir's deploy lock
   (``flock -n .deploy.lock``; a second deploy at the same time fails at once, exit 75, nothing
   touched), remove leftovers of killed deploys (``releases/.tmp-*``), extract into
   ``releases/.tmp-<id>/``, check the manifest arrived, ``mv -T`` it to ``releases/<id>``, point a new
   symlink at it under a temporary name and ``mv -T`` that onto ``current`` (one rename(2): readers
   see the old release or the new one, never neither), then prune to exactly ``keep_releases``
   (``releases_to_prune``'s rule, applied under the lock to what is really there).

A deploy killed or cut before that last rename leaves the previous release current and intact.
Release ids are ``YYYYmmddTHHMMSSZ-<sha7>[-dirty]`` and sort by time: the timestamp is bumped past
the newest existing release, and the install step checks under the lock that the id is still new
(two deploys that prepared in the same second get distinct ids: the later one proposes again).
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fleet import remote
from fleet.errors import CommandFailed, DeployError, DiskFull
from fleet.inventory import TargetSpec
from fleet.layout import RUN_SESSION
from fleet.target import Target
from training import contract

RELEASE_ID_RE = re.compile(r"^(\d{8}T\d{6}Z)-([0-9a-f]{7})(-dirty)?$")
TIME_FORMAT = "%Y%m%dT%H%M%SZ"
NO_COMMIT_SHA = "0000000"
SHIPPED_PACKAGE = "training"
RUN_SPEC_FILE = "fleet-run.json"
MANIFEST_FILE = "MANIFEST.json"
SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".ruff_cache"})
SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class GitInfo:
    """What git says about the working tree a release is built from."""

    sha: str | None  # full sha of HEAD; None outside git or before the first commit
    dirty: bool
    diff_sha256: str | None  # sha256 of `git diff HEAD` (None without a HEAD)

    @property
    def sha7(self) -> str:
        return self.sha[:7] if self.sha else NO_COMMIT_SHA


@dataclass(frozen=True)
class Release:
    """A release on a target: its id, absolute path and manifest (the parsed MANIFEST.json)."""

    id: str
    path: str
    manifest: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    live_release: str | None = None  # deploy: the release a live run stays on (not this one)

    @property
    def git_sha(self) -> str | None:
        sha = self.manifest.get("git_sha")
        return sha if isinstance(sha, str) else None

    @property
    def dirty(self) -> bool:
        return bool(self.manifest.get("dirty"))


@dataclass(frozen=True)
class RemoteState:
    """What ``deploy_prepare.sh`` reports: the release ids present and ``current``'s link text."""

    current: str | None
    releases: tuple[str, ...]
    live_release: str | None = None  # the release of the run live in the tmux session, if any
    latest_release: str | None = None  # the release of runs/latest, live or not (it may be resumed)

    @property
    def current_id(self) -> str | None:
        return release_id_from_link(self.current)


# --- pure helpers (unit-tested) --------------------------------------------------------------------


def release_id_from_link(link: str | None) -> str | None:
    """``releases/<id>`` (or an absolute path ending so) -> ``<id>``; None for anything else."""
    if not link:
        return None
    name = link.rstrip("/").rsplit("/", 1)[-1]
    return name if RELEASE_ID_RE.match(name) else None


def make_release_id(now: dt.datetime, sha7: str, dirty: bool, existing: Iterable[str] = ()) -> str:
    """``YYYYmmddTHHMMSSZ-<sha7>[-dirty]``, its time bumped past every existing release id.

    Bumping (instead of adding a counter) keeps ids in the fixed format and sorted by time, so
    two deploys in the same second, or a target whose clock is behind, still get a fresh id.
    """
    stamp = now.astimezone(dt.UTC).replace(microsecond=0, tzinfo=None)
    newest = None
    for rid in existing:
        m = RELEASE_ID_RE.match(rid)
        if m:
            t = dt.datetime.strptime(m.group(1), TIME_FORMAT)
            newest = t if newest is None or t > newest else newest
    if newest is not None and stamp <= newest:
        stamp = newest + dt.timedelta(seconds=1)
    return f"{stamp.strftime(TIME_FORMAT)}-{sha7}{'-dirty' if dirty else ''}"


def releases_to_prune(existing: Iterable[str], keep: int, protected: Iterable[str | None] = ()) -> list[str]:
    """The release ids to delete so that exactly ``keep`` remain (the rule deploy_install.sh applies).

    Only names in the release-id format are ever considered (nothing else in ``releases/`` is
    touched). Protected releases (the new one, one a live run uses) are never deleted and count
    towards ``keep``; the newest of the others fill the remaining places.
    """
    ids = sorted((r for r in set(existing) if RELEASE_ID_RE.match(r)), reverse=True)
    guarded = {p for p in protected if p in ids}
    others = [r for r in ids if r not in guarded]
    return sorted(others[max(max(keep, 1) - len(guarded), 0) :])


def parse_prepare_output(text: str) -> RemoteState:
    """Parse ``deploy_prepare.sh`` output (pure)."""
    parts = remote.parse_answers(text)
    if "end" not in parts:
        raise DeployError(f"unexpected output from the deploy preparation step: {text[-200:]!r}")
    current = remote.ok_output(parts, "current").strip() or None
    releases = tuple(line.strip() for line in remote.ok_output(parts, "releases").splitlines())
    releases = tuple(line for line in releases if line)
    live = any(line.split()[:1] == ["0"] for line in remote.ok_output(parts, "pane").splitlines())
    try:
        run = json.loads(remote.ok_output(parts, "run_json") or "{}")
    except json.JSONDecodeError:
        run = {}
    release = run.get("release") if isinstance(run, dict) else None
    latest_release = release if isinstance(release, str) and RELEASE_ID_RE.match(release) else None
    live_release = latest_release if live else None
    return RemoteState(
        current=current, releases=releases, live_release=live_release, latest_release=latest_release
    )


def git_info(repo_root: Path) -> GitInfo:
    """The HEAD sha, dirty flag and a hash of ``git diff HEAD`` (argv-only git calls)."""

    def git(*args: str) -> subprocess.CompletedProcess[bytes]:
        try:
            return subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, check=False)
        except FileNotFoundError:
            return subprocess.CompletedProcess(args, 127, b"", b"git not found")

    head = git("rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    sha = head.stdout.decode().strip() if head.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=normal")
    if status.returncode != 0:  # not a git repository at all
        return GitInfo(sha=None, dirty=True, diff_sha256=None)
    if sha is None:
        return GitInfo(sha=None, dirty=True, diff_sha256=None)
    diff = git("diff", "HEAD", "--binary")
    diff_hash = hashlib.sha256(diff.stdout).hexdigest() if diff.returncode == 0 else None
    return GitInfo(sha=sha, dirty=bool(status.stdout.strip()), diff_sha256=diff_hash)


def run_spec_document(spec: TargetSpec) -> dict[str, Any]:
    """The target's run spec as shipped in ``fleet-run.json`` (env keys only, never values)."""
    return {
        "target": spec.name,
        "module": spec.run.module,
        "config": spec.run.config,
        "overrides": list(spec.run.overrides),
        "env_keys": sorted(spec.run.env),
        "env": spec.env,
        "python": spec.run_python,
        "gpus": spec.gpus,
        "topology": str(spec.topology) if spec.topology else None,
    }


def _walk_package(root: Path) -> list[tuple[str, Path]]:
    """(arcname, path) of every file of ``root`` to ship, sorted, skipping caches."""
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(SKIP_SUFFIXES):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                files.append((path.relative_to(root.parent).as_posix(), path))
    return files


def _add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes, mode: int, mtime: float) -> None:
    info = tarfile.TarInfo(arcname)
    info.size = len(data)
    info.mode = mode
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))


RELEASE_REMOTE = ("run.sh", "run_notify.py", "run_cause.py")  # the run's wrapper and its helpers


def release_file(arcname: str, path: Path) -> bytes:
    """What the release holds at ``arcname``: the file, except that a shell script of ``remote/`` is
    ``remote.script``'s text (its ``# fleet: include`` lines filled in: the run dir's names from
    training/contract.py), since the target runs it from there, not through ``remote.sh``."""
    if arcname.startswith("remote/") and arcname.endswith(".sh"):
        return remote.script(path.name).encode()
    return path.read_bytes()


def build_release_tar(
    repo_root: Path, release_id: str, spec: TargetSpec, git: GitInfo, now: dt.datetime
) -> tuple[bytes, dict[str, Any]]:
    """The whole release as one uncompressed tar (in memory) and its manifest."""
    package = repo_root / SHIPPED_PACKAGE
    if not (package / "__init__.py").is_file():
        raise DeployError(f"{package}: the `{SHIPPED_PACKAGE}` package is missing; run deploy from the repo")
    entries = [*_walk_package(package), *((f"remote/{name}", remote.path(name)) for name in RELEASE_REMOTE)]
    content = hashlib.sha256()
    total = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, path in entries:
            data = release_file(arcname, path)
            st = path.stat()
            mode = 0o755 if arcname.endswith(".sh") or st.st_mode & 0o111 else 0o644
            _add_bytes(tar, arcname, data, mode, st.st_mtime)
            content.update(arcname.encode() + b"\0" + hashlib.sha256(data).digest())
            total += len(data)
        run_spec = json.dumps(run_spec_document(spec), indent=2, sort_keys=True).encode() + b"\n"
        _add_bytes(tar, RUN_SPEC_FILE, run_spec, 0o644, now.timestamp())
        manifest = {
            "release_id": release_id,
            "git_sha": git.sha,
            "dirty": git.dirty,
            "diff_sha256": git.diff_sha256,
            "created_at": now.astimezone(dt.UTC).isoformat(timespec="seconds"),
            "user": _user(),
            "target": spec.name,
            "files": len(entries),
            "bytes": total,
            "content_sha256": content.hexdigest(),
        }
        # The manifest goes last: its presence marks a complete upload (checked before the switch).
        data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
        _add_bytes(tar, MANIFEST_FILE, data, 0o644, now.timestamp())
    return buf.getvalue(), manifest


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


# --- remote steps ---------------------------------------------------------------------------------


DEPLOY_LOCKED_EXIT = 75  # deploy_install.sh: the workdir's deploy lock is held by another deploy
ID_TAKEN_EXIT = 76  # deploy_install.sh: the release id is taken or not the newest (a concurrent deploy)
ID_ATTEMPTS = 5


def _sh(target: Target, argv: Sequence[str], what: str, **kwargs: Any) -> str:
    """Run a deploy script (``remote.sh(...)``); DeployError on failure."""
    try:
        result = target.run(argv, **kwargs)
    except CommandFailed as err:
        raise _deploy_error(target, what, err) from None
    return result.stdout


def _deploy_error(target: Target, what: str, err: CommandFailed) -> DeployError:
    if err.command_exit_code == DEPLOY_LOCKED_EXIT:
        return DeployError(
            f"{target.name}: another `fab deploy` into {target.spec.workdir} is running; "
            "nothing was changed: wait for it to finish, then retry"
        )
    why = f"no space left on device: {err.stderr_tail}" if isinstance(err, DiskFull) else err.stderr_tail
    return DeployError(
        f"{target.name}: {what} failed ({why or f'exit {err.command_exit_code}'}); "
        f"the previous release is still current; check {target.spec.workdir} and retry `fab deploy`"
    )


def prepare(target: Target) -> RemoteState:
    """Step 1: skeleton + state (one command; changes nothing a running deploy uses)."""
    spec = target.spec
    args = [spec.workdir, spec.commands.tmux, RUN_SESSION, contract.RUN_RECORD_FILE]
    out = _sh(target, remote.sh("deploy_prepare.sh", *args), "preparing the deploy", timeout=120)
    return parse_prepare_output(out)


def tar_chunks(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    """The tar stream in chunks, as sent on the install command's stdin (tests cut it half-way)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def deploy(target: Target, repo_root: Path, now: dt.datetime | None = None) -> Release:
    """Build, upload and switch to a new release on ``target``; prune old ones. Returns the new one.

    The release id is proposed here and checked under the deploy lock on the target: when a
    deploy that prepared at the same time took it first (or a newer one), the target says so with
    the ids it has, and this deploy proposes the next free id and uploads again (never two
    releases with one id; the ids stay in time order). ``now``: the time the id is made of (the
    hosts of a run over several hosts get one id)."""
    spec = target.spec
    layout = spec.layout
    git = git_info(repo_root)
    state = prepare(target)
    known = list(state.releases)
    for _attempt in range(ID_ATTEMPTS):
        now = now or dt.datetime.now(dt.UTC)
        release_id = make_release_id(now, git.sha7, git.dirty, known)
        data, manifest = build_release_tar(repo_root, release_id, spec, git, now)
        # The live run's release, and the latest run's (a stopped or failed run that `fab train`
        # may continue, whose files `fab logs` and `fab status` name), are never pruned.
        guarded = dict.fromkeys(p for p in (state.live_release, state.latest_release) if p)
        protected = [p for p in guarded if p != release_id]
        args = [spec.workdir, f".tmp-{release_id}", release_id, str(spec.keep_releases), *protected]
        # Named like Target.put_tar's command: it is the release upload (tools and tests recognise it by it).
        install = remote.sh("deploy_install.sh", *args, dollar0="fleet-put-tar")
        try:
            target.run(install, stdin=tar_chunks(data), timeout=600)
        except CommandFailed as err:
            if err.command_exit_code != ID_TAKEN_EXIT:
                raise _deploy_error(target, f"installing release {release_id}", err) from None
            known = [*known, release_id, *prepare(target).releases]  # what got in first
            continue
        return Release(
            id=release_id,
            path=layout.release(release_id),
            manifest=MappingProxyType(manifest),
            live_release=state.live_release,
        )
    raise DeployError(
        f"{target.name}: {ID_ATTEMPTS} deploys into {spec.workdir} took each release id this deploy "
        "proposed; nothing was changed by this one: retry when the others are done"
    )


def current_release(target: Target) -> Release | None:
    """The release ``current`` points at, with its manifest; None before the first deploy."""
    layout = target.spec.layout
    result = target.run(remote.sh("deploy_current.sh", layout.workdir, MANIFEST_FILE), check=False)
    parts = remote.parse_answers(result.stdout)
    release_id = release_id_from_link(remote.ok_output(parts, "link").strip())
    if release_id is None:
        return None
    try:
        manifest = json.loads(remote.ok_output(parts, "manifest") or "{}")
    except json.JSONDecodeError:
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    return Release(id=release_id, path=layout.release(release_id), manifest=MappingProxyType(manifest))
