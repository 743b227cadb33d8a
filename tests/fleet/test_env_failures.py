"""A failed env build is one line naming the cause and the fix: uv's recorded real error output
(tests/fixtures/uv/), then real builds on the local target that cannot succeed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleet import envs
from fleet.errors import EnvError
from fleet.inventory import TargetSpec
from fleet.target import open_target

REPO = Path(__file__).resolve().parents[2]
UV_OUT = REPO / "tests" / "fixtures" / "uv"

# fixture -> what the line must say (cause and fix)
EXPLAINED = {
    "network": ("cannot download six==1.17.0 from PyPI", "Connection refused", "files.pythonhosted.org"),
    "dns": ("cannot download idna==3.10", "failed to lookup address information", "uv_cache"),
    "stale_lock": ("envs/local-cpu/uv.lock is out of date", "run `uv lock` in envs/local-cpu"),
    "platform": ("locked for `platform_machine == 'aarch64' and sys_platform == 'linux'` only", "[tool.uv]"),
    "no_wheel": ("torch 2.13.0 needs glibc >= 2.28", "this target has glibc 2.17", "newer OS image"),
    "hash_mismatch": ("idna==3.10 does not have the sha256", "proxy or mirror"),
    "disk_full": ("no space left on the target's disk", "uv_cache"),
    "path_missing": ("names a local file that this target does not have", "from a registry"),
}


@pytest.mark.parametrize("name", sorted(EXPLAINED))
def test_uv_failures_become_one_line_with_the_fix(name: str) -> None:
    line = envs.explain_uv_failure((UV_OUT / f"{name}.txt").read_text(), "local-cpu")
    assert "\n" not in line and len(line) < 400, line
    for part in EXPLAINED[name]:
        assert part in line, (part, line)


def test_an_unknown_uv_failure_keeps_uvs_own_error_and_last_cause() -> None:
    text = "Resolved 3 packages\nerror: Something new\n  cause: deeper reason\n\nhint: whatever\n"
    assert envs.explain_uv_failure(text, "x") == "uv: Something new (deeper reason)"
    assert envs.explain_uv_failure("", "x") == "uv: no output"


def _smoke_repo(tmp_path: Path, requires_python: str = "") -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "envs" / "smoke", root / "envs" / "smoke")
    if requires_python:
        pyproject = root / "envs" / "smoke" / "pyproject.toml"
        pyproject.write_text(pyproject.read_text().replace('requires-python = ">=3.11"', requires_python))
    return root


def test_no_matching_python_says_what_is_there_and_what_to_install(tmp_path: Path) -> None:
    """requires-python that no interpreter meets: uv's download attempt fails (no such release,
    or no network); the line names the request, the target's python3 and the fix."""
    repo = _smoke_repo(tmp_path, 'requires-python = ">=3.99"')
    spec = TargetSpec(name="t", host="local", workdir=str(tmp_path / "wd"), env="smoke")
    with open_target(spec) as target, pytest.raises(EnvError) as caught:
        envs.ensure_env(target, repo)
    line = str(caught.value)
    assert "\n" not in line, line
    assert "no Python matching '>=3.99'" in line and "`python3 -V`: Python 3." in line
    assert "install one there" in line and "uv could not download one" in line
    assert not list((tmp_path / "wd" / "envs").glob(".staging-*"))


def test_no_network_to_pypi_is_one_line_and_keeps_uvs_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty uv cache and a proxy that refuses: the build fails with the cause and the fix,
    uv's full output stays in a log on the target, no staging dir is left."""
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # discard port: connection refused
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    repo = _smoke_repo(tmp_path)
    spec = TargetSpec(
        name="t", host="local", workdir=str(tmp_path / "wd"), env="smoke", uv_cache=str(tmp_path / "cache")
    )
    with open_target(spec) as target, pytest.raises(EnvError) as caught:
        envs.ensure_env(target, repo)
    line = str(caught.value)
    assert "\n" not in line
    assert "`uv sync --locked` of envs/smoke failed: cannot download" in line
    assert "Connection refused" in line and "current env is unchanged" in line
    log = tmp_path / "wd" / "envs" / "smoke" / "build-failed.log"
    assert str(log) in line and "error: Failed to download" in log.read_text()
    assert not list((tmp_path / "wd" / "envs").glob(".staging-*"))


def test_a_failed_python_download_is_reduced_to_its_root_cause() -> None:
    """What `fab deploy` quotes when uv cannot download a Python (recorded offline)."""
    causes = envs._uv_causes((UV_OUT / "python_install_offline.txt").read_text())
    assert causes[0].startswith("Failed to install cpython-3.13")
    assert causes[-1] == "failed to lookup address information: Name or service not known"
