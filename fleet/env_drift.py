"""Drift of a built env against its lock: the pure part (data in, report out) and its rendering.

The expected set of a venv is the lock's packages that the build actually installed on that
target (recorded in the env manifest right after ``uv sync --locked`` into a fresh venv, so the
lock's platform markers are already applied), with the versions the lock pins. Anything else in
the venv is ``extra``; a pinned package that is gone is ``missing``; another version, local tag
included (``2.11.0+cu128`` vs ``2.11.0+cu130``), is ``changed``; a distribution whose INSTALLER
is not uv was put there by hand (``installer``); a file that differs from its RECORD is
``modified``. ``uv sync --locked --check`` runs too, as a second opinion.
"""

from __future__ import annotations

import io
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.errors import EnvError

EXPECTED_INSTALLER = "uv"


@dataclass(frozen=True)
class LockedPackage:
    """One ``[[package]]`` of a uv.lock."""

    name: str
    version: str
    source: str  # "registry", "path", "url", "git", "virtual", "editable", "directory"


@dataclass(frozen=True)
class DistDiff:
    """One line of a drift report."""

    name: str
    expected: str = ""  # the locked version ("" for an extra distribution)
    found: str = ""  # the installed version, or the installer / reason for other kinds
    detail: str = ""


@dataclass(frozen=True)
class DriftReport:
    """The result of ``check_env``: what differs between a target's current venv and its lock."""

    target: str
    env: str
    path: str
    env_hash: str
    extra: tuple[DistDiff, ...] = ()
    missing: tuple[DistDiff, ...] = ()
    changed: tuple[DistDiff, ...] = ()
    installer: tuple[DistDiff, ...] = ()
    modified: tuple[DistDiff, ...] = ()
    stale_lock: bool = False  # envs/<name>/uv.lock changed since this env was built
    uv_check: str = "ok"  # "ok" | "drift" | "unavailable: <why>"
    uv_lines: tuple[str, ...] = ()
    checked: int = 0  # distributions looked at
    hashed_files: int = 0
    notes: tuple[str, ...] = field(default=())
    # The env's torch has no kernel for these GPUs' architecture (fleet.gpu_arch): one line and the fix
    gpu_arch: str = ""

    @property
    def drift(self) -> bool:
        return bool(
            self.extra
            or self.missing
            or self.changed
            or self.installer
            or self.modified
            or self.stale_lock
            or self.uv_check == "drift"
        )

    def summary(self) -> str:
        """One line naming what drifted (for error messages)."""
        parts = []
        if self.extra:
            parts.append("extra: " + ", ".join(f"{d.name}=={d.found}" for d in self.extra))
        if self.missing:
            parts.append("missing: " + ", ".join(d.name for d in self.missing))
        if self.changed:
            parts.append("changed: " + ", ".join(f"{d.name} {d.expected} -> {d.found}" for d in self.changed))
        if self.installer:
            parts.append("not installed by uv: " + ", ".join(f"{d.name} ({d.found})" for d in self.installer))
        if self.modified:
            names = sorted({d.name for d in self.modified})
            parts.append(f"{len(self.modified)} file(s) modified in " + ", ".join(names))
        if self.stale_lock:
            parts.append(f"envs/{self.env}/uv.lock changed since the build")
        if self.uv_check == "drift" and not parts:
            parts.append("`uv sync --check` reports changes")
        return "; ".join(parts) if parts else "no drift"

    def to_json(self) -> dict[str, Any]:
        def rows(items: Iterable[DistDiff]) -> list[dict[str, str]]:
            return [asdict(d) for d in items]

        return {
            "target": self.target,
            "env": self.env,
            "path": self.path,
            "env_hash": self.env_hash,
            "drift": self.drift,
            "extra": rows(self.extra),
            "missing": rows(self.missing),
            "changed": rows(self.changed),
            "installer": rows(self.installer),
            "modified": rows(self.modified),
            "stale_lock": self.stale_lock,
            "uv_check": self.uv_check,
            "uv_lines": list(self.uv_lines),
            "checked": self.checked,
            "hashed_files": self.hashed_files,
            "notes": list(self.notes),
            "gpu_arch": self.gpu_arch,
        }

    def text(self, width: int = 110) -> str:
        """A rich table of the drift (or one line saying there is none)."""
        console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
        head = f"{self.target}: env {self.env} ({self.path}, hash {self.env_hash})"
        if not self.drift:
            console.print(
                f"{head}: no drift; {self.checked} distributions match the lock, uv check {self.uv_check}",
                soft_wrap=True,
            )
        else:
            table = Table(title=f"{head}: DRIFT", title_justify="left")
            for column in ("kind", "distribution", "locked", "found", "detail"):
                table.add_column(column)
            for kind, items in (
                ("extra", self.extra),
                ("missing", self.missing),
                ("changed", self.changed),
                ("installer", self.installer),
                ("modified", self.modified),
            ):
                for d in items:
                    table.add_row(kind, d.name, d.expected, d.found, d.detail)
            if self.stale_lock:
                table.add_row("lock", f"envs/{self.env}/uv.lock", "", "", "changed since this env was built")
            console.print(table)
            console.print(f"uv sync --check: {self.uv_check}; fix with `fab env-rebuild`", soft_wrap=True)
        if self.gpu_arch:
            console.print(f"{self.target}: GPU ARCHITECTURE: {self.gpu_arch}", soft_wrap=True)
        for note in self.notes:
            console.print(f"note: {note}", soft_wrap=True)
        return console.file.getvalue()  # type: ignore[attr-defined]

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)


