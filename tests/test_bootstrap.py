"""Set-up anywhere: every lock resolves from a registry, the controller install is light and
covers CPython 3.11-3.13, and `./bootstrap` builds it (or says in one line what is missing).

The bootstrap tests run the real script on a copy of this checkout with a PATH that has no uv,
so it installs the locked uv from PyPI into .venv first, exactly as on a fresh machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from testkit import REPO, require_other_pythons

LOCKS = [REPO / "uv.lock", *sorted(REPO.glob("envs/*/uv.lock"))]
TRAINER_PACKAGES = ("torch", "transformers", "datasets", "tokenizers", "safetensors", "triton")
BARE_PATH = "/usr/bin:/bin"  # no uv, no pyenv shims
SELFTEST_RUN = [
    "-m",
    "training.selftest",
    "train",
    "--config",
    "selftest",
    "--steps",
    "4",
    "--step-seconds",
    "0",
]


def _lock(path: Path) -> dict:
    return tomllib.loads(path.read_text())


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_lock_resolves_from_a_registry(lock: Path) -> None:
    """No lock or pyproject names a file of this machine: each package comes from an index."""
    for package in _lock(lock)["package"]:
        source = package["source"]
        if "virtual" in source or "editable" in source:  # the project itself
            assert source.get("virtual", source.get("editable")) == "."
            continue
        assert set(source) == {"registry"}, (package["name"], source)
        assert source["registry"].startswith("https://"), (package["name"], source)
        for wheel in package.get("wheels", []):
            assert wheel["url"].startswith("https://") and wheel["hash"].startswith("sha256:")
    pyproject = tomllib.loads((lock.parent / "pyproject.toml").read_text())
    sources = pyproject.get("tool", {}).get("uv", {}).get("sources", {})
    assert not any("path" in spec for spec in sources.values()), sources


def _closure(lock: dict, roots: list[str]) -> set[str]:
    packages = {p["name"]: p for p in lock["package"]}
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [d["name"] for d in packages[name].get("dependencies", [])]
    return seen


def test_the_controller_install_is_light_and_the_trainer_is_a_group() -> None:
    lock = _lock(REPO / "uv.lock")
    project = next(p for p in lock["package"] if p["name"] == "fleet")
    controller = _closure(lock, [d["name"] for d in project["dependencies"]])
    assert {"fabric", "invoke", "paramiko", "rich", "matplotlib", "uv"} <= controller
    assert not controller & set(TRAINER_PACKAGES)
    assert not any(name.startswith("nvidia-") for name in controller)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["uv"]["default-groups"] == []
    dev = _closure(lock, [d["name"] for d in project["dev-dependencies"]["dev"]])
    assert {"torch", "transformers", "datasets", "tokenizers", "pytest", "ruff"} <= dev


def test_the_controller_lock_covers_linux_and_macos_on_cpython_3_11_to_3_13() -> None:
    lock = _lock(REPO / "uv.lock")
    assert lock["requires-python"] == ">=3.11, <3.14"
    assert sorted(lock["supported-markers"]) == sorted(
        [
            "platform_machine == 'x86_64' and sys_platform == 'linux'",
            "platform_machine == 'aarch64' and sys_platform == 'linux'",
            "sys_platform == 'darwin'",
        ]
    )
    uv_pin = next(p["version"] for p in lock["package"] if p["name"] == "uv")
    assert f"UV_VERSION={uv_pin} " in (REPO / "bootstrap").read_text()  # what bootstrap installs


def _checkout_copy(dest: Path) -> Path:
    """This checkout's files (tracked and new, not ignored) copied to ``dest``: a fresh clone of
    the working tree, without .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _bootstrap(
    repo: Path, *args: str, python: str = "", path: str = BARE_PATH
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    if python:
        env["PYTHON"] = python
    return subprocess.run(
        [str(repo / "bootstrap"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )


def test_bootstrap_refuses_in_one_line(tmp_path: Path) -> None:
    """Unknown argument, no such python, a Python older than 3.11: one line each, nothing built."""
    repo = _checkout_copy(tmp_path / "repo")
    bad = _bootstrap(repo, "--devv")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "bootstrap: unknown argument '--devv' (usage: ./bootstrap [--dev])"
    ]
    missing = _bootstrap(repo, python="python3.99")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "no python3.99 on PATH: install Python 3.11-3.13" in missing.stderr
    assert "apt-get install python3 python3-venv" in missing.stderr
    old = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.10.*/bin/python3.10"))]
    old += [p for p in (shutil.which("python3.10", path=BARE_PATH),) if p]
    if old:
        too_old = _bootstrap(repo, python=old[0])
        assert too_old.returncode == 1 and len(too_old.stderr.strip().splitlines()) == 1
        assert "is Python 3.10; fleet needs 3.11-3.13" in too_old.stderr
    assert not (repo / ".venv").exists()


def test_a_python_that_does_not_run_is_named(tmp_path: Path) -> None:
    """PYTHON names an interpreter that fails to start (a broken install): one line naming it and
    its error, with or without uv on the machine; uv never goes off to download a CPython instead."""
    repo = _checkout_copy(tmp_path / "repo")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    broken = bin_dir / "python3.12"
    why = "error while loading shared libraries: libpython3.12.so.1.0: cannot open shared object file"
    broken.write_text(f"#!/bin/sh\necho 'python3.12: {why}' >&2\nexit 127\n")
    broken.chmod(0o755)
    without_uv = _bootstrap(repo, python="python3.12", path=f"{bin_dir}:{BARE_PATH}")
    (bin_dir / "uv").symlink_to(REPO / ".venv" / "bin" / "uv")
    with_uv = _bootstrap(repo, python="python3.12", path=f"{bin_dir}:{BARE_PATH}")
    for result in (without_uv, with_uv):
        assert result.returncode == 1, result.stderr
        (line,) = result.stderr.strip().splitlines()[-1:]
        assert line.startswith(f"bootstrap: python3.12 ({broken}) does not run: python3.12: {why}"), line
        assert "download" not in result.stderr and "network" not in result.stderr, result.stderr
    assert len(without_uv.stderr.strip().splitlines()) == 1, without_uv.stderr


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_controller_on_another_python(version: str, tmp_path: Path) -> None:
    """`PYTHON=python3.X ./bootstrap` on a machine without uv: uv from PyPI into .venv, the locked
    controller for that Python (no trainer packages), then `fab --list` and `fab status --log`."""
    python = require_other_pythons()[version]
    repo = _checkout_copy(tmp_path / "repo")
    done = _bootstrap(repo, python=python)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("bootstrap: uv not found: installing uv==") and len(lines) == 3, lines
    assert f".venv is ready (Python {version}." in lines[-1]
    venv_python = repo / ".venv" / "bin" / "python"
    site = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import sys, sysconfig; print(sys.version_info[:2], sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "".join(site[:-1]) == f"({version.replace('.', ',')})"
    assert not any((Path(site[-1]) / name).exists() for name in TRAINER_PACKAGES)
    again = _bootstrap(repo, python=python)  # .venv/bin/uv is found now: no second install
    assert again.returncode == 0 and "uv not found" not in again.stderr

    env = {"PATH": BARE_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    fab = str(repo / ".venv" / "bin" / "fab")
    listed = subprocess.run([fab, "--list"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "deploy" in listed.stdout and "status" in listed.stdout, listed.stderr
    run_dir = tmp_path / "run"
    subprocess.run(
        [str(venv_python), *SELFTEST_RUN, "--run-dir", str(run_dir)],
        cwd=repo,
        env=env,
        capture_output=True,
        check=True,
        timeout=120,
    )
    status = subprocess.run(
        [fab, "status", "--log", str(run_dir)], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stderr
    assert "phase done" in status.stdout and re.search(r"^step\s+4/4", status.stdout, re.M), status.stdout


def _pip() -> list[str]:
    """A pip of this machine to fill the wheel directory with (the dev venv has none)."""
    for python in (shutil.which("python3"), "/usr/bin/python3"):
        if python and subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [python, "-m", "pip"]
    pytest.skip("no pip on this machine to download the wheel directory with")


@pytest.mark.slow
def test_bootstrap_from_a_wheel_directory_needs_no_network(tmp_path: Path) -> None:
    """FLEET_WHEELS=DIR: the lock's own files (README, Offline), checked against its hashes; with
    an empty uv cache and every download refused, the controller venv is exactly the lock."""
    repo = _checkout_copy(tmp_path / "repo")
    wheels, req = tmp_path / "wheels", tmp_path / "req.txt"
    uv = str(REPO / ".venv" / "bin" / "uv")
    subprocess.run(
        [
            uv,
            "export",
            "--locked",
            "--quiet",
            "--format",
            "requirements-txt",
            "--no-emit-project",
            "-o",
            str(req),
        ],
        cwd=REPO,
        check=True,
    )
    download = [*_pip(), "download", "--quiet", "--only-binary", ":all:", "--dest", str(wheels)]
    subprocess.run([*download, "--no-deps", "--require-hashes", "-r", str(req)], check=True, timeout=600)
    subprocess.run([*download, "hatchling", "editables"], check=True, timeout=600)  # builds the project

    refused = "http://127.0.0.1:9"  # the discard port: any download fails at once
    env = {"PATH": BARE_PATH, "HOME": str(tmp_path), "LANG": "C.UTF-8", "FLEET_WHEELS": str(wheels)}
    env.update(
        HTTPS_PROXY=refused, HTTP_PROXY=refused, PIP_CONFIG_FILE="/dev/null", PYTHON="/usr/bin/python3"
    )
    env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    done = subprocess.run(["./bootstrap"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"installing uv==0.13.9 from {wheels}" in done.stderr
    check = subprocess.run(
        [str(repo / ".venv/bin/uv"), "sync", "--locked", "--check", "--offline"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr  # the venv is what uv.lock says, nothing more or less
    listed = subprocess.run([str(repo / ".venv/bin/fab"), "--list"], cwd=repo, env=env, capture_output=True)
    assert listed.returncode == 0


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_local_cpu_env_installs_on_other_pythons(version: str, tmp_path: Path) -> None:
    """envs/local-cpu's lock has torch and every other wheel for CPython 3.12 and 3.13 too (a dry
    run of the exact `uv sync --locked` fleet runs on a target, with that interpreter)."""
    python = require_other_pythons()[version]
    uv = str(REPO / ".venv" / "bin" / "uv")
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv"), "UV_NO_CONFIG": "1"}
    done = subprocess.run(
        [uv, "sync", "--locked", "--dry-run", "--no-install-project", "--python", python],
        cwd=REPO / "envs" / "local-cpu",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert " + torch==2.13.0" in done.stderr and "Would install" in done.stderr


def test_bootstrap_without_network_is_one_line(tmp_path: Path) -> None:
    """uv on PATH, an empty uv cache, every download refused: one line with the cause and the fix."""
    repo = _checkout_copy(tmp_path / "repo")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").symlink_to(REPO / ".venv" / "bin" / "uv")
    refused = "http://127.0.0.1:9"
    env = {"PATH": f"{bin_dir}:{BARE_PATH}", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    env.update(HTTPS_PROXY=refused, UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_HTTP_RETRIES="0")
    done = subprocess.run(["./bootstrap"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("bootstrap: installing"), lines
    assert "uv could not download the controller's packages from PyPI" in lines[1]
    assert "Connection refused" in lines[1] and "FLEET_WHEELS=DIR" in lines[1]