def normalize_name(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def normalize_version(version: str) -> str:
    """Enough of PEP 440 normalization to compare METADATA and uv.lock versions exactly."""
    v = version.strip().lower()
    if v.startswith("v"):
        v = v[1:]
    public, plus, local = v.partition("+")
    return public + (plus + re.sub(r"[-_]", ".", local) if plus else "")


def parse_lock(text: str, where: str = "uv.lock") -> dict[str, LockedPackage]:
    """The packages of a uv.lock (the project itself, a virtual/editable root, left out)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise EnvError(f"{where}: not a valid uv.lock ({err}); regenerate it with `uv lock`") from None
    packages: dict[str, LockedPackage] = {}
    for raw in data.get("package", []):
        source = raw.get("source", {})
        kind = next(iter(source), "registry") if isinstance(source, dict) else "registry"
        if kind in ("virtual", "editable") or (kind == "directory" and source.get(kind) == "."):
            continue
        name = normalize_name(str(raw.get("name", "")))
        if name:
            packages[name] = LockedPackage(name, str(raw.get("version", "")), kind)
    return packages


def diff_env(
    lock: Mapping[str, LockedPackage],
    expected_names: Sequence[str],
    installed: Sequence[Mapping[str, str]],
    modified: Sequence[Mapping[str, str]],
) -> dict[str, tuple[DistDiff, ...]]:
    """Compare the installed distributions with the lock. Pure: the probe's data in, diffs out.

    ``expected_names``: what the build installed (the lock with the target's markers applied).
    ``installed``/``modified``: ``env_probe.py dists`` output (``dists`` and ``modified``).
    """
    expected = {normalize_name(n) for n in expected_names}
    found: dict[str, Mapping[str, str]] = {}
    for dist in installed:
        found.setdefault(normalize_name(dist["name"]), dist)
    extra, missing, changed, installer = [], [], [], []
    for name, dist in sorted(found.items()):
        version = dist.get("version", "")
        if name not in expected:
            detail = "not in the lock" if name not in lock else "locked, but not for this platform"
            detail += f" (installed by {dist.get('installer') or 'unknown'})"
            extra.append(DistDiff(name, "", version, detail))
            continue
        want = lock[name].version if name in lock else ""
        if want and normalize_version(want) != normalize_version(version):
            changed.append(DistDiff(name, want, version, "version differs from the lock"))
        who = dist.get("installer", "")
        if who != EXPECTED_INSTALLER:
            installer.append(DistDiff(name, want, who or "(none)", "INSTALLER is not uv"))
    for name in sorted(expected - found.keys()):
        missing.append(DistDiff(name, lock[name].version if name in lock else "", "", "not installed"))
    files = [
        DistDiff(_dist_of(m["dist"]), "", m.get("path", ""), m.get("reason", ""))
        for m in sorted(modified, key=lambda m: (m.get("dist", ""), m.get("path", "")))
    ]
    return {
        "extra": tuple(extra),
        "missing": tuple(missing),
        "changed": tuple(changed),
        "installer": tuple(installer),
        "modified": tuple(files),
    }


def _dist_of(dist_info: str) -> str:
    """``transformers-5.8.1.dist-info`` -> ``transformers``."""
    stem = dist_info.removesuffix(".dist-info")
    return normalize_name(stem.rpartition("-")[0] or stem)


def parse_uv_check(exit_code: int, output: str) -> tuple[str, tuple[str, ...]]:
    """``uv sync --locked --check`` output -> ("ok"|"drift"|"unavailable: ...", the +/- lines)."""
    lines = tuple(line.strip() for line in output.splitlines() if re.match(r"^\s*[-+~] \S", line))
    if exit_code == 0:
        return "ok", lines
    if lines or "environment is outdated" in output:
        return "drift", lines
    tail = " ".join(output.strip().splitlines()[-1:])[:200]
    return f"unavailable: {tail or f'exit {exit_code}'}", lines
